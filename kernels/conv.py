"""Causal depthwise conv over channels-last sequences, fused for the GPU (the mixer's short conv on q, k, v).

``y[t] = b + sum_j w[:, j] * xp[t + j]`` with ``xp = [prev, x]`` (``prev``: the W-1 inputs before ``x``),
x (b, l, C), weight (C, W), bias (C). Returns ``(y, xp[:, -(W-1):])`` (the next call's ``prev``).

The plain version (``reference.causal_depthwise_conv_reference``) is W multiply-adds over the whole
(b, l, C) tensor each way plus the concatenation and a zero-filled gradient buffer: a dozen passes over
a tensor as wide as the qkv projection. Here:

- forward: one kernel; each (rows x channels) tile reads its W shifted input rows and writes y once;
- backward: one kernel gathers ``dxp[i] = sum_j w[:, j] * dy[i - j]`` straight into dx and dprev, one kernel
  writes per-tile partial sums of ``xp * dy`` (dw) and ``dy`` (db), summed over tiles by torch
  (deterministic, no atomics). All sums in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .host_math import cdiv
from .launch import launch

__all__ = ["causal_depthwise_conv_triton"]

_BL, _BC = 32, 128  # rows x channels per tile


@triton.jit
def _xp_tile(X, PREV, bi, i, cols, L, C, W1, cmask):
    """Rows i (index into xp = [prev, x]) of batch bi, fp32; zero outside [0, W1 + L)."""
    in_prev = (i >= 0) & (i < W1)
    in_x = (i >= W1) & (i < W1 + L)
    pv = tl.load(PREV + (bi * W1 + i)[:, None] * C + cols[None, :], mask=in_prev[:, None] & cmask[None, :], other=0.0)
    xv = tl.load(X + (bi * L + i - W1)[:, None] * C + cols[None, :], mask=in_x[:, None] & cmask[None, :], other=0.0)
    return pv.to(tl.float32) + xv.to(tl.float32)


@triton.jit
def _conv_fwd(X, PREV, WT, BIAS, Y, L, C, W: tl.constexpr, BL: tl.constexpr, BC: tl.constexpr):
    bi = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BL + tl.arange(0, BL)
    cols = tl.program_id(2) * BC + tl.arange(0, BC)
    cmask = cols < C
    acc = tl.zeros((BL, BC), dtype=tl.float32) + tl.load(BIAS + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    for j in tl.static_range(W):
        wj = tl.load(WT + cols * W + j, mask=cmask, other=0.0).to(tl.float32)
        acc += _xp_tile(X, PREV, bi, t + j, cols, L, C, W - 1, cmask) * wj[None, :]
    mask = (t < L)[:, None] & cmask[None, :]
    tl.store(Y + (bi * L + t)[:, None] * C + cols[None, :], acc.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _conv_bwd_dx(DY, WT, DX, DPREV, L, C, W: tl.constexpr, BL: tl.constexpr, BC: tl.constexpr):
    """dxp[i] = sum_j w[:, j] dy[i - j] for xp rows i in [0, W-1+L): rows < W-1 go to dprev, the rest to dx."""
    bi = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BL + tl.arange(0, BL)
    cols = tl.program_id(2) * BC + tl.arange(0, BC)
    cmask = cols < C
    acc = tl.zeros((BL, BC), dtype=tl.float32)
    for j in tl.static_range(W):
        t = i - j
        ok = (t >= 0) & (t < L)
        dy = tl.load(DY + (bi * L + t)[:, None] * C + cols[None, :], mask=ok[:, None] & cmask[None, :], other=0.0)
        wj = tl.load(WT + cols * W + j, mask=cmask, other=0.0).to(tl.float32)
        acc += dy.to(tl.float32) * wj[None, :]
    W1 = W - 1
    to_prev = (i < W1)[:, None] & cmask[None, :]
    to_x = ((i >= W1) & (i < W1 + L))[:, None] & cmask[None, :]
    tl.store(DPREV + (bi * W1 + i)[:, None] * C + cols[None, :], acc.to(DPREV.dtype.element_ty), mask=to_prev)
    tl.store(DX + (bi * L + i - W1)[:, None] * C + cols[None, :], acc.to(DX.dtype.element_ty), mask=to_x)


@triton.jit
def _conv_bwd_dw(X, PREV, DY, PART, L, C, NT, W: tl.constexpr, BL: tl.constexpr, BC: tl.constexpr):
    """PART[bi * NT + tile, j, c] = sum over the tile's rows t of xp[t + j, c] dy[t, c]; PART[..., W, c] = sum dy."""
    bi = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    t = tile * BL + tl.arange(0, BL)
    cols = tl.program_id(2) * BC + tl.arange(0, BC)
    cmask = cols < C
    ok = t < L
    dy = tl.load(DY + (bi * L + t)[:, None] * C + cols[None, :], mask=ok[:, None] & cmask[None, :], other=0.0)
    dy = dy.to(tl.float32)
    base = PART + ((bi * NT + tile) * (W + 1)) * C
    for j in tl.static_range(W):
        xj = _xp_tile(X, PREV, bi, t + j, cols, L, C, W - 1, cmask)
        tl.store(base + j * C + cols, tl.sum(xj * dy, axis=0), mask=cmask)
    tl.store(base + W * C + cols, tl.sum(dy, axis=0), mask=cmask)


def _grid(b: int, rows: int, C: int):
    return (b, cdiv(rows, _BL), cdiv(C, _BC))


def _forward(x, prev, weight, bias):
    b, l, c = x.shape
    W = weight.shape[1]
    x = x.contiguous()
    prev = prev.to(x.dtype).contiguous()
    y = torch.empty_like(x)
    if b and l:
        launch(_conv_fwd, _grid(b, l, c), x, prev, weight.contiguous(), bias.contiguous(), y, l, c,
               W=W, BL=_BL, BC=_BC)
    state = (torch.cat([prev, x], dim=1)[:, l:] if l < W - 1 else x[:, l - (W - 1):]).clone()
    return y, state


def _backward(dy, x, prev, weight, bias_dtype):
    """dx, dprev, dw, db for the output gradient dy (the state's gradient is added by the caller)."""
    b, l, c = x.shape
    W = weight.shape[1]
    dy = dy.contiguous()
    dx = torch.empty_like(x)
    dprev = torch.empty_like(prev)
    nt = cdiv(l, _BL)
    part = torch.empty(b * nt, W + 1, c, dtype=torch.float32, device=x.device)
    if b and l:
        launch(_conv_bwd_dx, _grid(b, W - 1 + l, c), dy, weight.contiguous(), dx, dprev, l, c, W=W, BL=_BL, BC=_BC)
        launch(_conv_bwd_dw, _grid(b, l, c), x, prev, dy, part, l, c, nt, W=W, BL=_BL, BC=_BC)
    else:
        dx.zero_()
        dprev.zero_()
        part.zero_()
    sums = part.sum(0)  # (W + 1, C)
    # separate storage for each (a custom op's outputs must not alias each other)
    return dx, dprev, sums[:W].t().to(weight.dtype).contiguous(), sums[W].to(bias_dtype, copy=True)


def _add_state_grad(dx, dprev, dstate, W):
    """The returned state is [prev, x]'s last W-1 rows: its gradient goes to those rows."""
    dxp = torch.cat([dprev, dx], dim=1)
    dxp[:, dxp.shape[1] - (W - 1):] += dstate.to(dxp.dtype)
    return dxp[:, W - 1:].contiguous(), dxp[:, :W - 1].contiguous()


class _CausalConvTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, prev, weight, bias):
        x, prev = x.contiguous(), prev.to(x.dtype).contiguous()
        y, state = _forward(x, prev, weight, bias)
        ctx.set_materialize_grads(False)  # an unused state (training) gives None, not a zero tensor
        ctx.save_for_backward(x, prev, weight)
        ctx.meta = (bias.dtype, ctx.needs_input_grad[1])
        return y, state

    @staticmethod
    def backward(ctx, dy, dstate):
        x, prev, weight = ctx.saved_tensors
        b_dtype, need_prev = ctx.meta
        dx, dprev, dw, db = _backward(dy if dy is not None else torch.zeros_like(x), x, prev, weight, b_dtype)
        if dstate is not None:
            dx, dprev = _add_state_grad(dx, dprev, dstate, weight.shape[1])
        return dx, (dprev if need_prev else None), dw, db


# The same kernels as torch.library custom ops, for torch.compile: a compiled block keeps them as opaque ops (the
# Triton kernels beat inductor's fusion of the plain taps, BENCHMARKS.md) instead of tracing the reference.
@torch.library.custom_op("hmscale::causal_conv_fwd", mutates_args=())
def conv_fwd_op(x: torch.Tensor, prev: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(x, prev, weight, bias)


@conv_fwd_op.register_fake
def _(x, prev, weight, bias):
    return torch.empty_like(x), x.new_empty(x.shape[0], weight.shape[1] - 1, x.shape[2])


@torch.library.custom_op("hmscale::causal_conv_bwd", mutates_args=())
def conv_bwd_op(dy: torch.Tensor, x: torch.Tensor, prev: torch.Tensor, weight: torch.Tensor,
                bias_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(dy, x, prev, weight, bias_dtype)


@conv_bwd_op.register_fake
def _(dy, x, prev, weight, bias_dtype):
    return (torch.empty_like(x), prev.new_empty(prev.shape, dtype=x.dtype), torch.empty_like(weight),
            weight.new_empty(weight.shape[0], dtype=bias_dtype))


def _op_setup_context(ctx, inputs, output):
    x, prev, weight, bias = inputs
    ctx.save_for_backward(x, prev, weight)
    ctx.bias_dtype = bias.dtype


def _op_backward(ctx, dy, dstate):
    x, prev, weight = ctx.saved_tensors
    dx, dprev, dw, db = conv_bwd_op(dy if dy is not None else torch.zeros_like(x), x.contiguous(),
                                    prev.to(x.dtype).contiguous(), weight, ctx.bias_dtype)
    if dstate is not None:
        dx, dprev = _add_state_grad(dx, dprev, dstate, weight.shape[1])
    return dx, dprev.to(prev.dtype), dw, db


conv_fwd_op.register_autograd(_op_backward, setup_context=_op_setup_context)


def causal_depthwise_conv_triton(x: torch.Tensor, prev: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor):
    """x (b, l, C), prev (b, W-1, C), weight (C, W), bias (C) -> (y (b, l, C), the last W-1 inputs (b, W-1, C)).
    Triton; CUDA tensors, or CPU ones under ``TRITON_INTERPRET=1``. W >= 2."""
    W = weight.shape[1]
    if W < 2 or prev.shape[1] != W - 1 or weight.shape[0] != x.shape[-1] or bias.shape != (x.shape[-1],):
        raise ValueError(f"causal_depthwise_conv: x {tuple(x.shape)}, prev {tuple(prev.shape)}, weight "
                         f"{tuple(weight.shape)}, bias {tuple(bias.shape)} do not match (W >= 2)")
    if torch.compiler.is_compiling():
        return conv_fwd_op(x, prev, weight, bias)
    return _CausalConvTriton.apply(x, prev, weight, bias)
