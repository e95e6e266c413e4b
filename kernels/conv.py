"""Causal depthwise conv over channels-last sequences, fused for the GPU (the mixer's short conv on q, k, v).

``y[t] = b + sum_j w[:, j] * xp[t + j]`` with ``xp = [prev, x]`` (``prev``: the W-1 inputs before ``x``),
x (b, l, C), weight (C, W), bias (C). Returns ``(y, xp[:, -(W-1):])`` (the next call's ``prev``).

The plain version (``reference.causal_depthwise_conv_reference``) is W multiply-adds over the whole
(b, l, C) tensor each way plus the concatenation and a zero-filled gradient buffer: a dozen passes over
a tensor as wide as the qkv projection. Here:

- forward: one kernel; each (rows x channels) tile reads its W shifted input rows and writes y once;
- backward: one kernel; each program walks a group of rows of one channel tile, gathers
  ``dxp[i] = sum_j w[:, j] * dy[i - j]`` straight into dx (and dprev), and keeps the weight and bias gradients'
  products in fp32 tile accumulators reduced once per program: (W + 1, C) partial sums per row group, summed
  over groups by torch (deterministic, no atomics). All sums in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .host_math import cdiv, is_pow2
from .launch import launch
from .settings import tile_config

__all__ = ["causal_depthwise_conv_triton"]

# (rows, channels, warps) per forward tile; (rows, channels, warps, rows per program) for the backward
_DEFAULT_CFG = {"fwd": (32, 128, 4), "bwd": (16, 128, 4, 512)}  # swept on the H200, 2026-12-03


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
def _w(WT, cols, cmask, j, W: tl.constexpr):
    """Tap j's weights for the channel tile, fp32, as a (1, BC) row."""
    return tl.load(WT + cols * W + j, mask=cmask, other=0.0).to(tl.float32)[None, :]


@triton.jit
def _add_tap(a0, a1, a2, a3, prod, j: tl.constexpr, j0: tl.constexpr):
    """Tap j's product into the accumulator of its slot in this walk's four taps j0..j0+3 (none if outside)."""
    if j == j0:
        a0 += prod
    if j == j0 + 1:
        a1 += prod
    if j == j0 + 2:
        a2 += prod
    if j == j0 + 3:
        a3 += prod
    return a0, a1, a2, a3


@triton.jit
def _conv_bwd(X, PREV, DY, WT, DX, DPREV, PART, L, C, G, R, W: tl.constexpr, BL: tl.constexpr, BC: tl.constexpr,
              BIG: tl.constexpr):
    """One program per (batch, group of R rows, channel tile). With ``dy_j[s] = dy[s + W-1 - j]`` (tap j's view
    of x row s), each tile of x rows s needs one load of x and the W shifted loads of dy:
    ``dx[s] = sum_j w[:, j] dy_j[s]`` (written) and the weight gradient's ``x[s] dy_j[s]`` added into (BL x BC)
    fp32 accumulators (the bias gradient's is ``dy_{W-1} = dy``), reduced over rows once at the end:
    PART[bi * G + g] = (W + 1, C) partial sums. The W-1 carried rows (their dprev and their weight-gradient terms)
    are the first group's. Taps go four at a time (one walk over the rows per four taps; the first also writes
    dx), so any W works and the usual W <= 4 reads x and dy once from memory. Offsets within one sequence are
    int32 from per-sequence base pointers unless L x C needs more (BIG)."""
    pid = tl.program_id(0)
    bi = (pid // G).to(tl.int64)
    g = pid % G
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    cmask = cols < C
    base = PART + ((bi * G + g) * (W + 1)) * C
    X += bi * L * C
    DY += bi * L * C
    DX += bi * L * C
    PREV += bi * (W - 1) * C
    DPREV += bi * (W - 1) * C
    for j0 in tl.static_range(0, W, 4):
        a0 = tl.zeros((BL, BC), dtype=tl.float32)
        a1 = tl.zeros((BL, BC), dtype=tl.float32)
        a2 = tl.zeros((BL, BC), dtype=tl.float32)
        a3 = tl.zeros((BL, BC), dtype=tl.float32)
        ab = tl.zeros((BL, BC), dtype=tl.float32)
        if g == 0:  # the carried rows i < W-1: dprev[i] = sum_j w_j dy[i - j], weight terms prev[i] dy[i - j]
            i = tl.arange(0, BL)
            pm = (i < W - 1)[:, None] & cmask[None, :]
            pv = tl.load(PREV + i[:, None] * C + cols[None, :], mask=pm, other=0.0).to(tl.float32)
            dp = tl.zeros((BL, BC), dtype=tl.float32)
            for j in tl.static_range(W):
                t = i - j
                ok = (t >= 0) & (t < L) & (i < W - 1)
                dyj = tl.load(DY + t[:, None] * C + cols[None, :], mask=ok[:, None] & cmask[None, :],
                              other=0.0).to(tl.float32)
                if j0 == 0:
                    dp += dyj * _w(WT, cols, cmask, j, W)
                a0, a1, a2, a3 = _add_tap(a0, a1, a2, a3, pv * dyj, j, j0)
            if j0 == 0:
                tl.store(DPREV + i[:, None] * C + cols[None, :], dp.to(DPREV.dtype.element_ty), mask=pm)
        for r in range(0, R, BL):
            s = g * R + r + tl.arange(0, BL)
            if BIG:
                s = s.to(tl.int64)
            ok = s < L
            tile = s[:, None] * C + cols[None, :]
            xs = tl.load(X + tile, mask=ok[:, None] & cmask[None, :], other=0.0).to(tl.float32)
            dx = tl.zeros((BL, BC), dtype=tl.float32)
            for j in tl.static_range(W):
                if (j0 == 0) | ((j >= j0) & (j < j0 + 4)):
                    tt = s + (W - 1 - j)
                    dyj = tl.load(DY + tt[:, None] * C + cols[None, :],
                                  mask=(tt < L)[:, None] & cmask[None, :], other=0.0).to(tl.float32)
                    if j0 == 0:
                        dx += dyj * _w(WT, cols, cmask, j, W)
                    if (j0 == 0) & (j == W - 1):
                        ab += dyj
                    a0, a1, a2, a3 = _add_tap(a0, a1, a2, a3, xs * dyj, j, j0)
            if j0 == 0:
                tl.store(DX + tile, dx.to(DX.dtype.element_ty), mask=ok[:, None] & cmask[None, :])
        tl.store(base + j0 * C + cols, tl.sum(a0, axis=0), mask=cmask)
        if j0 + 1 < W:
            tl.store(base + (j0 + 1) * C + cols, tl.sum(a1, axis=0), mask=cmask)
        if j0 + 2 < W:
            tl.store(base + (j0 + 2) * C + cols, tl.sum(a2, axis=0), mask=cmask)
        if j0 + 3 < W:
            tl.store(base + (j0 + 3) * C + cols, tl.sum(a3, axis=0), mask=cmask)
        if j0 == 0:
            tl.store(base + W * C + cols, tl.sum(ab, axis=0), mask=cmask)


_INT32_OFFSETS = 2**31 - 2**24  # elements per sequence (less a tile of slack) that int32 offsets address


def _big(l: int, c: int) -> bool:
    """Whether offsets within one sequence of l x c elements need int64."""
    return l * c >= _INT32_OFFSETS


def _tiles() -> dict:
    """Tile sizes: ``HMSCALE_CONV_CFG="fwd=BL,BC,warps;bwd=BL,BC,warps,rows"`` overrides the defaults (tuning runs)."""
    cfg = tile_config("HMSCALE_CONV_CFG", _DEFAULT_CFG, "fwd=BL,BC,warps or bwd=BL,BC,warps,rows")
    if not all(is_pow2(v) for name in cfg for v in cfg[name][:3]):
        raise ValueError(f"HMSCALE_CONV_CFG: the tile sizes BL, BC and the warps must be powers of two, got {cfg}")
    bl, _, _, rows = cfg["bwd"]
    if rows % bl:
        raise ValueError(f"HMSCALE_CONV_CFG: bwd rows {rows} must be a multiple of BL {bl}")
    return cfg


def _forward(x, prev, weight, bias):
    b, l, c = x.shape
    W = weight.shape[1]
    x = x.contiguous()
    prev = prev.to(x.dtype).contiguous()
    y = torch.empty_like(x)
    if b and l:
        bl, bc, warps = _tiles()["fwd"]
        launch(_conv_fwd, (b, cdiv(l, bl), cdiv(c, bc)), x, prev, weight.contiguous(), bias.contiguous(), y, l, c,
               W=W, BL=bl, BC=bc, num_warps=warps)
    state = (torch.cat([prev, x], dim=1)[:, l:] if l < W - 1 else x[:, l - (W - 1):]).clone()
    return y, state


def _backward(dy, x, prev, weight, bias_dtype):
    """dx, dprev, dw, db for the output gradient dy (the state's gradient is added by the caller)."""
    b, l, c = x.shape
    W = weight.shape[1]
    dy = dy.contiguous()
    dx = torch.empty_like(x)
    dprev = torch.empty_like(prev)
    bl, bc, warps, rows = _tiles()["bwd"]
    bl = max(bl, triton.next_power_of_2(W - 1))  # the carried rows fit one tile
    rows = max(rows, bl) // bl * bl
    groups = cdiv(l, rows)
    part = torch.empty(b * groups, W + 1, c, dtype=torch.float32, device=x.device)
    if b and l:
        launch(_conv_bwd, (b * groups, cdiv(c, bc)), x, prev, dy, weight.contiguous(), dx, dprev, part, l, c, groups,
               rows, W=W, BL=bl, BC=bc, BIG=_big(l, c), num_warps=warps)
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
    ctx.set_materialize_grads(False)  # as the eager Function: an unused state gives None, not zeros to copy in


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
    W = weight.shape[1] if weight.dim() == 2 else 0
    # prev whole: the kernel reads prev as (b, W-1, C) (another batch size or width was read past its end)
    if (x.dim() != 3 or W < 2 or prev.shape != (x.shape[0], W - 1, x.shape[2]) or weight.shape[0] != x.shape[-1]
            or bias.shape != (x.shape[-1],)):
        raise ValueError(f"causal_depthwise_conv: x {tuple(x.shape)}, prev {tuple(prev.shape)}, weight "
                         f"{tuple(weight.shape)}, bias {tuple(bias.shape)} do not match (W >= 2)")
    if torch.compiler.is_compiling():
        return conv_fwd_op(x, prev, weight, bias)
    return _CausalConvTriton.apply(x, prev, weight, bias)
