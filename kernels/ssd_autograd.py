"""autograd wiring of the Triton SSD, and the ``ssd_triton`` entry point.

By default (v2 backward) ``normalize`` and ``D`` are fused into the core: the states carry the normaliser as one
extra row (x keeps its P columns, no padded p tile), the scan kernel divides by it and adds ``D x`` before
writing y in the input dtype, keeping the fp32 numerator for the backward, whose first step
(``norm_bwd_prologue``) takes the gradient through the division. ``HMSCALE_SSD_NORM=cat`` (and the v1 backward)
instead appends a column of ones to x (the last state row and output column are then the normaliser, exactly
the same scan), and the division and ``D x`` are plain tensor ops on top of the core, for autograd.
No epsilon is added to the normaliser: callers must keep it away from zero (positive B, C feature maps
make it strictly positive).
"""

from __future__ import annotations

import os

import torch

from .reference import doc_ids_from_seq_idx
from .ssd_triton_bwd import bwd_variant, ssd_bwd
from .ssd_triton_fwd import norm_bwd_prologue, ssd_fwd

__all__ = ["ssd_triton", "SSDCoreFunction", "norm_mode"]


class SSDCoreFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dt, A, B, C, initial_state, doc, chunk_size, out_dtype, norm=False, D=None):
        need = any(ctx.needs_input_grad)
        Dhp = None
        if D is not None:  # fused D skip, as (h, p) fp32
            h, p = x.shape[2], x.shape[3]
            Dhp = (D[:, None] if D.dim() == 1 else D).float().expand(h, p).contiguous()
        y, ynum, den, final, states, gdec = ssd_fwd(x, dt, A, B, C, initial_state, doc, chunk_size, out_dtype,
                                                    norm, Dhp, save_ynum=need)
        ctx.save_for_backward(x, dt, A, B, C, doc, states, gdec, ynum, den, Dhp)
        ctx.chunk_size = chunk_size
        ctx.has_init = initial_state is not None
        ctx.norm = norm
        ctx.D_meta = (D.shape, D.dtype) if D is not None else None
        return y, final

    @staticmethod
    def backward(ctx, dy, dfinal):
        x, dt, A, B, C, doc, states, gdec, ynum, den, Dhp = ctx.saved_tensors
        if dy is None:
            dy = torch.zeros(x.shape, device=x.device, dtype=x.dtype)
        dden = None
        dyn = dy
        if ctx.norm:
            dyn, dden = norm_bwd_prologue(dy, ynum, den)
        dx, ddt, dA, dB, dC, dinit, dD = ssd_bwd(dyn, dden, dfinal, x, dt, A, B, C, doc, states, gdec,
                                                 ctx.chunk_size, ctx.has_init, D=Dhp, dyo=dy)
        if ctx.D_meta is not None:
            shape, dtype = ctx.D_meta
            dD = (dD.sum(-1) if len(shape) == 1 else dD).to(dtype)
        return dx, ddt, dA, dB, dC, dinit, None, None, None, None, dD


def norm_mode() -> str:
    """``fused`` (default: the normaliser is one extra state row inside the kernels) or ``cat`` (a column of ones
    appended to x; always used with the v1 backward). Env ``HMSCALE_SSD_NORM``."""
    v = os.environ.get("HMSCALE_SSD_NORM", "fused").lower()
    if v not in ("fused", "cat"):
        raise ValueError(f"HMSCALE_SSD_NORM must be fused or cat, got {v!r}")
    return "cat" if bwd_variant() == "v1" else v


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
    # fused (the v2 default): the normaliser row lives in the kernels and the scan applies 1 / den and D x itself
    fused = bwd_variant() == "v2" and (not normalize or norm_mode() == "fused")
    if normalize and not fused:
        xc = torch.cat([xc, torch.ones_like(xc[..., :1])], dim=-1)
    dtc = dt.contiguous().float() if dt.dtype != torch.float32 else dt.contiguous()
    Ac = A.contiguous().float() if A.dtype != torch.float32 else A.contiguous()
    Bc = B.contiguous().to(x.dtype)
    Cc = C.contiguous().to(x.dtype)
    init = initial_state.contiguous().float() if initial_state is not None else None
    doc = doc_ids_from_seq_idx(seq_idx, b, l, x.device).contiguous() if seq_idx is not None else None
    if fused:
        y, final = SSDCoreFunction.apply(xc, dtc, Ac, Bc, Cc, init, doc, int(chunk_size), x.dtype,
                                         bool(normalize), D)
        if return_final_state:
            return y, final
        return y
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
