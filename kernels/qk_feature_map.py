"""Split + NeoX partial rotary + Hedgehog feature map of q and k, one Triton kernel each way: the mixer's glue
between its conv and the SSD.

qkv (b, l, 3 h P) with GPT-NeoX's per-head ``[q|k|v]`` -> ``C = phi(rot(q))``, ``B = phi(rot(k))`` (b, l, h, 2F) and
``v`` (b, l, h, P), where ``rot`` is NeoX partial rotary on the first ``r = cos.shape[-1]`` dims and
``phi(u) = softmax([W u + b, -(W u + b)])`` with the layer's shared weight (h, F, P) and bias (h, F). The same values
as ``split_qkv_rotary_triton`` followed by ``hedgehog_feature_map`` on q and on k, without q and k going through
memory (~100 MB a layer each way at the 160m training shape):

- forward (``_qk_fm_fwd``): one program per (tile of ``BLOCK_R`` tokens, head) reads the head's q and k (and the
  rotary partners of the rotated dims) and v once; rotates q and k in fp32 and rounds them to qkv's dtype (what the
  split kernel stores); ``z = u W^T`` (``tl.dot``, fp32 accumulation), ``+ b`` and the softmax in fp32; writes C and
  B in qkv's dtype and copies v.
- backward (``_qk_fm_bwd``): one program per (group of ``rows`` tokens, head) walks its tokens in tiles, recomputes
  ``rot(q)``, ``rot(k)`` and ``phi`` (in fp32: cheaper than reading phi back, and not rounded), then from the
  gradients gC, gB: ``dz = phi_+ (g_+ - s) - phi_- (g_- - s)``, ``s = sum(phi g)``; ``du = dz W`` in fp32 and the
  transposed rotation, whose partner columns come from a second small dot with W's columns permuted; written into
  dqkv's q and k slots (gv into v's). ``dW += dz^T u`` and ``db += sum(dz)``, q's and k's terms in the same fp32
  accumulators (one map serves both), one row of per-group partial sums that one torch reduction adds
  (deterministic, no atomics). dqkv and dW are skipped when autograd does not need them.

Tile sizes: ``HMSCALE_QKFM_CFG="fwd=BLOCK_R,warps;bwd=BLOCK_R,warps,rows"`` overrides the defaults (tuning runs).
The kernels are also torch.library custom ops (``hmscale::qk_feature_maps_fwd`` / ``_bwd``) that a compiled block
keeps opaque, as the other glue kernels. The tests compare them with the two-kernel path and the plain references
(``tests/kernels/test_qk_feature_map.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .feature_map import _mm, _pad, hedgehog_feature_map
from .host_math import cdiv, is_pow2
from .launch import launch
from .rotary import _rotate, _tables, split_qkv_rotary_triton
from .settings import tile_config

__all__ = ["qk_feature_maps_triton"]

# (BLOCK_R, warps) for the forward; (BLOCK_R, warps, tokens per program) for the backward: the largest tiles that
# compile for sm_90 without spills and within the shared memory (benchmarks/ssd_registers.py --op qkfm): 16-bit
# inputs with heads and features of up to 64 (160 and 248 registers), of 128 (8 warps: 194 and 226 registers, the
# backward at 200 KiB of shared memory); fp32 inputs (exact fp32 dots) up to 64 (8 warps; 4 spilled kilobytes).
# Elsewhere (fp32 at 128, anything wider) ``qk_feature_maps_triton`` runs the two kernels this one fuses.
_DEFAULT_CFG = {"fwd": (64, 4), "bwd": (32, 4, 1024)}
_DEFAULT_CFG_WIDE = {"fwd": (64, 8), "bwd": (16, 8, 1024)}
_DEFAULT_CFG_FP32 = {"fwd": (32, 8), "bwd": (16, 8, 1024)}


def fused_fits(dtype: torch.dtype, p: int, f: int) -> bool:
    """Whether the fused kernels have a tiling for heads of ``p`` and ``f`` features with inputs of ``dtype``."""
    widest = max(_pad(p), _pad(f))
    return widest <= 64 or (widest <= 128 and dtype != torch.float32)


@triton.jit
def _phi(u, wt, bias, fmask, BLOCK_R: tl.constexpr, BF: tl.constexpr, IEEE: tl.constexpr):
    """The softmax halves of ``[z, -z]``, ``z = u W^T + b`` (wt: W^T as a (P x F) tile), fp32, 0 outside F."""
    z = _mm(u, wt, tl.zeros((BLOCK_R, BF), dtype=tl.float32), IEEE) + bias[None, :]
    m = tl.max(tl.where(fmask[None, :], tl.abs(z), float("-inf")), axis=1)  # the max of [z, -z]
    e_pos = tl.where(fmask[None, :], tl.exp(z - m[:, None]), 0.0)
    e_neg = tl.where(fmask[None, :], tl.exp(-z - m[:, None]), 0.0)
    inv = 1.0 / tl.sum(e_pos + e_neg, axis=1)
    return e_pos * inv[:, None], e_neg * inv[:, None]


@triton.jit
def _qk_fm_fwd(QKV, COS, SIN, WT, BIAS, CO, BO, VO, N, L, H, P, F, cos_bstride,
               R: tl.constexpr, HALF: tl.constexpr, BLOCK_R: tl.constexpr, BP: tl.constexpr, BF: tl.constexpr,
               IEEE: tl.constexpr):
    tok = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)  # tokens x h x 2F may pass 2^31
    hh = tl.program_id(1)
    rmask = tok < N
    pc = tl.arange(0, BP)
    fc = tl.arange(0, BF)
    pmask = pc < P
    fmask = fc < F
    dt = QKV.dtype.element_ty
    src = tok * (3 * H * P) + hh * (3 * P)
    tab = (tok // L) * cos_bstride + (tok % L) * R
    wt = tl.load(WT + hh * F * P + fc[None, :] * P + pc[:, None], mask=pmask[:, None] & fmask[None, :],
                 other=0.0).to(dt)  # W_h^T (P x F) in qkv's dtype, as the feature map kernel casts it
    bias = tl.load(BIAS + hh * F + fc, mask=fmask, other=0.0).to(tl.float32)
    base = tok * H + hh  # (token, head)
    out = base[:, None] * (2 * F) + fc[None, :]
    om = rmask[:, None] & fmask[None, :]
    q = _rotate(QKV, src, COS, SIN, tab, pc, rmask, R, HALF, 1.0, BP, P).to(dt)
    c_pos, c_neg = _phi(q, wt, bias, fmask, BLOCK_R, BF, IEEE)
    tl.store(CO + out, c_pos.to(CO.dtype.element_ty), mask=om)
    tl.store(CO + out + F, c_neg.to(CO.dtype.element_ty), mask=om)
    k = _rotate(QKV, src + P, COS, SIN, tab, pc, rmask, R, HALF, 1.0, BP, P).to(dt)
    b_pos, b_neg = _phi(k, wt, bias, fmask, BLOCK_R, BF, IEEE)
    tl.store(BO + out, b_pos.to(BO.dtype.element_ty), mask=om)
    tl.store(BO + out + F, b_neg.to(BO.dtype.element_ty), mask=om)
    vm = rmask[:, None] & pmask[None, :]
    v = tl.load(QKV + (src + 2 * P)[:, None] + pc[None, :], mask=vm, other=0.0)
    tl.store(VO + base[:, None] * P + pc[None, :], v, mask=vm)


@triton.jit
def _map_grad(QKV, src, COS, SIN, tab, G, base, wt, bias, w, wp, rmask, pc, fc, fmask, P, F,
              R: tl.constexpr, HALF: tl.constexpr, BLOCK_R: tl.constexpr, BP: tl.constexpr, BF: tl.constexpr,
              IEEE: tl.constexpr):
    """For one of q, k (at ``src``) with its map's output gradient G: (du, du at each column's rotary partner, both
    fp32, before the transposed rotation; dz in qkv's dtype; u = rot(.) in qkv's dtype; sum of dz over the tile)."""
    dt = QKV.dtype.element_ty
    u = _rotate(QKV, src, COS, SIN, tab, pc, rmask, R, HALF, 1.0, BP, P).to(dt)
    p_pos, p_neg = _phi(u, wt, bias, fmask, BLOCK_R, BF, IEEE)
    gm = rmask[:, None] & fmask[None, :]
    off = base[:, None] * (2 * F) + fc[None, :]
    g_pos = tl.load(G + off, mask=gm, other=0.0).to(tl.float32)
    g_neg = tl.load(G + off + F, mask=gm, other=0.0).to(tl.float32)
    s = tl.sum(p_pos * g_pos + p_neg * g_neg, axis=1)
    dz = tl.where(gm, p_pos * (g_pos - s[:, None]) - p_neg * (g_neg - s[:, None]), 0.0)
    dzc = dz.to(dt)  # as the feature map kernel: the matmuls' gradients from dz in u's dtype
    du = _mm(dzc, w, tl.zeros((BLOCK_R, BP), dtype=tl.float32), IEEE)
    dup = _mm(dzc, wp, tl.zeros((BLOCK_R, BP), dtype=tl.float32), IEEE)
    return du, dup, dzc, u, tl.sum(dz, axis=0)


@triton.jit
def _unrotate(du, dup, COS, SIN, tab, pc, rmask, R: tl.constexpr, HALF: tl.constexpr):
    """The transposed NeoX rotation of a gradient tile: ``du cos + sign dup sin`` on the first R dims (dup: du at
    each column's partner; the tables' two halves repeat), du elsewhere."""
    rot = pc < R
    mr = rmask[:, None] & rot[None, :]
    c = tl.load(COS + tab[:, None] + pc[None, :], mask=mr, other=1.0).to(tl.float32)
    s = tl.load(SIN + tab[:, None] + pc[None, :], mask=mr, other=0.0).to(tl.float32)
    sign = tl.where(pc < HALF, 1.0, -1.0)
    return tl.where(rot[None, :], du * c + sign[None, :] * dup * s, du)


@triton.jit
def _qk_fm_bwd(QKV, COS, SIN, WT, BIAS, GC, GB, GV, DQKV, PART, N, L, H, P, F, cos_bstride, ROWS, STRIDE,
               R: tl.constexpr, HALF: tl.constexpr, BLOCK_R: tl.constexpr, BP: tl.constexpr, BF: tl.constexpr,
               NEED_QKV: tl.constexpr, NEED_W: tl.constexpr, IEEE: tl.constexpr):
    """Program (group gi, head hh): tokens [gi ROWS, (gi + 1) ROWS) of head hh in tiles of BLOCK_R (ROWS a multiple
    of BLOCK_R). Writes dqkv for them and the group's sums of dz^T u (F x P) and of dz (F), q's and k's terms
    together, into row gi of PART (groups, STRIDE): [the h (F x P) weight partials (if NEED_W), then the h (F) bias
    partials]."""
    gi = tl.program_id(0).to(tl.int64)
    hh = tl.program_id(1)
    pc = tl.arange(0, BP)
    fc = tl.arange(0, BF)
    pmask = pc < P
    fmask = fc < F
    dt = QKV.dtype.element_ty
    wbase = WT + hh * F * P
    wt = tl.load(wbase + fc[None, :] * P + pc[:, None], mask=pmask[:, None] & fmask[None, :], other=0.0).to(dt)
    w = tl.load(wbase + fc[:, None] * P + pc[None, :], mask=fmask[:, None] & pmask[None, :], other=0.0).to(dt)
    partner = tl.where(pc < HALF, pc + HALF, pc - HALF)
    wp = tl.load(wbase + fc[:, None] * P + partner[None, :], mask=fmask[:, None] & (pc < R)[None, :],
                 other=0.0).to(dt)  # W with its rotated columns at their partners': du at the partner columns
    bias = tl.load(BIAS + hh * F + fc, mask=fmask, other=0.0).to(tl.float32)
    acc_w = tl.zeros((BF, BP), dtype=tl.float32)
    acc_b = tl.zeros((BF,), dtype=tl.float32)
    for r in range(0, ROWS, BLOCK_R):
        tok = gi * ROWS + r + tl.arange(0, BLOCK_R)
        rmask = tok < N
        src = tok * (3 * H * P) + hh * (3 * P)
        tab = (tok // L) * cos_bstride + (tok % L) * R
        base = tok * H + hh
        um = rmask[:, None] & pmask[None, :]
        du, dup, dzc, u, db = _map_grad(QKV, src, COS, SIN, tab, GC, base, wt, bias, w, wp, rmask, pc, fc, fmask,
                                        P, F, R, HALF, BLOCK_R, BP, BF, IEEE)
        acc_b += db
        if NEED_W:
            acc_w = _mm(tl.trans(dzc), u, acc_w, IEEE)
        if NEED_QKV:
            dq = _unrotate(du, dup, COS, SIN, tab, pc, rmask, R, HALF)
            tl.store(DQKV + src[:, None] + pc[None, :], dq.to(DQKV.dtype.element_ty), mask=um)
        du, dup, dzc, u, db = _map_grad(QKV, src + P, COS, SIN, tab, GB, base, wt, bias, w, wp, rmask, pc, fc,
                                        fmask, P, F, R, HALF, BLOCK_R, BP, BF, IEEE)
        acc_b += db
        if NEED_W:
            acc_w = _mm(tl.trans(dzc), u, acc_w, IEEE)
        if NEED_QKV:
            dk = _unrotate(du, dup, COS, SIN, tab, pc, rmask, R, HALF)
            tl.store(DQKV + (src + P)[:, None] + pc[None, :], dk.to(DQKV.dtype.element_ty), mask=um)
            gv = tl.load(GV + base[:, None] * P + pc[None, :], mask=um, other=0.0)
            tl.store(DQKV + (src + 2 * P)[:, None] + pc[None, :], gv.to(DQKV.dtype.element_ty), mask=um)
    part = PART + gi * STRIDE
    if NEED_W:
        tl.store(part + (hh * F + fc[:, None]) * P + pc[None, :], acc_w, mask=fmask[:, None] & pmask[None, :])
        part += H * F * P
    tl.store(part + hh * F + fc, acc_b, mask=fmask)


def _tiles(dtype: torch.dtype, p: int, f: int) -> dict:
    """Tile sizes for inputs of ``dtype``, heads of ``p``, ``f`` features;
    ``HMSCALE_QKFM_CFG="fwd=BLOCK_R,warps;bwd=BLOCK_R,warps,rows"`` overrides the defaults."""
    default = (_DEFAULT_CFG_FP32 if dtype == torch.float32 else _DEFAULT_CFG if max(_pad(p), _pad(f)) <= 64
               else _DEFAULT_CFG_WIDE)
    cfg = tile_config("HMSCALE_QKFM_CFG", default, "fwd=BLOCK_R,warps or bwd=BLOCK_R,warps,rows")
    for name, (block_r, warps, *_) in cfg.items():
        if not is_pow2(block_r) or block_r < 16 or not is_pow2(warps):
            raise ValueError(f"HMSCALE_QKFM_CFG: {name} BLOCK_R must be a power of two >= 16 and warps a power of "
                             f"two, got BLOCK_R={block_r}, warps={warps}")
    block_r, _, rows = cfg["bwd"]
    if rows <= 0 or rows % block_r:
        raise ValueError(f"HMSCALE_QKFM_CFG: bwd rows {rows} must be a positive multiple of BLOCK_R {block_r}")
    return cfg


def _dims(qkv, cos, weight):
    """b, l, h, P, F, r of one call."""
    h, F, P = weight.shape
    return qkv.shape[0], qkv.shape[1], h, P, F, cos.shape[-1]


def _forward(qkv, cos, sin, weight, bias, n_heads):
    b, l, h, P, F, r = _dims(qkv, cos, weight)
    qkv = qkv.contiguous()
    cos, sin, bstride = _tables(cos, sin, b, l, r, qkv.dtype)
    C = qkv.new_empty(b, l, h, 2 * F)
    B = torch.empty_like(C)
    v = qkv.new_empty(b, l, h, P)
    n = b * l
    if n:
        block_r, warps = _tiles(qkv.dtype, P, F)["fwd"]
        launch(_qk_fm_fwd, (cdiv(n, block_r), h), qkv, cos, sin, weight.contiguous(), bias.contiguous(), C, B, v,
               n, l, h, P, F, bstride, R=r, HALF=r // 2, BLOCK_R=block_r, BP=_pad(P), BF=_pad(F),
               IEEE=qkv.dtype == torch.float32, num_warps=warps)
    return C, B, v


def _backward(gc, gb, gv, qkv, cos, sin, weight, bias, n_heads, need_qkv: bool, need_w: bool):
    """(dqkv or an empty tensor, dW or an empty tensor, db): dqkv in qkv's dtype, dW and db in the weight's and the
    bias's."""
    b, l, h, P, F, r = _dims(qkv, cos, weight)
    qkv = qkv.contiguous()
    gc, gb, gv = (g.to(qkv.dtype).contiguous() for g in (gc, gb, gv))
    cos, sin, bstride = _tables(cos, sin, b, l, r, qkv.dtype)
    n = b * l
    block_r, warps, rows = _tiles(qkv.dtype, P, F)["bwd"]
    groups = cdiv(n, rows)
    dqkv = torch.empty_like(qkv) if need_qkv else qkv.new_empty(0)
    nw = h * F * P if need_w else 0
    part = torch.empty(groups, nw + h * F, dtype=torch.float32, device=qkv.device)  # one reduction for dW and db
    if n:
        launch(_qk_fm_bwd, (groups, h), qkv, cos, sin, weight.contiguous(), bias.contiguous(), gc, gb, gv, dqkv,
               part, n, l, h, P, F, bstride, rows, part.shape[1], R=r, HALF=r // 2, BLOCK_R=block_r, BP=_pad(P),
               BF=_pad(F), NEED_QKV=need_qkv, NEED_W=need_w, IEEE=qkv.dtype == torch.float32, num_warps=warps)
    sums = part.sum(0)
    dw = sums[:nw].view(h, F, P).to(weight.dtype) if need_w else weight.new_empty(0)
    # separate storage for db (a custom op's outputs must not alias each other)
    return dqkv, dw, sums[nw:].view(h, F).to(bias.dtype, copy=True)


def _fill_missing(gc, gb, gv, qkv, weight):
    """Autograd passes None for an unused output's gradient: zeros in its place."""
    b, l, _ = qkv.shape
    h, F, P = weight.shape
    gc = gc if gc is not None else qkv.new_zeros(b, l, h, 2 * F)
    gb = gb if gb is not None else qkv.new_zeros(b, l, h, 2 * F)
    return gc, gb, gv if gv is not None else qkv.new_zeros(b, l, h, P)


class _QKFeatureMaps(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, cos, sin, weight, bias, n_heads: int):
        qkv = qkv.contiguous()
        C, B, v = _forward(qkv, cos, sin, weight, bias, n_heads)
        ctx.save_for_backward(qkv, cos, sin, weight, bias)
        ctx.n_heads = n_heads
        return C, B, v

    @staticmethod
    def backward(ctx, gc, gb, gv):
        qkv, cos, sin, weight, bias = ctx.saved_tensors
        need_qkv, _, _, need_w, need_b, _ = ctx.needs_input_grad
        dqkv, dw, db = _backward(*_fill_missing(gc, gb, gv, qkv, weight), qkv, cos, sin, weight, bias, ctx.n_heads,
                                 need_qkv, need_w)
        return (dqkv if need_qkv else None), None, None, (dw if need_w else None), (db if need_b else None), None


# The same kernels as torch.library custom ops, kept opaque by torch.compile (see kernels.conv)
@torch.library.custom_op("hmscale::qk_feature_maps_fwd", mutates_args=())
def qk_fm_fwd_op(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                 n_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _forward(qkv, cos, sin, weight, bias, n_heads)


@qk_fm_fwd_op.register_fake
def _(qkv, cos, sin, weight, bias, n_heads):
    b, l, _ = qkv.shape
    h, F, P = weight.shape
    C = qkv.new_empty(b, l, h, 2 * F)
    return C, torch.empty_like(C), qkv.new_empty(b, l, h, P)


@torch.library.custom_op("hmscale::qk_feature_maps_bwd", mutates_args=())
def qk_fm_bwd_op(gc: torch.Tensor, gb: torch.Tensor, gv: torch.Tensor, qkv: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, n_heads: int, need_qkv: bool,
                 need_w: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(gc, gb, gv, qkv, cos, sin, weight, bias, n_heads, need_qkv, need_w)


@qk_fm_bwd_op.register_fake
def _(gc, gb, gv, qkv, cos, sin, weight, bias, n_heads, need_qkv, need_w):
    return (torch.empty_like(qkv) if need_qkv else qkv.new_empty(0),
            torch.empty_like(weight) if need_w else weight.new_empty(0), torch.empty_like(bias))


def _op_setup_context(ctx, inputs, output):
    qkv, cos, sin, weight, bias, n_heads = inputs
    ctx.save_for_backward(qkv, cos, sin, weight, bias)
    ctx.n_heads = n_heads


def _op_backward(ctx, gc, gb, gv):
    qkv, cos, sin, weight, bias = ctx.saved_tensors
    need_qkv, _, _, need_w, need_b, _ = ctx.needs_input_grad
    dqkv, dw, db = qk_fm_bwd_op(*_fill_missing(gc, gb, gv, qkv, weight), qkv, cos, sin, weight, bias, ctx.n_heads,
                                need_qkv, need_w)
    return (dqkv if need_qkv else None), None, None, (dw if need_w else None), (db if need_b else None), None


qk_fm_fwd_op.register_autograd(_op_backward, setup_context=_op_setup_context)


def qk_feature_maps_triton(qkv: torch.Tensor, n_heads: int, cos: torch.Tensor, sin: torch.Tensor,
                           weight: torch.Tensor, bias: torch.Tensor):
    """qkv (b, l, 3 h P) -> (C, B, v): ``phi(rot(q))``, ``phi(rot(k))`` (b, l, h, 2F) and v (b, l, h, P), in qkv's
    dtype; rot on the first r = cos.shape[-1] dims (r even, 0 < r <= P), phi the Hedgehog map of weight (h, F, P)
    and bias (h, F). Triton; CUDA tensors, or CPU ones under ``TRITON_INTERPRET=1``. Where the fused kernels have no
    tiling (``fused_fits``), the split kernel then the feature map's, with the same results."""
    b, l, three_d = qkv.shape
    r = cos.shape[-1]
    h, F, P = weight.shape
    if h != n_heads or three_d != 3 * h * P or bias.shape != (h, F):
        raise ValueError(f"qk_feature_maps: qkv {tuple(qkv.shape)}, {n_heads} heads, weight {tuple(weight.shape)} "
                         f"and bias {tuple(bias.shape)} do not match ((b, l, 3 h P), (h, F, P), (h, F))")
    if r == 0 or r % 2 or r > P:
        raise ValueError(f"qk_feature_maps: {r} rotary dims for heads of {P} (need an even 0 < r <= P)")
    if not fused_fits(qkv.dtype, P, F):
        q, k, v = split_qkv_rotary_triton(qkv, n_heads, cos, sin)
        return hedgehog_feature_map(q, weight, bias), hedgehog_feature_map(k, weight, bias), v
    if torch.compiler.is_compiling():
        return qk_fm_fwd_op(qkv, cos, sin, weight, bias, n_heads)
    return _QKFeatureMaps.apply(qkv, cos, sin, weight, bias, n_heads)
