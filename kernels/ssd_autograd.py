"""autograd wiring of the Triton SSD, and the ``ssd_triton`` entry point.

The Triton core computes the un-normalised scan without D. ``normalize`` appends a column of ones to x
(so the last state row and output column are the normaliser, exactly the same scan) and divides
afterwards; ``D x`` is added last. Both are plain tensor ops on top of the core, so autograd covers them.
No epsilon is added to the normaliser: callers must keep it away from zero (positive B, C feature maps
make it strictly positive).
"""

from __future__ import annotations

import os

import torch

from .reference import doc_ids_from_seq_idx
from .ssd_triton_bwd import ssd_bwd
from .ssd_triton_fwd import ssd_fwd

__all__ = ["ssd_triton", "SSDCoreFunction"]


class SSDCoreFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dt, A, B, C, initial_state, doc, chunk_size, out_dtype):
        y, final, states, gdec = ssd_fwd(x, dt, A, B, C, initial_state, doc, chunk_size, out_dtype)
        ctx.save_for_backward(x, dt, A, B, C, doc, states, gdec)
        ctx.chunk_size = chunk_size
        ctx.has_init = initial_state is not None
        return y, final

    @staticmethod
    def backward(ctx, dy, dfinal):
        x, dt, A, B, C, doc, states, gdec = ctx.saved_tensors
        if dy is None:
            dy = torch.zeros(x.shape, device=x.device, dtype=x.dtype)
        dx, ddt, dA, dB, dC, dinit = ssd_bwd(dy, dfinal, x, dt, A, B, C, doc, states, gdec,
                                             ctx.chunk_size, ctx.has_init)
        return dx, ddt, dA, dB, dC, dinit, None, None, None


def _check(x, dt, A, B, C, chunk_size):
    b, l, h, p = x.shape
    if dt.shape != (b, l, h) or A.shape != (h,):
        raise ValueError(f"dt must be (b, l, h) = {(b, l, h)} and A (h,); got {tuple(dt.shape)}, {tuple(A.shape)}")
    if B.shape != C.shape or B.shape[:2] != (b, l) or h % B.shape[2] != 0:
        raise ValueError(f"B, C must be (b, l, g, n) with h % g == 0; got {tuple(B.shape)}, {tuple(C.shape)}")
    if l * h * (p + 1) >= 2 ** 31 or l * B.shape[2] * B.shape[3] >= 2 ** 31:
        raise ValueError("one sequence over 2^31 elements: the kernels index within a sequence in int32")
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two >= 16 for the Triton kernel, got {chunk_size}")


def ssd_triton(x, dt, A, B, C, chunk_size=64, D=None, initial_state=None, seq_idx=None,
               normalize=False, return_final_state=False):
    """The contract of :func:`kernels.ssd`, computed by the Triton kernels."""
    _check(x, dt, A, B, C, chunk_size)
    if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("the Triton SSD needs CUDA tensors (or TRITON_INTERPRET=1 set before importing "
                           "triton); use backend='torch' on CPU")
    b, l, h, p = x.shape
    xin = x
    xc = x.contiguous()
    if normalize:
        xc = torch.cat([xc, torch.ones_like(xc[..., :1])], dim=-1)
    dtc = dt.contiguous().float() if dt.dtype != torch.float32 else dt.contiguous()
    Ac = A.contiguous().float() if A.dtype != torch.float32 else A.contiguous()
    Bc = B.contiguous().to(x.dtype)
    Cc = C.contiguous().to(x.dtype)
    init = initial_state.contiguous().float() if initial_state is not None else None
    doc = doc_ids_from_seq_idx(seq_idx, b, l, x.device).contiguous() if seq_idx is not None else None
    out_dtype = torch.float32 if normalize else x.dtype
    y, final = SSDCoreFunction.apply(xc, dtc, Ac, Bc, Cc, init, doc, int(chunk_size), out_dtype)
    if normalize:
        y = y[..., :p] / y[..., p:]
    if D is not None:
        Dv = D[:, None] if D.dim() == 1 else D
        y = y + Dv.to(y.dtype) * xin.to(y.dtype)
    y = y.to(x.dtype)
    if return_final_state:
        return y, final
    return y
