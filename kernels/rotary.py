"""Split of GPT-NeoX's fused per-head ``[q|k|v]`` projection with NeoX partial rotary on q and k, in Triton.

qkv (b, l, 3 h P) -> q, k (rotated on their first r = cos.shape[-1] dims), v, each (b, l, h, P) and
contiguous (the SSD kernel reads v as its x). One kernel each way: the forward reads every qkv element
once (plus the rotary partner of the rotated dims) and writes q, k, v; the backward writes dqkv once from
dq, dk, dv (the transposed rotation). The reference is the model's own plain version,
``hmscale.models.neox_attention.split_qkv`` + ``apply_rotary`` (the tests compare the two).

cos/sin: (b or 1, l, r) in the NeoX layout (the two halves repeat), r even.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .host_math import cdiv, next_pow2
from .launch import launch

__all__ = ["split_qkv_rotary_triton"]

_BL = 16  # tokens per program


@triton.jit
def _rotate(SRC, src_base, TAB_COS, TAB_SIN, tab_base, cols, rmask, R: tl.constexpr, HALF: tl.constexpr,
            SIGN: tl.constexpr, BP: tl.constexpr, P):
    """x * cos + sign(d) * x[partner(d)] * sin on the first R dims, x elsewhere; fp32 (rows x BP)."""
    cmask = cols < P
    m = rmask[:, None] & cmask[None, :]
    x = tl.load(SRC + src_base[:, None] + cols[None, :], mask=m, other=0.0).to(tl.float32)
    rot = cols < R
    partner = tl.where(cols < HALF, cols + HALF, cols - HALF)
    mr = rmask[:, None] & rot[None, :]
    xp = tl.load(SRC + src_base[:, None] + partner[None, :], mask=mr, other=0.0).to(tl.float32)
    c = tl.load(TAB_COS + tab_base[:, None] + cols[None, :], mask=mr, other=1.0).to(tl.float32)
    s = tl.load(TAB_SIN + tab_base[:, None] + cols[None, :], mask=mr, other=0.0).to(tl.float32)
    sign = tl.where(cols < HALF, -SIGN, SIGN).to(tl.float32)
    return tl.where(rot[None, :], x * c + sign[None, :] * xp * s, x)


@triton.jit
def _split_rotary_fwd(QKV, COS, SIN, Q, K, V, N, L, H, P, cos_bstride, R: tl.constexpr, HALF: tl.constexpr,
                      BL: tl.constexpr, BP: tl.constexpr):
    tok = (tl.program_id(0) * BL + tl.arange(0, BL)).to(tl.int64)
    head = tl.program_id(1)
    rmask = tok < N
    cols = tl.arange(0, BP)
    src = tok * (3 * H * P) + head * (3 * P)
    tab = (tok // L) * cos_bstride + (tok % L) * R
    dst = tok * (H * P) + head * P
    m = rmask[:, None] & (cols < P)[None, :]
    q = _rotate(QKV, src, COS, SIN, tab, cols, rmask, R, HALF, 1.0, BP, P)
    tl.store(Q + dst[:, None] + cols[None, :], q.to(Q.dtype.element_ty), mask=m)
    k = _rotate(QKV, src + P, COS, SIN, tab, cols, rmask, R, HALF, 1.0, BP, P)
    tl.store(K + dst[:, None] + cols[None, :], k.to(K.dtype.element_ty), mask=m)
    v = tl.load(QKV + (src + 2 * P)[:, None] + cols[None, :], mask=m, other=0.0)
    tl.store(V + dst[:, None] + cols[None, :], v, mask=m)


@triton.jit
def _split_rotary_bwd(DQ, DK, DV, COS, SIN, DQKV, N, L, H, P, cos_bstride, R: tl.constexpr, HALF: tl.constexpr,
                      BL: tl.constexpr, BP: tl.constexpr):
    tok = (tl.program_id(0) * BL + tl.arange(0, BL)).to(tl.int64)
    head = tl.program_id(1)
    rmask = tok < N
    cols = tl.arange(0, BP)
    src = tok * (H * P) + head * P
    tab = (tok // L) * cos_bstride + (tok % L) * R
    dst = tok * (3 * H * P) + head * (3 * P)
    m = rmask[:, None] & (cols < P)[None, :]
    dq = _rotate(DQ, src, COS, SIN, tab, cols, rmask, R, HALF, -1.0, BP, P)  # the transposed rotation
    tl.store(DQKV + dst[:, None] + cols[None, :], dq.to(DQKV.dtype.element_ty), mask=m)
    dk = _rotate(DK, src, COS, SIN, tab, cols, rmask, R, HALF, -1.0, BP, P)
    tl.store(DQKV + (dst + P)[:, None] + cols[None, :], dk.to(DQKV.dtype.element_ty), mask=m)
    dv = tl.load(DV + src[:, None] + cols[None, :], mask=m, other=0.0)
    tl.store(DQKV + (dst + 2 * P)[:, None] + cols[None, :], dv.to(DQKV.dtype.element_ty), mask=m)


def _tables(cos, sin, b, l, r, dtype):
    cos, sin = cos.to(dtype).contiguous(), sin.to(dtype).contiguous()
    if cos.shape != (cos.shape[0], l, r) or cos.shape[0] not in (1, b) or sin.shape != cos.shape:
        raise ValueError(f"split_qkv_rotary: cos/sin {tuple(cos.shape)} / {tuple(sin.shape)} must be (b or 1, {l}, r)")
    return cos, sin, (0 if cos.shape[0] == 1 else l * r)


def _forward(qkv, cos, sin, n_heads):
    b, l, three_d = qkv.shape
    h = n_heads
    p = three_d // (3 * h)
    r = cos.shape[-1]
    qkv = qkv.contiguous()
    cos, sin, bstride = _tables(cos, sin, b, l, r, qkv.dtype)
    q = torch.empty(b, l, h, p, dtype=qkv.dtype, device=qkv.device)
    k, v = torch.empty_like(q), torch.empty_like(q)
    n = b * l
    if n:
        launch(_split_rotary_fwd, (cdiv(n, _BL), h), qkv, cos, sin, q, k, v, n, l, h, p, bstride, R=r, HALF=r // 2,
               BL=_BL, BP=next_pow2(p))
    return q, k, v


def _backward(gq, gk, gv, cos, sin, n_heads, dtype):
    b, l, h, p = gq.shape
    r = cos.shape[-1]
    cos, sin, bstride = _tables(cos, sin, b, l, r, dtype)
    dqkv = torch.empty(b, l, 3 * h * p, dtype=dtype, device=gq.device)
    n = b * l
    if n:
        launch(_split_rotary_bwd, (cdiv(n, _BL), h), gq.contiguous(), gk.contiguous(), gv.contiguous(), cos, sin,
               dqkv, n, l, h, p, bstride, R=r, HALF=r // 2, BL=_BL, BP=next_pow2(p))
    return dqkv


def _fill_missing(gq, gk, gv):
    """Autograd passes None for an unused output's gradient: zeros in its place."""
    like = next(g for g in (gq, gk, gv) if g is not None)
    return tuple(g if g is not None else torch.zeros_like(like) for g in (gq, gk, gv))


class _SplitQKVRotaryTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, cos, sin, n_heads: int):
        ctx.save_for_backward(cos, sin)
        ctx.meta = (n_heads, qkv.dtype)
        return _forward(qkv, cos, sin, n_heads)

    @staticmethod
    def backward(ctx, gq, gk, gv):
        cos, sin = ctx.saved_tensors
        n_heads, dtype = ctx.meta
        return _backward(*_fill_missing(gq, gk, gv), cos, sin, n_heads, dtype), None, None, None


# The same kernels as torch.library custom ops, kept opaque by torch.compile (see kernels.conv)
@torch.library.custom_op("hmscale::split_qkv_rotary_fwd", mutates_args=())
def split_rotary_fwd_op(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        n_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _forward(qkv, cos, sin, n_heads)


@split_rotary_fwd_op.register_fake
def _(qkv, cos, sin, n_heads):
    b, l, three_d = qkv.shape
    q = qkv.new_empty(b, l, n_heads, three_d // (3 * n_heads))
    return q, torch.empty_like(q), torch.empty_like(q)


@torch.library.custom_op("hmscale::split_qkv_rotary_bwd", mutates_args=())
def split_rotary_bwd_op(gq: torch.Tensor, gk: torch.Tensor, gv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        n_heads: int, dtype: torch.dtype) -> torch.Tensor:
    return _backward(gq, gk, gv, cos, sin, n_heads, dtype)


@split_rotary_bwd_op.register_fake
def _(gq, gk, gv, cos, sin, n_heads, dtype):
    b, l, h, p = gq.shape
    return gq.new_empty(b, l, 3 * h * p, dtype=dtype)


def _op_setup_context(ctx, inputs, output):
    qkv, cos, sin, n_heads = inputs
    ctx.save_for_backward(cos, sin)
    ctx.n_heads, ctx.dtype = n_heads, qkv.dtype


def _op_backward(ctx, gq, gk, gv):
    cos, sin = ctx.saved_tensors
    return split_rotary_bwd_op(*_fill_missing(gq, gk, gv), cos, sin, ctx.n_heads, ctx.dtype), None, None, None


split_rotary_fwd_op.register_autograd(_op_backward, setup_context=_op_setup_context)


def split_qkv_rotary_triton(qkv: torch.Tensor, n_heads: int, cos: torch.Tensor, sin: torch.Tensor):
    """qkv (b, l, 3 h P) -> q, k, v (b, l, h, P), contiguous; q, k rotated on their first r = cos.shape[-1]
    dims (r even, 0 < r <= P). Triton; CUDA tensors, or CPU ones under ``TRITON_INTERPRET=1``."""
    b, l, three_d = qkv.shape
    r = cos.shape[-1]
    if three_d % (3 * n_heads) or r == 0 or r % 2 or r > three_d // (3 * n_heads):
        raise ValueError(f"split_qkv_rotary: qkv {tuple(qkv.shape)} with {n_heads} heads and {r} rotary dims "
                         "(need 3 h P columns and an even 0 < r <= P)")
    if torch.compiler.is_compiling():
        return split_rotary_fwd_op(qkv, cos, sin, n_heads)
    return _SplitQKVRotaryTriton.apply(qkv, cos, sin, n_heads)
