"""The Hedgehog feature map ``phi(u) = softmax([W u + b, -(W u + b)])`` per head, fused for the GPU.

u (..., h, P), weight (h, F, P), bias (h, F) -> phi (..., h, 2F) in u's dtype. The plain version
(``reference.hedgehog_feature_map_reference``) is a batched matmul (with permutes around it), an fp32 cast, the
bias add, the negated copy, the concatenation, the fp32 softmax and the cast back; its backward as many again plus
two matmuls. Here it is one Triton kernel each way, the projection included, and ``z = W u`` never goes to memory:

- forward (``_fm_fwd``): one program per (tile of ``BLOCK_R`` rows, head). It reads the rows' (BLOCK_R x P) slice
  of u in place (row r, head hh at ``(r h + hh) P``: no permute) and the head's W (cast to u's dtype, as the
  reference does), computes ``z = u W^T`` with ``tl.dot`` (over P in steps where W is sliced; fp32 accumulation;
  exact fp32 products for fp32 inputs), then ``phi = softmax([z + b, -(z + b)])`` in fp32 (``max |z + b|`` as the
  stabiliser), written in u's dtype. P and F are padded (masked) to powers of two >= 16 for ``tl.dot``.
- backward (``_fm_bwd``): one program per (group of ``rows`` rows, head; and p tile where W is sliced, below),
  walking its rows in tiles of BLOCK_R.
  From the saved ``phi`` (the only activation kept besides u) and the upstream gradient g:
  ``dz = phi_+ (g_+ - s) - phi_- (g_- - s)``, ``s = sum(phi g)`` per row, in fp32; then ``du = dz W`` (dz cast to
  u's dtype, as the reference's autograd does; written in u's dtype), and in fp32 accumulators
  ``dW += dz^T u`` (F x P) and ``db += sum(dz)`` over the group's rows. Each program writes its partial sums to its
  row of one fp32 buffer, (groups, h F P + h F), that one torch reduction sums over groups (deterministic, no
  atomics).
  ``du`` and ``dW`` are skipped when autograd does not need them (stage 1: u, the teacher's q and k, has no grad).
- backward at 16-bit heads past 128 x 256 padded (Pythia-1b's 256 x 256; ``backward_form``: gemm): a whole W_h
  does not fit one program there, and splitting P over programs made each recompute dz (slower than the plain
  version on an H100). Instead ``_fm_dz`` computes dz once per row (with db's partial sums) and writes it in u's
  dtype, (rows, h, F); du = dz W and dW = dz^T u are then two batched matmuls over the heads, read and written in
  place through strided views (no permutes). ``HMSCALE_FM_BWD=fused|gemm`` overrides the choice (A/B runs, tests).

Tile sizes: ``HMSCALE_FM_CFG="fwd=BLOCK_R,warps;bwd=BLOCK_R,warps,rows;k=BK,BPT"`` overrides the defaults (tuning
runs), which depend on the dtype and the padded head and feature sizes. In 16 bits a program holds a head's whole W_h
(F x P) in one tile up to 128 x 256 padded; past that (to 256 x 256) the forward steps along P in BK columns and
``bwd`` sizes the dz kernel. fp32 takes W_h in slices of P (the forward accumulates z over steps of BK columns, the
backward splits P into tiles of BPT columns over adjacent programs), up to 256 x 256. Past those (``kernel_fits``)
the reference runs.
Row offsets are int64 (rows x h x 2F may pass 2^31).

The kernels are also torch.library custom ops (``hmscale::hedgehog_fm_fwd`` / ``hmscale::hedgehog_fm_bwd``), which
a ``torch.compile``d block holds as opaque ops (``HMSCALE_COMPILED_GLUE=triton``, ``models.fused_ops``).
``hedgehog_feature_map_reference`` is the plain PyTorch version (``models.feature_map`` uses it on CPU and, with
``HMSCALE_COMPILED_GLUE=inductor``, inside compiled graphs); the tests compare the two, forward and backward,
under ``TRITON_INTERPRET=1``.
One difference from the reference: z stays fp32 (the reference rounds the bf16/fp16 matmul's output to u's dtype
before the bias and softmax), so half-precision results differ from it by about that rounding.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .host_math import cdiv, is_pow2
from .launch import launch
from .reference import hedgehog_feature_map_reference
from .settings import tile_config


__all__ = ["hedgehog_feature_map"]

# (BLOCK_R, warps) for the forward; (BLOCK_R, warps, rows per program) for the backward. From a small H200 sweep
# (Triton 3.6, u (8, 2048, 16, 64) bf16, min of do_bench, noisy machine): forward 39 us, backward 68 us with du
# (60 us without), the reduction of the partial sums included; (32, 2, 512-1024) backward about the same. Re-swept on an
# H100 on 2026-12-07 (benchmarks/glue.py --profile, kernel time fwd+bwd at 8 x 2048): at heads of 64 these stay (124
# us; 8-warp backwards 128-138).
_DEFAULT_CFG = {"fwd": (64, 4), "bwd": (64, 4, 1024)}
# 16-bit heads where P or F pads to 128 (Pythia-1.4b): the backward at 8 warps, 255 registers without the 4-warp
# tiles' 224 spill bytes: 292 us fwd+bwd against 514-520 (same H100 runs; 32-row 8-warp backwards 340-360 us).
_DEFAULT_CFG_128 = {"fwd": (64, 4), "bwd": (64, 8, 1024)}
# 8 warps, fewer rows: 16-bit inputs where one of P and F pads to 256 (the other to at most 128; a head's whole W in
# one tile), and fp32 inputs, which take W_h in slices of P at every size: the forward steps along P (BK columns of u
# and W_h at a time, z for all F accumulated), the backward splits P into tiles of BPT columns over adjacent programs
# (each its du columns and its F x BPT part of dW). A whole fp32 W_h did not fit a block's shared memory at heads of
# 128 (the backward needed 424 KiB; 227 KiB is an H100's / H200's limit) and spilled (forwards of 64 x 256, 128 x 128:
# up to 5 KiB), so `_STEP_FP32` columns a slice (benchmarks/ssd_registers.py --op fm-all, part of `make
# compile-check`: every size compiles for sm_90 within the limit). The same slices in 16 bits at Pythia-1b's 256 x 256
# (64 columns) lost to inductor's fusion of the reference (kernel time fwd+bwd 839-2281 us over four tilings against
# 749, the compiled 1b step 167.7 against 160.1 ms; H100, 2026-12-07), so 16-bit heads past 128 x 256 take the gemm
# backward (``backward_form``) instead of the p tiles.
_DEFAULT_CFG_8WARPS = {"fwd": (32, 8), "bwd": (16, 8, 1024)}
# 16-bit heads past 128 x 256 padded (Pythia-1b: 256 x 256): the forward in 64-column steps along P over 128-row tiles
# at 16 warps (112 spill bytes, yet 161-162 us against 186-195 at 64 rows), the backward's dz kernel (``backward_form``:
# gemm) at 32 rows. H100, 2026-12-07 (`benchmarks/glue.py --op fm --shapes 1b --profile`, kernel time fwd+bwd at 8 x
# 2048): 422 us against 750 for inductor's fusion of the plain version (dz kernel 136 us, the two matmuls 112); other
# dz tiles 445-530 us fwd+bwd; the compiled 1b student step 153.4 / 154.4 ms against 158.7 / 159.8 with the plain
# version (64-row forward; two runs each). At heads of 64 and 128 the fused backward stays (gemm form 184 against 124
# us at 410m, 369 against 293 at 1.4b).
_DEFAULT_CFG_WIDE = {"fwd": (128, 16), "bwd": (32, 8, 256)}
_STEP_FP32 = 32
_STEP_WIDE = 64
_MAX_PAD = 256


def kernel_fits(dtype: torch.dtype, p: int, f: int) -> bool:
    """Whether the kernels take heads of ``p`` channels and ``f`` features with inputs of ``dtype``: both padded
    sizes within 256 (16 bits: a head's whole W_h in one tile up to 128 x 256, the dz kernel and batched matmuls for
    the backward past that; fp32: W_h in slices of P)."""
    return _pad(p) <= _MAX_PAD and _pad(f) <= _MAX_PAD


def backward_form(dtype: torch.dtype, p: int, f: int) -> str:
    """How the backward runs at these sizes: ``fused`` (``_fm_bwd``: du, dW and db in one kernel) or ``gemm``
    (``_fm_dz`` writes dz, then du = dz W and dW = dz^T u are batched matmuls); ``HMSCALE_FM_BWD=fused|gemm``
    overrides the default (``auto``: gemm for 16-bit heads past 128 x 256 padded, where a whole W_h does not fit
    one program and the p tiles would each recompute dz)."""
    form = os.environ.get("HMSCALE_FM_BWD", "auto")
    if form not in ("auto", "fused", "gemm"):
        raise ValueError(f"HMSCALE_FM_BWD={form!r}: choose auto, fused or gemm")
    if form != "auto":
        return form
    return "gemm" if dtype != torch.float32 and _pad(p) * _pad(f) > 128 * 256 else "fused"


@triton.jit
def _mm(a, b, acc, IEEE: tl.constexpr):
    """acc + a @ b, fp32 accumulation; exact fp32 products (no tf32) when IEEE."""
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _fm_fwd(U, WT, BIAS, OUT, R, H, P, F, BLOCK_R: tl.constexpr, BP: tl.constexpr, BF: tl.constexpr,
            BK: tl.constexpr, IEEE: tl.constexpr):
    """Program (row tile, head hh): z = u W_h^T over P in steps of BK (BK = BP: one step), then the softmax of the
    rows' [z + b, -(z + b)] over all F at once (BF: F padded)."""
    hh = tl.program_id(1)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # rows x h x 2F may pass 2^31
    fc = tl.arange(0, BF)
    rmask = rows < R
    fmask = fc < F
    base = rows * H + hh  # (row, head) index
    z = tl.zeros((BLOCK_R, BF), dtype=tl.float32)
    for k in range(0, BP, BK):
        pc = k + tl.arange(0, BK)
        pmask = pc < P
        u = tl.load(U + base[:, None] * P + pc[None, :], mask=rmask[:, None] & pmask[None, :], other=0.0)
        # W_h^T's (BK x F) slice, in u's dtype (the reference casts the weight too)
        wt = tl.load(WT + hh * F * P + fc[None, :] * P + pc[:, None], mask=pmask[:, None] & fmask[None, :], other=0.0)
        z = _mm(u, wt.to(U.dtype.element_ty), z, IEEE)
    z += tl.load(BIAS + hh * F + fc, mask=fmask, other=0.0).to(tl.float32)[None, :]
    m = tl.max(tl.where(fmask[None, :], tl.abs(z), float("-inf")), axis=1)  # the max of [z, -z]
    e_pos = tl.where(fmask[None, :], tl.exp(z - m[:, None]), 0.0)
    e_neg = tl.where(fmask[None, :], tl.exp(-z - m[:, None]), 0.0)
    inv = 1.0 / tl.sum(e_pos + e_neg, axis=1)
    out = OUT + base[:, None] * (2 * F) + fc[None, :]
    mask = rmask[:, None] & fmask[None, :]
    tl.store(out, (e_pos * inv[:, None]).to(OUT.dtype.element_ty), mask=mask)
    tl.store(out + F, (e_neg * inv[:, None]).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _dz_rows(PHI, G, rows, R, H, hh, F, fc, fmask):
    """The rows' dz = phi_+ (g_+ - s) - phi_- (g_- - s), s = sum(phi g) per row, in fp32 (0 outside the rows and F,
    where phi = 0), with the rows' (row, head) index and the rows-and-F mask."""
    base = rows * H + hh
    mask = (rows < R)[:, None] & fmask[None, :]
    off = base[:, None] * (2 * F) + fc[None, :]
    p_pos = tl.load(PHI + off, mask=mask, other=0.0).to(tl.float32)
    p_neg = tl.load(PHI + off + F, mask=mask, other=0.0).to(tl.float32)
    g_pos = tl.load(G + off, mask=mask, other=0.0).to(tl.float32)
    g_neg = tl.load(G + off + F, mask=mask, other=0.0).to(tl.float32)
    s = tl.sum(p_pos * g_pos + p_neg * g_neg, axis=1)
    return p_pos * (g_pos - s[:, None]) - p_neg * (g_neg - s[:, None]), base, mask


@triton.jit
def _fm_bwd(U, WT, PHI, G, DU, PART, R, H, P, F, ROWS, STRIDE, NPT, BLOCK_R: tl.constexpr, BF: tl.constexpr,
            BPT: tl.constexpr, NEED_U: tl.constexpr, NEED_W: tl.constexpr, IEEE: tl.constexpr):
    """Program (group gi and p tile pt, head hh): rows [gi ROWS, (gi + 1) ROWS) of head hh, in tiles of BLOCK_R
    (ROWS a multiple of BLOCK_R), and the head's columns [pt BPT, (pt + 1) BPT) (NPT tiles; one when BPT covers P).
    Writes du's columns for those rows and the group's sums of dz^T u (F x BPT) into row gi of PART (groups, STRIDE):
    [the h (F x P) weight partials (if NEED_W), then the h (F) bias partials, from the p tile 0 programs]. The p tiles
    of a group are adjacent programs: each recomputes dz from the same phi and g rows, read from L2 after the first."""
    gi = tl.program_id(0).to(tl.int64) // NPT
    pt = tl.program_id(0) % NPT
    hh = tl.program_id(1)
    pc = pt * BPT + tl.arange(0, BPT)
    fc = tl.arange(0, BF)
    pmask = pc < P
    fmask = fc < F
    acc_w = tl.zeros((BF, BPT), dtype=tl.float32)
    acc_b = tl.zeros((BF,), dtype=tl.float32)
    w = tl.load(WT + hh * F * P + fc[:, None] * P + pc[None, :], mask=fmask[:, None] & pmask[None, :],
                other=0.0).to(U.dtype.element_ty)  # (F x BPT), for du
    for r in range(0, ROWS, BLOCK_R):
        rows = gi * ROWS + r + tl.arange(0, BLOCK_R)
        dz, base, _ = _dz_rows(PHI, G, rows, R, H, hh, F, fc, fmask)
        acc_b += tl.sum(dz, axis=0)
        dzc = dz.to(U.dtype.element_ty)  # as the reference's autograd: the matmuls' gradients in u's dtype
        umask = (rows < R)[:, None] & pmask[None, :]
        if NEED_U:
            du = _mm(dzc, w, tl.zeros((BLOCK_R, BPT), dtype=tl.float32), IEEE)
            tl.store(DU + base[:, None] * P + pc[None, :], du.to(DU.dtype.element_ty), mask=umask)
        if NEED_W:
            u = tl.load(U + base[:, None] * P + pc[None, :], mask=umask, other=0.0)
            acc_w = _mm(tl.trans(dzc), u, acc_w, IEEE)
    part = PART + gi * STRIDE
    if NEED_W:
        tl.store(part + (hh * F + fc[:, None]) * P + pc[None, :], acc_w, mask=fmask[:, None] & pmask[None, :])
        part += H * F * P
    if pt == 0:
        tl.store(part + hh * F + fc, acc_b, mask=fmask)


@triton.jit
def _fm_dz(PHI, G, DZ, PART, R, H, F, ROWS, BLOCK_R: tl.constexpr, BF: tl.constexpr):
    """Program (group gi, head hh): dz for rows [gi ROWS, (gi + 1) ROWS) of head hh in tiles of BLOCK_R, written in
    DZ's dtype at (row, hh, f) (DZ: (R, H, F)), and the group's sum of dz (fp32) into PART[gi, hh F:(hh + 1) F]. The
    backward's first half where du and dW are batched matmuls over dz (``_backward_gemm``)."""
    gi = tl.program_id(0).to(tl.int64)
    hh = tl.program_id(1)
    fc = tl.arange(0, BF)
    fmask = fc < F
    acc_b = tl.zeros((BF,), dtype=tl.float32)
    for r in range(0, ROWS, BLOCK_R):
        rows = gi * ROWS + r + tl.arange(0, BLOCK_R)
        dz, base, mask = _dz_rows(PHI, G, rows, R, H, hh, F, fc, fmask)
        acc_b += tl.sum(dz, axis=0)
        tl.store(DZ + base[:, None] * F + fc[None, :], dz.to(DZ.dtype.element_ty), mask=mask)
    tl.store(PART + (gi * H + hh) * F + fc, acc_b, mask=fmask)


def _tiles(dtype: torch.dtype, p: int, f: int) -> dict:
    """Tile sizes for inputs of ``dtype``, heads of ``p``, ``f`` features: {"fwd": (BLOCK_R, warps), "bwd": (BLOCK_R,
    warps, rows), "k": (the forward's step along P, the backward's p tile)};
    ``HMSCALE_FM_CFG="fwd=BLOCK_R,warps;bwd=BLOCK_R,warps,rows;k=BK,BPT"`` overrides the defaults."""
    bp, bf = _pad(p), _pad(f)
    if dtype == torch.float32:
        step = min(bp, _STEP_FP32)
        default = dict(_DEFAULT_CFG_8WARPS, k=(step, step))
    elif bp * bf > 128 * 256:
        default = dict(_DEFAULT_CFG_WIDE, k=(_STEP_WIDE, _STEP_WIDE))
    else:
        wide = max(bp, bf)
        table = _DEFAULT_CFG if wide <= 64 else _DEFAULT_CFG_128 if wide == 128 else _DEFAULT_CFG_8WARPS
        default = dict(table, k=(bp, bp))
    cfg = tile_config("HMSCALE_FM_CFG", default, "fwd=BLOCK_R,warps, bwd=BLOCK_R,warps,rows or k=BK,BPT")
    if not all(is_pow2(v) and 16 <= v <= bp for v in cfg["k"]):
        raise ValueError(f"HMSCALE_FM_CFG: k=BK,BPT must be powers of two from 16 to the padded head size {bp}, "
                         f"got {','.join(map(str, cfg['k']))}")
    for name in ("fwd", "bwd"):
        block_r, warps = cfg[name][:2]
        if not is_pow2(block_r) or block_r < 16 or not is_pow2(warps):
            raise ValueError(f"HMSCALE_FM_CFG: {name} BLOCK_R must be a power of two >= 16 and warps a power of two, "
                             f"got BLOCK_R={block_r}, warps={warps}")
    block_r, _, rows = cfg["bwd"]
    if rows <= 0 or rows % block_r:
        raise ValueError(f"HMSCALE_FM_CFG: bwd rows {rows} must be a positive multiple of BLOCK_R {block_r}")
    return cfg


def _pad(n: int) -> int:
    """n padded to a power of two >= 16 (tl.dot's smallest tile)."""
    return max(16, triton.next_power_of_2(n))


def _forward(u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    h, F, P = weight.shape
    u = u.contiguous()
    R = u.numel() // (h * P)
    out = u.new_empty(*u.shape[:-1], 2 * F)
    if R:
        cfg = _tiles(u.dtype, P, F)
        block_r, warps = cfg["fwd"]
        launch(_fm_fwd, (cdiv(R, block_r), h), u, weight.contiguous(), bias.contiguous(), out, R, h, P, F,
               BLOCK_R=block_r, BP=_pad(P), BF=_pad(F), BK=cfg["k"][0], IEEE=u.dtype == torch.float32,
               num_warps=warps)
    return out


def _backward(g, u, weight, phi, bias_dtype, need_u: bool, need_w: bool):
    """(du or an empty tensor, dW or an empty tensor, db) for the output gradient g; du in u's dtype, dW, db in the
    weight's and bias_dtype."""
    h, F, P = weight.shape
    u, g = u.contiguous(), g.to(phi.dtype).contiguous()
    R = u.numel() // (h * P)
    cfg = _tiles(u.dtype, P, F)
    if backward_form(u.dtype, P, F) == "gemm":
        return _backward_gemm(g, u, weight, phi.contiguous(), bias_dtype, need_u, need_w, R, cfg)
    block_r, warps, rows = cfg["bwd"]
    bpt = cfg["k"][1]
    npt = cdiv(P, bpt)
    groups = cdiv(R, rows)
    du = torch.empty_like(u) if need_u else u.new_empty(0)
    nw = h * F * P if need_w else 0
    part = torch.empty(groups, nw + h * F, dtype=torch.float32, device=u.device)  # one reduction for dW and db
    if R:
        launch(_fm_bwd, (groups * npt, h), u, weight.contiguous(), phi.contiguous(), g, du, part, R, h, P, F, rows,
               part.shape[1], npt, BLOCK_R=block_r, BF=_pad(F), BPT=bpt, NEED_U=need_u, NEED_W=need_w,
               IEEE=u.dtype == torch.float32, num_warps=warps)
    sums = part.sum(0)
    dw = sums[:nw].view(h, F, P).to(weight.dtype) if need_w else weight.new_empty(0)
    # separate storage for db (a custom op's outputs must not alias each other)
    return du, dw, sums[nw:].view(h, F).to(bias_dtype, copy=True)


def _backward_gemm(g, u, weight, phi, bias_dtype, need_u, need_w, R, cfg):
    """The backward as dz (``_fm_dz``, in u's dtype as the reference's autograd rounds it) and two batched matmuls over
    the heads, read and written in place through strided views: du_h = dz_h W_h, dW_h = dz_h^T u_h."""
    h, F, P = weight.shape
    block_r, warps, rows = cfg["bwd"]
    groups = cdiv(R, rows)
    dz = u.new_empty(R, h, F)
    part = torch.empty(groups, h * F, dtype=torch.float32, device=u.device)
    if R:
        launch(_fm_dz, (groups, h), phi, g, dz, part, R, h, F, rows, BLOCK_R=block_r, BF=_pad(F), num_warps=warps)
    dz_h = dz.transpose(0, 1)  # (h, R, F)
    du = torch.empty_like(u) if need_u else u.new_empty(0)
    if need_u:
        torch.bmm(dz_h, weight.to(u.dtype), out=du.view(R, h, P).transpose(0, 1))
    dw = torch.bmm(dz_h.transpose(1, 2), u.view(R, h, P).transpose(0, 1)).to(weight.dtype) if need_w \
        else weight.new_empty(0)
    return du, dw, part.sum(0).view(h, F).to(bias_dtype)


class _HedgehogFeatureMap(torch.autograd.Function):
    @staticmethod
    def forward(ctx, u, weight, bias):
        u = u.contiguous()
        out = _forward(u, weight, bias)
        ctx.save_for_backward(u, weight, out)
        ctx.bias_dtype = bias.dtype
        return out

    @staticmethod
    def backward(ctx, g):
        u, weight, phi = ctx.saved_tensors
        need_u, need_w, need_b = ctx.needs_input_grad
        du, dw, db = _backward(g, u, weight, phi, ctx.bias_dtype, need_u, need_w)
        return (du if need_u else None), (dw if need_w else None), (db if need_b else None)


# The same kernels as torch.library custom ops, for torch.compile: a compiled block keeps them as opaque ops
# (HMSCALE_COMPILED_GLUE=triton) instead of tracing the reference.
@torch.library.custom_op("hmscale::hedgehog_fm_fwd", mutates_args=())
def fm_fwd_op(u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return _forward(u, weight, bias)


@fm_fwd_op.register_fake
def _(u, weight, bias):
    return u.new_empty(*u.shape[:-1], 2 * weight.shape[1])


@torch.library.custom_op("hmscale::hedgehog_fm_bwd", mutates_args=())
def fm_bwd_op(g: torch.Tensor, u: torch.Tensor, weight: torch.Tensor, phi: torch.Tensor, bias_dtype: torch.dtype,
              need_u: bool, need_w: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(g, u, weight, phi, bias_dtype, need_u, need_w)


@fm_bwd_op.register_fake
def _(g, u, weight, phi, bias_dtype, need_u, need_w):
    return (torch.empty_like(u) if need_u else u.new_empty(0), torch.empty_like(weight) if need_w else
            weight.new_empty(0), weight.new_empty(weight.shape[:2], dtype=bias_dtype))


def _op_setup_context(ctx, inputs, output):
    u, weight, bias = inputs
    ctx.save_for_backward(u, weight, output)
    ctx.bias_dtype = bias.dtype


def _op_backward(ctx, g):
    u, weight, phi = ctx.saved_tensors
    need_u, need_w, need_b = ctx.needs_input_grad
    du, dw, db = fm_bwd_op(g, u, weight, phi, ctx.bias_dtype, need_u, need_w)
    return (du if need_u else None), (dw if need_w else None), (db if need_b else None)


fm_fwd_op.register_autograd(_op_backward, setup_context=_op_setup_context)


def hedgehog_feature_map(u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The fused feature map (Triton; CUDA tensors, or CPU ones under ``TRITON_INTERPRET=1``); the same contract
    as ``hedgehog_feature_map_reference``. Inside a ``torch.compile`` trace: the custom op. Heads the kernels do not
    take (``kernel_fits``: padded sizes past 256) run the reference instead."""
    if u.shape[-2:] != (weight.shape[0], weight.shape[2]) or bias.shape != weight.shape[:2]:
        raise ValueError(f"hedgehog_feature_map: u {tuple(u.shape)}, weight {tuple(weight.shape)} and bias "
                         f"{tuple(bias.shape)} do not match ((..., h, P), (h, F, P), (h, F))")
    if not kernel_fits(u.dtype, weight.shape[2], weight.shape[1]):
        return hedgehog_feature_map_reference(u, weight, bias)
    if torch.compiler.is_compiling():
        return fm_fwd_op(u, weight, bias)
    return _HedgehogFeatureMap.apply(u, weight, bias)
