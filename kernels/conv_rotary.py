"""The mixer's causal depthwise conv on the fused ``[q|k|v]`` projection, then the per-head split with NeoX partial
rotary on q and k: one Triton kernel each way (the training case: no carried conv state, no document boundaries).

Forward: ``c[t] = b + sum_j w[:, j] qkv[t - (W-1) + j]`` (rows before the sequence's start are zero), then
``q, k = rotary(c_q), rotary(c_k)``, ``v = c_v``, each (b, l, h, P) and contiguous. Every qkv row is read W times
by neighbouring rows of one program (cache hits), q, k, v written once; the conv's output never goes to memory.

Backward: ``dc = rotary^T(dq), rotary^T(dk), dv`` recomputed at the W shifted rows each output row needs,
``dqkv[u] = sum_j w[:, j] dc[u + (W-1) - j]`` written once, and the weight / bias gradients
``dw[:, j] = sum_t dc[t] qkv[t - (W-1) + j]``, ``db = sum_t dc[t]`` as per-program partial sums (each program walks
``_SUB`` row tiles of one head and one of q, k, v), summed by torch (deterministic, no atomics). All arithmetic
in fp32.

The reference is the plain composition ``causal_depthwise_conv_reference`` + ``split_qkv`` + ``apply_rotary``
(tests/kernels/test_conv_rotary.py). Exposed as torch.library custom ops, so that a ``torch.compile``d block keeps
it as one opaque op (inductor's own fusion of the plain version reads and writes the tensors several times).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .host_math import cdiv, next_pow2
from .launch import launch

__all__ = ["conv_split_rotary_triton"]

_BL = 32  # token rows per tile
_SUB = 4  # row tiles per backward program (fewer weight-gradient partials)
# 8 warps: at P=64, W=4 (the 410m mixer) the backward needs 172 registers and no spills for sm_90 (4 warps: 255 and
# 128 bytes of spills; the forward 108 vs 172), by Triton's ptxas on the CPU (benchmarks/ssd_registers.py's method)
_WARPS = 8


@triton.jit
def _conv_tile(X, tok, tpos, rmask, ch, cmask, WT, BIAS, C3, W: tl.constexpr, BL: tl.constexpr, BP: tl.constexpr):
    """The conv's output (BL rows x BP channels, fp32) at rows ``tok`` (positions ``tpos`` in their sequence)."""
    acc = tl.zeros((BL, BP), dtype=tl.float32) + tl.load(BIAS + ch, mask=cmask, other=0.0).to(tl.float32)[None, :]
    for j in tl.static_range(W):
        ok = rmask & (tpos + (j - (W - 1)) >= 0)
        xv = tl.load(X + (tok + (j - (W - 1)))[:, None] * C3 + ch[None, :], mask=ok[:, None] & cmask[None, :], other=0.0)
        wj = tl.load(WT + ch * W + j, mask=cmask, other=0.0).to(tl.float32)
        acc += xv.to(tl.float32) * wj[None, :]
    return acc


@triton.jit
def _conv_rot_fwd(QKV, WT, BIAS, COS, SIN, Q, K, V, N, L, H, P, cos_bstride, W: tl.constexpr, R: tl.constexpr,
                  HALF: tl.constexpr, BL: tl.constexpr, BP: tl.constexpr):
    tok = (tl.program_id(0) * BL + tl.arange(0, BL)).to(tl.int64)
    head = tl.program_id(1)
    rmask = tok < N
    tpos = tok % L
    cols = tl.arange(0, BP)
    cmask = cols < P
    C3 = 3 * H * P
    rot = cols < R
    partner = tl.where(cols < HALF, cols + HALF, cols - HALF)
    pmask = cmask & rot
    tab = (tok // L) * cos_bstride + tpos * R
    mr = rmask[:, None] & rot[None, :]
    c = tl.load(COS + tab[:, None] + cols[None, :], mask=mr, other=1.0).to(tl.float32)
    s = tl.load(SIN + tab[:, None] + cols[None, :], mask=mr, other=0.0).to(tl.float32)
    sign = tl.where(cols < HALF, -1.0, 1.0)
    dst = tok * (H * P) + head * P
    m = rmask[:, None] & cmask[None, :]
    for seg in tl.static_range(2):  # q, then k: conv, then rotary
        base = head * (3 * P) + seg * P
        y = _conv_tile(QKV, tok, tpos, rmask, base + cols, cmask, WT, BIAS, C3, W, BL, BP)
        yp = _conv_tile(QKV, tok, tpos, rmask, base + partner, pmask, WT, BIAS, C3, W, BL, BP)
        out = tl.where(rot[None, :], y * c + sign[None, :] * yp * s, y)
        if seg == 0:
            tl.store(Q + dst[:, None] + cols[None, :], out.to(Q.dtype.element_ty), mask=m)
        else:
            tl.store(K + dst[:, None] + cols[None, :], out.to(K.dtype.element_ty), mask=m)
    y = _conv_tile(QKV, tok, tpos, rmask, head * (3 * P) + 2 * P + cols, cmask, WT, BIAS, C3, W, BL, BP)
    tl.store(V + dst[:, None] + cols[None, :], y.to(V.dtype.element_ty), mask=m)


@triton.jit
def _dc_tile(DO, tok, tpos, rmask, L, H, P, head, COS, SIN, cos_bstride, cols, cmask, rlim, partner, sign,
             R: tl.constexpr):
    """The conv output's gradient (rows x P, fp32) at rows ``tok``: the transposed rotation of dq / dk on their first
    ``rlim`` = R dims, dv as it is (``rlim`` = 0); zero outside [0, N)."""
    src = tok * (H * P) + head * P
    m = rmask[:, None] & cmask[None, :]
    d = tl.load(DO + src[:, None] + cols[None, :], mask=m, other=0.0).to(tl.float32)
    rr = cols < rlim
    mr = rmask[:, None] & rr[None, :]
    dp = tl.load(DO + src[:, None] + partner[None, :], mask=mr, other=0.0).to(tl.float32)
    tab = (tok // L) * cos_bstride + tpos * R
    c = tl.load(COS + tab[:, None] + cols[None, :], mask=mr, other=1.0).to(tl.float32)
    s = tl.load(SIN + tab[:, None] + cols[None, :], mask=mr, other=0.0).to(tl.float32)
    return tl.where(rr[None, :], d * c - sign[None, :] * dp * s, d)


@triton.jit
def _conv_rot_bwd(DQ, DK, DV, QKV, WT, COS, SIN, DQKV, PART, N, L, H, P, cos_bstride, SUB, W: tl.constexpr,
                  WP: tl.constexpr, R: tl.constexpr, HALF: tl.constexpr, BL: tl.constexpr, BP: tl.constexpr):
    """One program: SUB row tiles of one head and one segment (q, k or v). PART[prog, j, c] (j < W) = sum over the
    program's rows t of dc[t, c] qkv[t - (W-1) + j, c]; PART[prog, W, c] = sum dc[t, c]."""
    prog = tl.program_id(0)
    head = tl.program_id(1)
    seg = tl.program_id(2)
    if seg == 0:
        DO = DQ
    elif seg == 1:
        DO = DK
    else:
        DO = DV
    rlim = tl.where(seg < 2, R, 0)  # q and k are rotated, v is not
    cols = tl.arange(0, BP)
    cmask = cols < P
    C3 = 3 * H * P
    partner = tl.where(cols < HALF, cols + HALF, cols - HALF)
    sign = tl.where(cols < HALF, -1.0, 1.0)
    jr = tl.arange(0, WP)
    ch = head * (3 * P) + seg * P + cols
    acc = tl.zeros((WP, BP), dtype=tl.float32)  # rows j < W: the taps' weight gradients; row W: the bias's
    for sub in range(SUB):
        u = ((prog * SUB + sub) * BL + tl.arange(0, BL)).to(tl.int64)
        umask = u < N
        upos = u % L
        dc = _dc_tile(DO, u, upos, umask, L, H, P, head, COS, SIN, cos_bstride, cols, cmask, rlim, partner, sign, R)
        acc += tl.where(jr[:, None] == W, tl.sum(dc, axis=0)[None, :], 0.0)
        dx = tl.zeros((BL, BP), dtype=tl.float32)
        for j in tl.static_range(W):
            ok = umask & (upos + (j - (W - 1)) >= 0)
            xv = tl.load(QKV + (u + (j - (W - 1)))[:, None] * C3 + ch[None, :],
                         mask=ok[:, None] & cmask[None, :], other=0.0).to(tl.float32)
            acc += tl.where(jr[:, None] == j, tl.sum(dc * xv, axis=0)[None, :], 0.0)
            # dqkv[u] = sum_j w[:, j] dc[u + (W-1) - j], rows of the same sequence only
            t = u + (W - 1 - j)
            tmask = umask & (upos + (W - 1 - j) < L)
            dct = _dc_tile(DO, t, t % L, tmask, L, H, P, head, COS, SIN, cos_bstride, cols, cmask, rlim, partner,
                           sign, R)
            wj = tl.load(WT + ch * W + j, mask=cmask, other=0.0).to(tl.float32)
            dx += dct * wj[None, :]
        tl.store(DQKV + u[:, None] * C3 + ch[None, :], dx.to(DQKV.dtype.element_ty),
                 mask=umask[:, None] & cmask[None, :])
    pbase = PART + prog.to(tl.int64) * ((W + 1) * C3)
    tl.store(pbase + jr[:, None] * C3 + ch[None, :], acc, mask=(jr <= W)[:, None] & cmask[None, :])


def _tables(cos, sin, b, l, r, dtype):
    cos, sin = cos.to(dtype).contiguous(), sin.to(dtype).contiguous()
    if cos.shape != (cos.shape[0], l, r) or cos.shape[0] not in (1, b) or sin.shape != cos.shape:
        raise ValueError(f"conv_split_rotary: cos/sin {tuple(cos.shape)} / {tuple(sin.shape)} must be (b or 1, {l}, r)")
    return cos, sin, (0 if cos.shape[0] == 1 else l * r)


def _forward(qkv, weight, bias, cos, sin, n_heads):
    b, l, c3 = qkv.shape
    h, W, r = n_heads, weight.shape[1], cos.shape[-1]
    p = c3 // (3 * h)
    cos, sin, bstride = _tables(cos, sin, b, l, r, qkv.dtype)
    q = torch.empty(b, l, h, p, dtype=qkv.dtype, device=qkv.device)
    k, v = torch.empty_like(q), torch.empty_like(q)
    n = b * l
    if n:
        launch(_conv_rot_fwd, (cdiv(n, _BL), h), qkv, weight, bias, cos, sin, q, k, v, n, l, h, p, bstride,
               W=W, R=r, HALF=r // 2, BL=_BL, BP=next_pow2(p), num_warps=_WARPS)
    return q, k, v


def _backward(dq, dk, dv, qkv, weight, cos, sin, n_heads, bias_dtype):
    b, l, c3 = qkv.shape
    h, W, r = n_heads, weight.shape[1], cos.shape[-1]
    p = c3 // (3 * h)
    cos, sin, bstride = _tables(cos, sin, b, l, r, qkv.dtype)
    n = b * l
    dqkv = torch.empty_like(qkv)
    progs = cdiv(n, _BL * _SUB)
    part = torch.empty(progs, W + 1, c3, dtype=torch.float32, device=qkv.device)
    if n:
        launch(_conv_rot_bwd, (progs, h, 3), dq.contiguous(), dk.contiguous(), dv.contiguous(), qkv, weight, cos,
               sin, dqkv, part, n, l, h, p, bstride, _SUB, W=W, WP=next_pow2(W + 1), R=r, HALF=r // 2, BL=_BL,
               BP=next_pow2(p), num_warps=_WARPS)
    sums = part.sum(0)  # (W + 1, 3 h P)
    # separate storage for each (a custom op's outputs must not alias each other)
    return dqkv, sums[:W].t().to(weight.dtype).contiguous(), sums[W].to(bias_dtype, copy=True)


@torch.library.custom_op("hmscale::conv_split_rotary_fwd", mutates_args=())
def conv_rotary_fwd_op(qkv: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor, n_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _forward(qkv, weight, bias, cos, sin, n_heads)


@conv_rotary_fwd_op.register_fake
def _(qkv, weight, bias, cos, sin, n_heads):
    b, l, c3 = qkv.shape
    q = qkv.new_empty(b, l, n_heads, c3 // (3 * n_heads))
    return q, torch.empty_like(q), torch.empty_like(q)


@torch.library.custom_op("hmscale::conv_split_rotary_bwd", mutates_args=())
def conv_rotary_bwd_op(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, qkv: torch.Tensor, weight: torch.Tensor,
                       cos: torch.Tensor, sin: torch.Tensor, n_heads: int, bias_dtype: torch.dtype
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(dq, dk, dv, qkv, weight, cos, sin, n_heads, bias_dtype)


@conv_rotary_bwd_op.register_fake
def _(dq, dk, dv, qkv, weight, cos, sin, n_heads, bias_dtype):
    return torch.empty_like(qkv), torch.empty_like(weight), weight.new_empty(weight.shape[0], dtype=bias_dtype)


def _setup_context(ctx, inputs, output):
    qkv, weight, bias, cos, sin, n_heads = inputs
    ctx.save_for_backward(qkv, weight, cos, sin)
    ctx.n_heads, ctx.bias_dtype = n_heads, bias.dtype


def _op_backward(ctx, dq, dk, dv):
    qkv, weight, cos, sin = ctx.saved_tensors
    zero = lambda g: g if g is not None else torch.zeros(qkv.shape[:2] + (ctx.n_heads, qkv.shape[2] // (3 * ctx.n_heads)),  # noqa: E731
                                                        dtype=qkv.dtype, device=qkv.device)
    dqkv, dw, db = conv_rotary_bwd_op(zero(dq), zero(dk), zero(dv), qkv, weight, cos, sin, ctx.n_heads, ctx.bias_dtype)
    return dqkv, dw, db, None, None, None


conv_rotary_fwd_op.register_autograd(_op_backward, setup_context=_setup_context)


def conv_split_rotary_triton(qkv: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, n_heads: int,
                             cos: torch.Tensor, sin: torch.Tensor):
    """qkv (b, l, 3 h P) with per-head [q|k|v], the conv's weight (3 h P, W) and bias (3 h P), cos/sin (b or 1, l, r)
    -> q, k (rotated on their first r dims), v, each (b, l, h, P) contiguous: the causal conv from zero history,
    then the split and NeoX rotary. W >= 1, r even, 0 < r <= P. Triton; CUDA tensors, or CPU ones under
    ``TRITON_INTERPRET=1``."""
    b, l, c3 = qkv.shape
    r = cos.shape[-1]
    if c3 % (3 * n_heads) or r == 0 or r % 2 or r > c3 // (3 * n_heads):
        raise ValueError(f"conv_split_rotary: qkv {tuple(qkv.shape)} with {n_heads} heads and {r} rotary dims "
                         "(need 3 h P columns and an even 0 < r <= P)")
    if weight.dim() != 2 or weight.shape[0] != c3 or bias.shape != (c3,):
        raise ValueError(f"conv_split_rotary: weight {tuple(weight.shape)} / bias {tuple(bias.shape)} must be "
                         f"({c3}, W) / ({c3},)")
    return conv_rotary_fwd_op(qkv.contiguous(), weight.contiguous(), bias.contiguous(), cos, sin, n_heads)
