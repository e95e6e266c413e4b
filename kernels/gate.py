"""The mixer's output gate ``y * 2 sigmoid(z)`` in Triton: one kernel each way (the plain version is three
elementwise passes forward and four backward over a (b, l, d) tensor). fp32 math; y and z any float dtype,
same number of elements (z as the gate projection's (b, l, d), y as the SSD's (b, l, h, P)). The output and dy
take y's dtype, dz takes z's. Reference: ``reference.sigmoid_gate_reference``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .host_math import cdiv
from .launch import launch

__all__ = ["sigmoid_gate_triton"]

_BLOCK = 2048


@triton.jit
def _gate_fwd(Y, Z, OUT, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    y = tl.load(Y + offs, mask=m, other=0.0).to(tl.float32)
    z = tl.load(Z + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(OUT + offs, (y * 2.0 * tl.sigmoid(z)).to(OUT.dtype.element_ty), mask=m)


@triton.jit
def _gate_bwd(G, Y, Z, DY, DZ, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    g = tl.load(G + offs, mask=m, other=0.0).to(tl.float32)
    y = tl.load(Y + offs, mask=m, other=0.0).to(tl.float32)
    s = tl.sigmoid(tl.load(Z + offs, mask=m, other=0.0).to(tl.float32))
    tl.store(DY + offs, (g * 2.0 * s).to(DY.dtype.element_ty), mask=m)
    tl.store(DZ + offs, (g * y * 2.0 * s * (1.0 - s)).to(DZ.dtype.element_ty), mask=m)


class _SigmoidGate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, z):
        y, z = y.contiguous(), z.contiguous()
        out = torch.empty_like(y)
        n = y.numel()
        if n:
            launch(_gate_fwd, (cdiv(n, _BLOCK),), y, z, out, n, BLOCK=_BLOCK)
        ctx.save_for_backward(y, z)
        return out

    @staticmethod
    def backward(ctx, g):
        y, z = ctx.saved_tensors
        dy, dz = torch.empty_like(y), torch.empty_like(z)
        n = y.numel()
        if n:
            launch(_gate_bwd, (cdiv(n, _BLOCK),), g.contiguous(), y, z, dy, dz, n, BLOCK=_BLOCK)
        return dy, dz


def sigmoid_gate_triton(y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """``y * 2 sigmoid(z)`` with z read in y's layout (same number of elements); shape and dtype of y.
    Triton; CUDA tensors, or CPU ones under ``TRITON_INTERPRET=1``."""
    if y.numel() != z.numel():
        raise ValueError(f"sigmoid_gate: y {tuple(y.shape)} and z {tuple(z.shape)} differ in size")
    return _SigmoidGate.apply(y, z)
