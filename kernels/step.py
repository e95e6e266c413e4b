"""One-token SSD decode step: ``S <- exp(dt A) S + dt x B^T``, ``y = S C`` (+ D x), optional normaliser.

``ssd_step_torch`` (``kernels.step_torch``, re-exported here) is plain PyTorch (CPU, autograd); ``ssd_step_triton``
is one fused Triton launch that reads the state once and writes the new state once (the memory floor of a decode
step), with the normaliser row and the D skip folded in (where an input requires grad under autograd, its backward
differentiates ``ssd_step_torch``). Both check their arguments first (``check_step_args``).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from .host_math import cdiv, next_pow2
from .launch import launch
from .step_torch import check_step_args, ssd_step_torch

__all__ = ["ssd_step_torch", "ssd_step_triton", "check_step_args"]


@triton.jit
def _ssd_step_kernel(st_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, new_ptr, y_ptr,
                     H, G, P, N, PS, D_STRIDE_H, D_STRIDE_P,
                     BP: tl.constexpr, BN: tl.constexpr, NORM: tl.constexpr, HAS_D: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)
    pb = tl.program_id(1)
    b = bh // H
    h = bh % H
    grp = h // (H // G)
    offs_p = pb * BP + tl.arange(0, BP)
    offs_n = tl.arange(0, BN)
    mask_p = offs_p < P
    mask_n = offs_n < N
    dt = tl.load(dt_ptr + bh).to(tl.float32)
    decay = tl.exp(dt * tl.load(A_ptr + h).to(tl.float32))
    Bv = tl.load(B_ptr + (b * G + grp) * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    Cv = tl.load(C_ptr + (b * G + grp) * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    xv = tl.load(x_ptr + bh * P + offs_p, mask=mask_p, other=0.0).to(tl.float32)
    so = (bh * PS + offs_p[:, None]) * N + offs_n[None, :]
    sm = mask_p[:, None] & mask_n[None, :]
    S = tl.load(st_ptr + so, mask=sm, other=0.0)
    S = decay * S + (dt * xv)[:, None] * Bv[None, :]
    tl.store(new_ptr + so, S, mask=sm)
    y = tl.sum(S * Cv[None, :], axis=1)
    if NORM:
        zo = (bh * PS + P) * N + offs_n
        z = tl.load(st_ptr + zo, mask=mask_n, other=0.0)
        z = decay * z + dt * Bv
        if pb == 0:
            tl.store(new_ptr + zo, z, mask=mask_n)
        y = y / tl.sum(z * Cv, axis=0)
    if HAS_D:
        Dv = tl.load(D_ptr + h * D_STRIDE_H + offs_p * D_STRIDE_P, mask=mask_p, other=0.0).to(tl.float32)
        y += Dv * xv
    tl.store(y_ptr + bh * P + offs_p, y.to(y_ptr.dtype.element_ty), mask=mask_p)


class _StepTritonFunction(torch.autograd.Function):
    """The fused step forward; its backward differentiates the PyTorch step (recomputed: one token, cheap). Used only
    where autograd needs gradients: without it the outputs of the Triton step silently required none."""

    @staticmethod
    def forward(ctx, state, x_t, dt_t, A, B_t, C_t, D, normalize):
        ctx.save_for_backward(state, x_t, dt_t, A, B_t, C_t, D)
        ctx.normalize = normalize
        return _ssd_step_triton(state, x_t, dt_t, A, B_t, C_t, D, normalize)

    @staticmethod
    @once_differentiable  # a second derivative raises instead of silently being zero (the backward runs no graph)
    def backward(ctx, dy, dnew):
        saved = ctx.saved_tensors
        leaves = [None if t is None else t.detach().requires_grad_(need)
                  for t, need in zip(saved, ctx.needs_input_grad)]
        with torch.enable_grad():
            y, new = ssd_step_torch(*leaves[:6], D=leaves[6], normalize=ctx.normalize)
            wrt = [t for t, need in zip(leaves, ctx.needs_input_grad) if t is not None and need]
            outs, grads_out = [], []
            for o, go in ((y, dy), (new, dnew)):
                if go is not None:
                    outs.append(o)
                    grads_out.append(go)
            grads = iter(torch.autograd.grad(outs, wrt, grads_out, allow_unused=True))
        return (*(next(grads) if t is not None and need else None
                  for t, need in zip(leaves, ctx.needs_input_grad[:7])), None)


def ssd_step_triton(state, x_t, dt_t, A, B_t, C_t, D=None, normalize=False):
    check_step_args(state, x_t, dt_t, A, B_t, C_t, D, normalize)
    if not x_t.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":  # (as the scan; Triton's own: "0 active drivers")
        raise RuntimeError("the Triton SSD needs CUDA tensors (or TRITON_INTERPRET=1 set before importing "
                           "triton); use backend='torch' on CPU")
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (state, x_t, dt_t, A, B_t, C_t, D)):
        return _StepTritonFunction.apply(state, x_t, dt_t, A, B_t, C_t, D, bool(normalize))
    return _ssd_step_triton(state, x_t, dt_t, A, B_t, C_t, D, normalize)


def _ssd_step_triton(state, x_t, dt_t, A, B_t, C_t, D, normalize):
    b, h, p = x_t.shape
    g, n = B_t.shape[1], B_t.shape[2]
    ps = state.shape[2]
    state, x_t = state.contiguous(), x_t.contiguous()
    # allocated contiguous, as the kernel writes them (empty_like would keep a permuted input's strides)
    new = torch.empty(state.shape, dtype=state.dtype, device=state.device)
    y = torch.empty(x_t.shape, dtype=x_t.dtype, device=x_t.device)
    BN = max(16, next_pow2(n))
    BP = max(2, min(next_pow2(p), 4096 // BN))
    has_d = D is not None
    if has_d:
        Dc = D.contiguous()
        # (h,), (h, 1): one value per head; (h, p): per channel
        dsh, dsp = (Dc.stride(0), 0) if Dc.dim() == 1 or Dc.shape[1] == 1 else (Dc.stride(0), Dc.stride(1))
    else:
        Dc, dsh, dsp = A, 0, 0
    grid = (b * h, cdiv(p, BP))
    launch(_ssd_step_kernel, grid, state, x_t, dt_t.contiguous(), A.contiguous(), B_t.contiguous(),
           C_t.contiguous(), Dc, new, y, h, g, p, n, ps, dsh, dsp,
           BP=BP, BN=BN, NORM=bool(normalize), HAS_D=has_d, num_warps=4)
    return y, new
