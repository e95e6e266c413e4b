"""One-token SSD decode step: ``S <- exp(dt A) S + dt x B^T``, ``y = S C`` (+ D x), optional normaliser.

``ssd_step_torch`` is plain PyTorch (CPU, autograd); ``ssd_step_triton`` is one fused Triton launch that
reads the state once and writes the new state once (the memory floor of a decode step), with the
normaliser row and the D skip folded in (where an input requires grad under autograd, its backward
differentiates ``ssd_step_torch``). Both check their arguments first (``check_step_args``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .host_math import cdiv, next_pow2
from .launch import launch
from .reference import expand_groups

__all__ = ["ssd_step_torch", "ssd_step_triton", "check_step_args"]


def check_step_args(state, x_t, dt_t, A, B_t, C_t, D=None, normalize=False, fn="ssd_step") -> None:
    """The contract of :func:`kernels.ssd_step` on shapes, dtypes and devices, checked before any work: a one-line
    ``ValueError`` naming the argument and what to pass. Reads no tensor data (no host synchronisation)."""

    def bad(msg):
        raise ValueError(f"{fn}: {msg}")

    for name, t in (("state", state), ("x_t", x_t), ("dt_t", dt_t), ("A", A), ("B_t", B_t), ("C_t", C_t), ("D", D)):
        if t is None and name == "D":
            continue
        if not isinstance(t, torch.Tensor):
            bad(f"{name} must be a tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            bad(f"{name} must be a floating-point tensor, got {t.dtype}")
        if t.device != x_t.device:
            bad(f"{name} is on {t.device} but x_t is on {x_t.device}: put every tensor on one device")
    if x_t.dim() != 3:
        hint = "; one token: pass x[:, t] of the (b, l, h, p) sequence" if x_t.dim() == 4 else ""
        bad(f"x_t must be (b, h, p), got {tuple(x_t.shape)}{hint}")
    b, h, p = x_t.shape
    if tuple(dt_t.shape) != (b, h):
        hint = "; one step per head: dt_t[..., 0]" if dt_t.dim() == 3 and dt_t.shape[:2] == (b, h) else ""
        bad(f"dt_t must be (b, h) = {(b, h)}, got {tuple(dt_t.shape)}{hint}")
    if tuple(A.shape) != (h,):
        hint = f"; one decay per head: A.reshape({h})" if A.numel() == h else (
            "; one decay per head (a per-channel A is Mamba-1's: kernels.compat.selective_state_update takes it)"
            if A.dim() == 3 else "")
        bad(f"A must be (h,) = ({h},), got {tuple(A.shape)}{hint}")
    for name, t in (("B_t", B_t), ("C_t", C_t)):
        if t.dim() != 3 or t.shape[0] != b or h % t.shape[1] != 0:
            bad(f"{name} must be (b, g, n) with b = {b} and h = {h} a multiple of g, got {tuple(t.shape)}")
    if B_t.shape != C_t.shape:
        bad(f"B_t and C_t must have one shape (b, g, n), got {tuple(B_t.shape)} and {tuple(C_t.shape)}")
    n = B_t.shape[2]
    ps = p + int(bool(normalize))
    if tuple(state.shape) != (b, h, ps, n):
        extra = " (p + 1 rows with normalize=True: the last one is the normaliser's)" if normalize else ""
        bad(f"state must be (b, h, p, n) = {(b, h, ps, n)}{extra}, got {tuple(state.shape)}")
    if D is not None and tuple(D.shape) not in ((h,), (h, p), (h, 1)):
        bad(f"D must be (h,) = ({h},) or (h, p) = {(h, p)}, got {tuple(D.shape)}")


def ssd_step_torch(state, x_t, dt_t, A, B_t, C_t, D=None, normalize=False):
    check_step_args(state, x_t, dt_t, A, B_t, C_t, D, normalize)
    b, h, p = x_t.shape
    cd = torch.float64 if state.dtype == torch.float64 else torch.float32
    xx = x_t.to(cd)
    if normalize:
        xx = torch.cat([xx, torch.ones_like(xx[..., :1])], dim=-1)
    Bh = expand_groups(B_t.unsqueeze(1).to(cd), h)[:, 0]  # (b, h, n)
    Ch = expand_groups(C_t.unsqueeze(1).to(cd), h)[:, 0]
    dtc = dt_t.to(cd)
    decay = torch.exp(dtc * A.to(cd).view(1, h))
    new = decay[..., None, None] * state.to(cd) + (dtc[..., None] * xx)[..., :, None] * Bh[:, :, None, :]
    y = torch.einsum("bhpn,bhn->bhp", new, Ch)
    if normalize:
        y = y[..., :p] / y[..., p:]
    if D is not None:
        Dv = D.to(cd)
        y = y + (Dv[:, None] if Dv.dim() == 1 else Dv) * x_t.to(cd)
    return y.to(x_t.dtype), new.to(state.dtype)


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
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (state, x_t, dt_t, A, B_t, C_t, D)):
        return _StepTritonFunction.apply(state, x_t, dt_t, A, B_t, C_t, D, bool(normalize))
    return _ssd_step_triton(state, x_t, dt_t, A, B_t, C_t, D, normalize)


def _ssd_step_triton(state, x_t, dt_t, A, B_t, C_t, D, normalize):
    b, h, p = x_t.shape
    g, n = B_t.shape[1], B_t.shape[2]
    ps = state.shape[2]
    state = state.contiguous()
    new = torch.empty_like(state)
    y = torch.empty_like(x_t)
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
    launch(_ssd_step_kernel, grid, state, x_t.contiguous(), dt_t.contiguous(), A.contiguous(), B_t.contiguous(),
           C_t.contiguous(), Dc, new, y, h, g, p, n, ps, dsh, dsp,
           BP=BP, BN=BN, NORM=bool(normalize), HAS_D=has_d, num_warps=4)
    return y, new
