"""The Hedgehog feature map ``phi(u) = softmax([W u + b, -(W u + b)])`` per head, fused for the GPU.

The projection ``z = W u`` (a small matrix per head) stays a cuBLAS batched matmul in u's dtype; what the
plain version spends around it (an fp32 cast, the bias add, the negated copy, the concatenation, the
fp32 softmax and the cast back, with the fp32 softmax output kept for the backward) is one Triton kernel
each way here:

- forward: ``phi = softmax([z + b, -(z + b)])`` per row, fp32 math, written in u's dtype;
- backward: ``dz = phi_+ (g_+ - s) - phi_- (g_- - s)``, ``s = sum(phi * g)`` per row, fp32, from the saved
  ``phi`` (the only activation kept besides u), then ``du``, ``dW`` by matmuls and ``db`` by a sum.

``hedgehog_feature_map_reference`` (``reference.py``) is the plain PyTorch version (``models.feature_map``
uses it on CPU and inside compiled graphs); the tests compare the two, forward and backward, under
``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .host_math import cdiv, next_pow2
from .launch import launch


__all__ = ["hedgehog_feature_map"]


@triton.jit
def _fm_fwd(Z, BIAS, OUT, R, H, F, BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)  # rows x 2F may pass 2^31
    cols = tl.arange(0, BLOCK_F)
    mask = (rows < R)[:, None] & (cols < F)[None, :]
    z = tl.load(Z + rows[:, None] * F + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    heads = rows % H
    z += tl.load(BIAS + heads[:, None] * F + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    m = tl.max(tl.where(mask, tl.abs(z), float("-inf")), axis=1)  # the max of [z, -z]
    m = tl.where(rows < R, m, 0.0)
    e_pos = tl.where(mask, tl.exp(z - m[:, None]), 0.0)
    e_neg = tl.where(mask, tl.exp(-z - m[:, None]), 0.0)
    inv = 1.0 / tl.where(rows < R, tl.sum(e_pos + e_neg, axis=1), 1.0)
    out = OUT + rows[:, None] * (2 * F) + cols[None, :]
    tl.store(out, (e_pos * inv[:, None]).to(OUT.dtype.element_ty), mask=mask)
    tl.store(out + F, (e_neg * inv[:, None]).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _fm_bwd(PHI, G, DZ, R, F, BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.arange(0, BLOCK_F)
    mask = (rows < R)[:, None] & (cols < F)[None, :]
    off = rows[:, None] * (2 * F) + cols[None, :]
    p_pos = tl.load(PHI + off, mask=mask, other=0.0).to(tl.float32)
    p_neg = tl.load(PHI + off + F, mask=mask, other=0.0).to(tl.float32)
    g_pos = tl.load(G + off, mask=mask, other=0.0).to(tl.float32)
    g_neg = tl.load(G + off + F, mask=mask, other=0.0).to(tl.float32)
    s = tl.sum(p_pos * g_pos + p_neg * g_neg, axis=1)
    dz = p_pos * (g_pos - s[:, None]) - p_neg * (g_neg - s[:, None])
    tl.store(DZ + rows[:, None] * F + cols[None, :], dz, mask=mask)


def _block_rows(F: int) -> int:
    return max(1, min(64, 4096 // next_pow2(F)))


class _HedgehogFeatureMap(torch.autograd.Function):
    @staticmethod
    def forward(ctx, u, weight, bias):
        h, F, P = weight.shape
        w = weight.to(u.dtype)
        z = torch.einsum("...hp,hfp->...hf", u, w).contiguous()
        R = z.numel() // F
        out = torch.empty(*z.shape[:-1], 2 * F, dtype=u.dtype, device=u.device)
        br = _block_rows(F)
        if R:
            launch(_fm_fwd, (cdiv(R, br),), z, bias.contiguous(), out, R, h, F, BLOCK_R=br,
                   BLOCK_F=next_pow2(F))
        ctx.save_for_backward(u, w, out)
        ctx.dtypes = (weight.dtype, bias.dtype)
        return out

    @staticmethod
    def backward(ctx, g):
        u, w, phi = ctx.saved_tensors
        h, F, _ = w.shape
        R = phi.numel() // (2 * F)
        dz = torch.empty(*phi.shape[:-1], F, dtype=torch.float32, device=phi.device)
        br = _block_rows(F)
        if R:
            launch(_fm_bwd, (cdiv(R, br),), phi, g.contiguous(), dz, R, F, BLOCK_R=br,
                   BLOCK_F=next_pow2(F))
        need_u, need_w, need_b = ctx.needs_input_grad
        w_dtype, b_dtype = ctx.dtypes
        dz_u = dz.to(u.dtype)
        du = torch.einsum("...hf,hfp->...hp", dz_u, w) if need_u else None  # stage 1: q, k carry no grad
        dw = torch.einsum("...hf,...hp->hfp", dz_u, u).to(w_dtype) if need_w else None
        db = dz.reshape(-1, h, F).sum(0).to(b_dtype) if need_b else None
        return du, dw, db


def hedgehog_feature_map(u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The fused feature map (Triton; CUDA tensors, or CPU ones under ``TRITON_INTERPRET=1``); the same contract
    as ``hedgehog_feature_map_reference``."""
    if u.shape[-2:] != (weight.shape[0], weight.shape[2]) or bias.shape != weight.shape[:2]:
        raise ValueError(f"hedgehog_feature_map: u {tuple(u.shape)}, weight {tuple(weight.shape)} and bias "
                         f"{tuple(bias.shape)} do not match ((..., h, P), (h, F, P), (h, F))")
    return _HedgehogFeatureMap.apply(u, weight, bias)
