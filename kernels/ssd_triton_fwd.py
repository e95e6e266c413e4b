"""Triton forward of the chunked SSD.

Three launches, no host synchronisation:

1. ``_chunk_state_fwd``  (grid: chunk x batch*head x p/n tiles, all parallel) computes for each chunk
   the state it would leave behind starting from zero, ``local_c = sum_s w_s x_s B_s^T`` with
   ``w_s = exp(cs_end - cs_s) dt_s`` (zero across a document boundary), and the chunk's carry factor
   ``g_c = exp(cs_end)`` (zero when a document starts inside the chunk). The within-chunk cumulative
   log-decay ``cs`` is recomputed from dt in every kernel; it is never stored.
2. ``_state_pass_fwd`` (grid: batch*head x state tiles, sequential over chunks) turns the local
   states into the state entering each chunk (``S_prev_c``; in place, or into a 16-bit copy with
   ``HMSCALE_SSD_STATES``), and writes the final state. It is a pure stream over the fp32 local states with
   the next chunks' loads issued ahead.
3. ``_chunk_scan_fwd`` (grid: chunk x batch*head x p tiles) writes
   ``y = (C B^T o decay o dt) x + exp(cs) S_prev C`` for the chunk.

``_state_fused_fwd`` replaces 1 and 2 by one launch when there are enough (batch*head x state tile) programs to
(nearly) fill the GPU (``pass_mode``, ``use_fused_pass``): each program walks the chunks and builds the local states in
registers, so they never go through memory.

The normaliser (``NORM``, for ``normalize=True``) is the same scan applied to an all-ones column of x. It is
not materialised as a column of x (P + 1 columns would double the p tiles at P = 64): the states carry it as
one extra row (row P of a (P + 1) x N state), built and consumed with vector ops by the first p tile's
programs, and the scan writes it as a separate output ``den`` (b, l, h).

Layouts (all contiguous): x/y (b, l, h, p); den (b, l, h) fp32; dt heads-major (b, h, l) fp32 (a chunk's steps of
one head in adjacent words; ``ssd`` takes dt (b, l, h) and transposes it); A (h,) fp32;
B/C (b, l, g, n); doc (b, l) int32 monotone document ids; states (b, h, nc, p + NORM, n) in the dtype of
``state_layout`` (for bf16 inputs by default scaled fp16 where its groups are 32+ columns wide, else fp32; scaled
fp16 comes with int8 exponents (b, h, nc, p + NORM, n / GS), one per GS columns of a row, which the readers load as
the int32 words holding them by default, ``exponent_words``); gdecay (b*h, nc) fp32.

Precision of the dots against fp32 states (``state_precision``): for bf16 inputs the fp32 operand is split
into two bf16 parts (hi + lo, about 16 mantissa bits) and multiplied on the bf16 tensor cores against the
exact bf16 operand, accumulating in fp32 ("bf16x2": 2 bf16 dots instead of 3xTF32's 3 tf32 dots at half
the rate); fp16 inputs keep 3xTF32, fp32 inputs exact fp32.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .host_math import cdiv, next_pow2
from .launch import launch
from .settings import env, switch_cached


@triton.jit
def _hilo(v):
    """fp32 -> (hi, lo) bf16 with hi + lo = v to about 16 mantissa bits."""
    v = v.to(tl.float32)
    hi = v.to(tl.bfloat16)
    lo = (v - hi.to(tl.float32)).to(tl.bfloat16)
    return hi, lo


@triton.jit
def _xdot(a, b, acc, PREC: tl.constexpr, EXACT: tl.constexpr):
    """``acc + a @ b`` (fp32 accumulator) for the dots that need about fp32 accuracy.

    PREC "ieee" | "tf32" | "tf32x3": fp32 operands at that dot precision. PREC "bf16": one bf16 dot, the fp32
    operand rounded. PREC "bf16x2": bf16 tensor-core
    dots with each fp32 operand split by ``_hilo``; EXACT "a" / "b" names the operand that is exactly a bf16
    value (it is not split: 2 dots), "none" neither (3 dots, the lo x lo term dropped)."""
    if a.dtype == tl.bfloat16 and b.dtype == tl.bfloat16:
        # both operands are bf16 values (bf16 inputs against bf16-stored states): one dot's products are exact
        acc = tl.dot(a, b, acc)
    elif PREC == "bf16":  # one bf16 dot: the fp32 operand rounded to bf16 (about 8 bits; dB/dC only, by choice)
        acc = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)
    elif PREC == "bf16x2":
        if EXACT == "a":
            a16 = a.to(tl.bfloat16)
            bh, bl = _hilo(b)
            acc = tl.dot(a16, bl, acc)
            acc = tl.dot(a16, bh, acc)
        elif EXACT == "b":
            b16 = b.to(tl.bfloat16)
            ah, al = _hilo(a)
            acc = tl.dot(al, b16, acc)
            acc = tl.dot(ah, b16, acc)
        else:
            ah, al = _hilo(a)
            bh, bl = _hilo(b)
            acc = tl.dot(al, bh, acc)
            acc = tl.dot(ah, bl, acc)
            acc = tl.dot(ah, bh, acc)
    else:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision=PREC)
    return acc


@triton.jit
def _chunk_decay(dt_ptr, A_ptr, b, h, c, L, H, Q: tl.constexpr):
    """Offsets, mask, dt and within-chunk inclusive cumulative log-decay of chunk c (dt heads-major, (b, h, l)).
    dt is loaded one word a thread: ``L // L`` (1, unknown to the compiler's contiguity analysis) keeps the load from
    being vectorised; adjacent threads still read adjacent words, and the load can be repeated in each layout its
    users need. A vectorised load cost the backward's paired kernel registers to convert its layout (spills at 1.4b
    88 -> 128 bytes, the pair 2-3 % slower on an H100, 2026-12-07); ``tl.max_contiguous(offs_t, 1)`` compiled to
    slower code at the training shapes (the pair +5-6 % at 160m and 410m)."""
    offs_t = c * Q + tl.arange(0, Q)
    mask_t = offs_t < L
    dt = tl.load(dt_ptr + (b * H + h) * L + offs_t * (L // L), mask=mask_t, other=0.0).to(tl.float32)
    A = tl.load(A_ptr + h).to(tl.float32)
    cs = tl.cumsum(dt * A, axis=0)
    cs_end = tl.sum(tl.where(tl.arange(0, Q) == Q - 1, cs, 0.0), axis=0)
    return offs_t, mask_t, dt, cs, cs_end


@triton.jit
def _chunk_docs(doc_ptr, b, c, L, offs_t, mask_t, Q: tl.constexpr):
    """Document id of each token (padding takes the last real token's), of the chunk's last token,
    and of the token before the chunk (0 before the sequence: initial_state belongs to document 0)."""
    last = tl.minimum(c * Q + Q, L) - 1
    doc_end = tl.load((doc_ptr + b * L) + last)
    doc = tl.load((doc_ptr + b * L) + offs_t, mask=mask_t, other=0)
    doc = tl.where(mask_t, doc, doc_end)
    prev_idx = tl.minimum(tl.maximum(c * Q - 1, 0), L - 1)  # (a chunk past the end: the walks' unrolled steps)
    doc_prev = tl.load((doc_ptr + b * L) + prev_idx)
    doc_prev = tl.where(c > 0, doc_prev, 0)
    return doc, doc_end, doc_prev


@triton.jit
def _chunk_weights(doc_ptr, b, c, L, offs_t, mask_t, cs, cs_end, Q: tl.constexpr, HAS_DOC: tl.constexpr):
    """decay [t, s] = exp(cs_t - cs_s) for s <= t in the same document (else 0), win_t = exp(cs_t) (0 once a new
    document started in the chunk) and wend_s = exp(cs_end - cs_s) (0 unless s is in the chunk's last document)."""
    tt = tl.arange(0, Q)
    keep = tt[:, None] >= tt[None, :]
    win = tl.exp(cs)
    wend = tl.exp(cs_end - cs)
    if HAS_DOC:
        doc, doc_end, doc_prev = _chunk_docs(doc_ptr, b, c, L, offs_t, mask_t, Q)
        keep = keep & (doc[:, None] == doc[None, :])
        win = tl.where(doc == doc_prev, win, 0.0)
        wend = tl.where(doc == doc_end, wend, 0.0)
    decay = tl.exp(tl.where(keep, cs[:, None] - cs[None, :], float("-inf")))
    return decay, win, wend


@triton.jit
def _chunk_state_fwd(x_ptr, dt_ptr, A_ptr, B_ptr, doc_ptr, st_ptr, gdec_ptr,
                     L, H, G, P, N, NC,
                     Q: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
                     HAS_DOC: tl.constexpr, PREC: tl.constexpr, NORM: tl.constexpr):
    c = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    pn = tl.program_id(2)
    b = bh // H
    h = bh % H
    grp = h // (H // G)
    n_pb = tl.cdiv(P, BP)
    pb = pn % n_pb
    nb = pn // n_pb
    offs_t, mask_t, dt, cs, cs_end = _chunk_decay(dt_ptr, A_ptr, b, h, c, L, H, Q)
    w = tl.exp(cs_end - cs) * dt
    if HAS_DOC:
        doc, doc_end, doc_prev = _chunk_docs(doc_ptr, b, c, L, offs_t, mask_t, Q)
        w = tl.where(doc == doc_end, w, 0.0)
    offs_p = pb * BP + tl.arange(0, BP)
    offs_n = nb * BN + tl.arange(0, BN)
    mask_p = offs_p < P
    mask_n = offs_n < N
    x = _load_rows(x_ptr + (b * L * H + h) * P, offs_t, mask_t, H * P, offs_p, mask_p)
    Bt = _load_rows(B_ptr + (b * L * G + grp) * N, offs_t, mask_t, G * N, offs_n, mask_n)
    # about fp32 accuracy (PREC): the chunk states feed the decay gradient, which is sensitive to their rounding
    xw = x.to(tl.float32) * w[:, None]
    S = _xdot(tl.trans(xw), Bt, tl.zeros([BP, BN], dtype=tl.float32), PREC, "b")
    s_base = st_ptr + (bh * NC + c) * (P + NORM) * N
    tl.store(s_base + (offs_p[:, None] * N + offs_n[None, :]), S, mask=mask_p[:, None] & mask_n[None, :])
    if NORM:
        if pb == 0:  # the normaliser row: sum_s w_s B_s
            Sr = tl.sum(w[:, None] * Bt.to(tl.float32), axis=0)
            tl.store(s_base + P * N + offs_n, Sr, mask=mask_n)
    if pn == 0:
        g = tl.exp(cs_end)
        if HAS_DOC:
            g = tl.where(doc_end == doc_prev, g, 0.0)
        tl.store(gdec_ptr + bh * NC + c, g)


@triton.jit
def _pass_block(blk, PN, BLOCK: tl.constexpr, GS: tl.constexpr):
    """Offsets and mask of a split pass's block of BLOCK state elements, and (GS > 0: the block as (BLOCK // GS) x GS,
    one scale group a row) its exponents' offsets and mask."""
    if GS > 0:
        rows = tl.arange(0, BLOCK // GS)
        offs = blk * BLOCK + (rows[:, None] * GS + tl.arange(0, GS)[None, :])
        erow = (blk * BLOCK) // GS + rows
        emask = erow * GS < PN
    else:
        offs = blk * BLOCK + tl.arange(0, BLOCK)
        erow = offs  # unused
        emask = offs < PN
    return offs, offs < PN, erow, emask


@triton.jit
def _state_pass_fwd(st_ptr, out_ptr, gdec_ptr, init_ptr, final_ptr, e_ptr, NC, PN,
                    HAS_INIT: tl.constexpr, BLOCK: tl.constexpr, GS: tl.constexpr = 0):
    """The serial pass: reads the chunks' fp32 local states at ``st_ptr`` and writes the state entering each chunk
    at ``out_ptr`` (in its storage dtype; the same buffer when states are stored in fp32), and the final state.
    GS > 0 (scaled fp16 storage): the block is (BLOCK // GS) x GS, one exponent a row, at ``e_ptr``."""
    bh = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    offs, mask, erow, emask = _pass_block(blk, PN, BLOCK, GS)
    if HAS_INIT:
        S = tl.load(init_ptr + bh * PN + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        S = (offs * 0).to(tl.float32)
    base = st_ptr + bh * NC * PN + offs
    obase = out_ptr + bh * NC * PN + offs
    ebase = e_ptr + (bh * NC * PN) // tl.maximum(GS, 1)
    EPC = PN // tl.maximum(GS, 1)  # exponents per chunk
    gbase = gdec_ptr + bh * NC
    # four chunks per step, and the next step's four loads are issued before this step's stores
    # (they read other chunks), so the serial chain waits on memory about once per 8 chunks, not per 4
    l0 = tl.load(base, mask=mask, other=0.0)
    l1 = tl.load(base + tl.minimum(1, NC - 1) * PN, mask=mask, other=0.0)
    l2 = tl.load(base + tl.minimum(2, NC - 1) * PN, mask=mask, other=0.0)
    l3 = tl.load(base + tl.minimum(3, NC - 1) * PN, mask=mask, other=0.0)
    g0 = tl.load(gbase)
    g1 = tl.load(gbase + tl.minimum(1, NC - 1))
    g2 = tl.load(gbase + tl.minimum(2, NC - 1))
    g3 = tl.load(gbase + tl.minimum(3, NC - 1))
    for c0 in range(0, NC, 4):
        n0 = tl.minimum(c0 + 4, NC - 1)
        n1 = tl.minimum(c0 + 5, NC - 1)
        n2 = tl.minimum(c0 + 6, NC - 1)
        n3 = tl.minimum(c0 + 7, NC - 1)
        m0 = tl.load(base + n0 * PN, mask=mask, other=0.0)
        m1 = tl.load(base + n1 * PN, mask=mask, other=0.0)
        m2 = tl.load(base + n2 * PN, mask=mask, other=0.0)
        m3 = tl.load(base + n3 * PN, mask=mask, other=0.0)
        h0 = tl.load(gbase + n0)
        h1 = tl.load(gbase + n1)
        h2 = tl.load(gbase + n2)
        h3 = tl.load(gbase + n3)
        _pass_store(obase + c0 * PN, S, mask, ebase + c0 * EPC, erow, emask, GS)
        S = g0 * S + l0
        if c0 + 1 < NC:
            _pass_store(obase + (c0 + 1) * PN, S, mask, ebase + (c0 + 1) * EPC, erow, emask, GS)
            S = g1 * S + l1
        if c0 + 2 < NC:
            _pass_store(obase + (c0 + 2) * PN, S, mask, ebase + (c0 + 2) * EPC, erow, emask, GS)
            S = g2 * S + l2
        if c0 + 3 < NC:
            _pass_store(obase + (c0 + 3) * PN, S, mask, ebase + (c0 + 3) * EPC, erow, emask, GS)
            S = g3 * S + l3
        l0, l1, l2, l3 = m0, m1, m2, m3
        g0, g1, g2, g3 = h0, h1, h2, h3
    tl.store(final_ptr + bh * PN + offs, S, mask=mask)


@triton.jit
def _state_tile(bh, pn, H, G, P, N, BP: tl.constexpr, BN: tl.constexpr, NORM: tl.constexpr):
    """Indices of one (BP x BN) state tile of a fused state pass: b, h, the B/C group, the tile's p and n offsets
    and masks, the element offsets within one (P + NORM) x N state, and the mask of the normaliser row (kept by
    the first p tile's programs)."""
    b = bh // H
    h = bh % H
    grp = h // (H // G)
    n_pb = tl.cdiv(P, BP)
    pb = pn % n_pb
    nb = pn // n_pb
    offs_p = pb * BP + tl.arange(0, BP)
    offs_n = nb * BN + tl.arange(0, BN)
    mask_p = offs_p < P
    mask_n = offs_n < N
    soff = offs_p[:, None] * N + offs_n[None, :]
    smask = mask_p[:, None] & mask_n[None, :]
    rmask = mask_n & ((offs_n * 0 + pb) == 0)
    return b, h, grp, offs_p, offs_n, mask_p, mask_n, soff, smask, rmask


@triton.jit
def _load_rows(base, offs_t, mask_t, stride, offs_c, mask_c):
    """The (tokens x columns) tile at ``base + t * stride + c`` (zeros outside the masks), in its stored dtype."""
    return tl.load(base + (offs_t[:, None] * stride + offs_c[None, :]), mask=mask_t[:, None] & mask_c[None, :],
                   other=0.0)


@triton.jit
def _load_state(ptr, soff, smask, offs_n, rmask, P, N, NORM: tl.constexpr):
    """A fused pass's (BP x BN) state tile and (NORM) its normaliser row's BN entries, in fp32 (zeros outside the
    masks; the row is zeros without NORM)."""
    S = tl.load(ptr + soff, mask=smask, other=0.0).to(tl.float32)
    if NORM:
        Sr = tl.load(ptr + P * N + offs_n, mask=rmask, other=0.0).to(tl.float32)
    else:
        Sr = (offs_n * 0).to(tl.float32)
    return S, Sr


@triton.jit
def _store_state(ptr, S, Sr, soff, smask, offs_n, rmask, P, N, NORM: tl.constexpr):
    """Store a fused pass's state tile and (NORM) its normaliser row's entries (``_load_state``'s layout)."""
    tl.store(ptr + soff, S.to(ptr.dtype.element_ty), mask=smask)
    if NORM:
        tl.store(ptr + P * N + offs_n, Sr.to(ptr.dtype.element_ty), mask=rmask)


@triton.jit
def _pow2f(k):
    """2^k in fp32 for int32 k in [-126, 127], built from the exponent bits (exact)."""
    return ((k + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _group_exp(m):
    """The exponent k (int32, in [-126, 126]) stored for a group of state values whose largest magnitude is m (fp32,
    >= 0): the group is stored as fp16 values times 2^-k, the largest in [2^14, 2^15), so fp16's normal range covers
    ~29 binary orders below it (NaN / inf stay NaN / inf)."""
    e = (m.to(tl.int32, bitcast=True) >> 23) & 0xFF
    return tl.minimum(tl.maximum(e - 141, -126), 126)


@triton.jit
def _exp_byte(w, idx):
    """Exponent ``idx`` (int32, sign-extended) out of ``w``, the little-endian int32 word holding bytes 4 (idx // 4)
    .. 4 (idx // 4) + 3 of the int8 exponents."""
    return (w << (24 - 8 * (idx & 3)).to(tl.int32)) >> 24  # (int32 shifts: the word's high bytes fall off the left)


@triton.jit
def _exp_load(e_ptr, idx, mask):
    """Int8 exponents ``idx`` (int32): read as bytes, or, when the host passes the exponents as int32 words
    (``exponent_words``), as the words holding them (a 32-bit load Triton's pipeliner can stage asynchronously)."""
    if e_ptr.dtype.element_ty == tl.int32:
        return _exp_byte(tl.load(e_ptr + (idx >> 2), mask=mask, other=0), idx)
    return tl.load(e_ptr + idx, mask=mask, other=0).to(tl.int32)


@triton.jit
def _load_st_tile(ptr, base, soff, smask, e_ptr, offs_p, mask_p, n0, offs_n, N, GS: tl.constexpr, BN: tl.constexpr,
                  P_AXIS: tl.constexpr):
    """A reader's tile of stored chunk states (or state gradients), ``ptr + base + soff`` with ``soff`` = p N + n over
    the columns ``offs_n`` = n0 .. n0 + BN - 1 (p along axis ``P_AXIS``): as stored when ``GS`` is 0, else (scaled
    fp16, ``state_layout``) in fp32, each row times 2^k of its group. The host keeps the readers' BN <= 2 GS
    (``reader_bn``), so a tile row spans one group (one exponent per row, ``(base + p N + n0) // GS``) or two (each
    column taking its half's: two byte loads a row, or one word, which ``exponent_words`` guarantees holds both)."""
    v = tl.load(ptr + base + soff, mask=smask, other=0.0)
    if GS > 0:
        idx = (base + offs_p * N + n0) // GS
        if e_ptr.dtype.element_ty == tl.int32:
            w = tl.load(e_ptr + (idx >> 2), mask=mask_p, other=0)
            k = _pow2f(_exp_byte(w, idx))
        else:
            k = _pow2f(tl.load(e_ptr + idx, mask=mask_p, other=0).to(tl.int32))
        if BN > GS:
            if e_ptr.dtype.element_ty == tl.int32:
                k2 = _pow2f(tl.where(offs_p * 0 + n0 + GS < N, _exp_byte(w, idx + 1), 0))
            else:
                k2 = _pow2f(tl.load(e_ptr + idx + 1, mask=mask_p & (offs_p * 0 + n0 + GS < N), other=0).to(tl.int32))
            if P_AXIS == 1:
                v = v.to(tl.float32) * tl.where((offs_n - n0)[:, None] < GS, k[None, :], k2[None, :])
            else:
                v = v.to(tl.float32) * tl.where((offs_n - n0)[None, :] < GS, k[:, None], k2[:, None])
        elif P_AXIS == 1:
            v = v.to(tl.float32) * k[None, :]
        else:
            v = v.to(tl.float32) * k[:, None]
    return v


@triton.jit
def _load_st_row(ptr, base, offs_n, mask_n, e_ptr, n0, P, N, GS: tl.constexpr, BN: tl.constexpr):
    """The normaliser row's entries n0 .. n0 + BN - 1 of a stored state (row P at ``ptr + base``), in fp32 (scaled
    fp16: one exponent for them, or each entry its group's when the tile spans two, as in ``_load_st_tile``)."""
    v = tl.load(ptr + base + P * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    if GS > 0:
        if BN > GS:
            v = v * _pow2f(_exp_load(e_ptr, (base + P * N + offs_n) // GS, mask_n))
        elif e_ptr.dtype.element_ty == tl.int32:
            ie = (base + P * N + n0) // GS
            v = v * _pow2f(_exp_byte(tl.load(e_ptr + (ie >> 2)), ie))
        else:
            v = v * _pow2f(tl.load(e_ptr + (base + P * N + n0) // GS).to(tl.int32))
    return v


@triton.jit
def _store_st_tile(ptr, e_ptr, S, Sr, soff, smask, offs_p, emask, offs_n, rmask, n0, P, N, NORM: tl.constexpr,
                   GS: tl.constexpr):
    """Store a walk's state tile (and its normaliser row) at ``ptr`` in its storage dtype. ``GS`` > 0 (scaled fp16,
    GS = the tile's BN): each tile row, and the normaliser row's BN entries, is one group; its exponent goes to
    ``e_ptr + (p N + n0) // GS`` (``emask``: the rows stored). ``GS`` 0: ``_store_state``."""
    if GS > 0:
        k = _group_exp(tl.max(tl.abs(S), axis=1))
        tl.store(ptr + soff, (S * _pow2f(-k)[:, None]).to(ptr.dtype.element_ty), mask=smask)
        tl.store(e_ptr + (offs_p * N + n0) // GS, k.to(tl.int8), mask=emask)
        if NORM:
            kr = _group_exp(tl.max(tl.abs(Sr), axis=0))
            tl.store(ptr + P * N + offs_n, (Sr * _pow2f(-kr)).to(ptr.dtype.element_ty), mask=rmask)
            tl.store(e_ptr + (P * N + offs_n) // GS, (offs_n * 0 + kr).to(tl.int8), mask=rmask & (offs_n == n0))
    else:
        _store_state(ptr, S, Sr, soff, smask, offs_n, rmask, P, N, NORM)


@triton.jit
def _pass_store(ptr, S, mask, e_ptr, erow, emask, GS: tl.constexpr):
    """Store a split pass's block of states (``S`` (BLOCK,), or (BLOCK // GS, GS) with GS > 0: one group a row, its
    exponent to ``e_ptr + erow``) in the storage dtype."""
    if GS > 0:
        k = _group_exp(tl.max(tl.abs(S), axis=1))
        tl.store(ptr, (S * _pow2f(-k)[:, None]).to(ptr.dtype.element_ty), mask=mask)
        tl.store(e_ptr + erow, k.to(tl.int8), mask=emask)
    else:
        tl.store(ptr, S.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fwd_chunk_term(x_base, b_base, dt_ptr, A_ptr, doc_ptr, b, h, c, L, H, G, P, N, offs_p, mask_p, offs_n, mask_n,
                    Q: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, HAS_DOC: tl.constexpr, PREC: tl.constexpr,
                    NORM: tl.constexpr):
    """What chunk c adds to a (BP x BN) state tile and its normaliser row, and its decay g: the state leaving c is
    ``g S + T`` (``Tr`` for the row; zeros without NORM)."""
    offs_t, mask_t, dt, cs, cs_end = _chunk_decay(dt_ptr, A_ptr, b, h, c, L, H, Q)
    w = tl.exp(cs_end - cs) * dt
    g = tl.exp(cs_end)
    if HAS_DOC:
        doc, doc_end, doc_prev = _chunk_docs(doc_ptr, b, c, L, offs_t, mask_t, Q)
        w = tl.where(doc == doc_end, w, 0.0)
        g = tl.where(doc_end == doc_prev, g, 0.0)
    x = _load_rows(x_base, offs_t, mask_t, H * P, offs_p, mask_p)
    Bt = _load_rows(b_base, offs_t, mask_t, G * N, offs_n, mask_n)
    # from a zero accumulator: the dots do not wait on the running state, so consecutive chunks' dots can overlap.
    # The weights scale the smaller operand: its fp32 product is what gets split into bf16 hi + lo, and that split
    # is about half of a walk step's instructions (sm_90 SASS of the 64 x 32 tile, 2026-12-04 late)
    if BN < BP:
        T = _xdot(tl.trans(x), Bt.to(tl.float32) * w[:, None], tl.zeros([BP, BN], dtype=tl.float32), PREC, "a")
    else:
        T = _xdot(tl.trans(x.to(tl.float32) * w[:, None]), Bt, tl.zeros([BP, BN], dtype=tl.float32), PREC, "b")
    if NORM:
        Tr = tl.sum(w[:, None] * Bt.to(tl.float32), axis=0)
    else:
        Tr = tl.zeros([BN], dtype=tl.float32)
    return T, Tr, g


@triton.jit
def _state_fused_fwd(x_ptr, dt_ptr, A_ptr, B_ptr, doc_ptr, st_ptr, gdec_ptr, init_ptr, final_ptr, e_ptr,
                     L, H, G, P, N, NC,
                     Q: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
                     HAS_DOC: tl.constexpr, PREC: tl.constexpr, NORM: tl.constexpr, HAS_INIT: tl.constexpr,
                     UNROLL: tl.constexpr = 1, GS: tl.constexpr = 0):
    """``_chunk_state_fwd`` and ``_state_pass_fwd`` in one launch (``HMSCALE_SSD_PASS=fused``): one program per
    (batch*head, state tile) walks the chunks in order, builds each chunk's local state in registers and carries
    the running state, so the local states never go through memory (2 of the forward's 4 state sweeps).
    UNROLL 2 (``HMSCALE_SSD_WALK_UNROLL``): two chunks per step, both chunks' loads and dots issued before the
    carry (a walk is a chain of per-chunk latencies; a lone last chunk pairs with a pad chunk past the end)."""
    bh = tl.program_id(0).to(tl.int64)
    pn = tl.program_id(1)
    b, h, grp, offs_p, offs_n, mask_p, mask_n, soff, smask, rmask = _state_tile(bh, pn, H, G, P, N, BP, BN, NORM)
    PN = (P + NORM) * N
    if HAS_INIT:
        S, Sr = _load_state(init_ptr + bh * PN, soff, smask, offs_n, rmask, P, N, NORM)
    else:
        S = tl.zeros([BP, BN], dtype=tl.float32)
        Sr = tl.zeros([BN], dtype=tl.float32)
    x_base = x_ptr + (b * L * H + h) * P
    b_base = B_ptr + (b * L * G + grp) * N
    n0 = (pn // tl.cdiv(P, BP)) * BN  # the tile's first column
    EPC = PN // tl.maximum(GS, 1)  # exponents per chunk (GS > 0)
    for c in range(0, NC, UNROLL):
        T, Tr, g = _fwd_chunk_term(x_base, b_base, dt_ptr, A_ptr, doc_ptr, b, h, c, L, H, G, P, N,
                                   offs_p, mask_p, offs_n, mask_n, Q, BP, BN, HAS_DOC, PREC, NORM)
        if UNROLL == 2:
            c1 = c + 1  # past the end (a lone last chunk): masked loads give T1 = 0, g1 = 1, and nothing is stored
            T1, Tr1, g1 = _fwd_chunk_term(x_base, b_base, dt_ptr, A_ptr, doc_ptr, b, h, c1, L, H, G, P, N,
                                          offs_p, mask_p, offs_n, mask_n, Q, BP, BN, HAS_DOC, PREC, NORM)
        _store_st_tile(st_ptr + (bh * NC + c) * PN, e_ptr + (bh * NC + c) * EPC, S, Sr, soff, smask, offs_p, mask_p,
                       offs_n, rmask, n0, P, N, NORM, GS)  # entering c
        if pn == 0:
            tl.store(gdec_ptr + bh * NC + c, g)
        S = g * S + T
        if NORM:
            Sr = Sr * g + Tr
        if UNROLL == 2:
            in1 = (offs_n * 0 + c1) < NC  # (a vector: a scalar is not a valid mask everywhere)
            _store_st_tile(st_ptr + (bh * NC + c1) * PN, e_ptr + (bh * NC + c1) * EPC, S, Sr, soff,
                           smask & in1[None, :], offs_p, mask_p & ((offs_p * 0 + c1) < NC), offs_n, rmask & in1, n0,
                           P, N, NORM, GS)
            if pn == 0:  # (past the end: chunk c's g again, at its own place; no scalar masks, for the interpreter)
                tl.store(gdec_ptr + bh * NC + tl.minimum(c1, NC - 1), tl.where(c1 < NC, g1, g))
            S = g1 * S + T1
            if NORM:
                Sr = Sr * g1 + Tr1
    _store_state(final_ptr + bh * PN, S, Sr, soff, smask, offs_n, rmask, P, N, NORM)


@triton.jit
def _chunk_scan_fwd(x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, doc_ptr, st_ptr, y_ptr, den_ptr, ynum_ptr, D_ptr, se_ptr,
                    L, H, G, P, N, NC,
                    Q: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
                    HAS_DOC: tl.constexpr, PREC: tl.constexpr, SPREC: tl.constexpr, NORM: tl.constexpr,
                    SAVE_YNUM: tl.constexpr = False, HAS_D: tl.constexpr = False, YPREC: tl.constexpr = "ieee",
                    GS: tl.constexpr = 0):
    """y of one (chunk, p tile). SAVE_YNUM: also keep the fp32 numerator for the backward, whose decay gradient
    (sums that cancel) needs it at about fp32 accuracy: its two dots then run at YPREC (``state_precision``).
    GS > 0: the states are stored scaled (``_load_st_tile``, exponents at ``se_ptr``)."""
    c = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    pb = tl.program_id(2)
    b = bh // H
    h = bh % H
    grp = h // (H // G)
    NORM_APART: tl.constexpr = st_ptr.dtype.element_ty != tl.float32
    offs_t, mask_t, dt, cs, cs_end = _chunk_decay(dt_ptr, A_ptr, b, h, c, L, H, Q)
    offs_p = pb * BP + tl.arange(0, BP)
    mask_p = offs_p < P
    bc_base = (b * L * G + grp) * N
    s_base = (bh * NC + c) * (P + NORM) * N
    accG = tl.zeros([Q, Q], dtype=tl.float32)
    accS = tl.zeros([Q, BP], dtype=tl.float32)
    accR = tl.zeros([Q], dtype=tl.float32)  # normaliser: C_t . S0[P, :]
    for n0 in range(0, N, BN):
        offs_n = n0 + tl.arange(0, BN)
        mask_n = offs_n < N
        bc_off = offs_t[:, None] * (G * N) + offs_n[None, :]
        bc_mask = mask_t[:, None] & mask_n[None, :]
        Ct = tl.load(C_ptr + bc_base + bc_off, mask=bc_mask, other=0.0)
        Bt = tl.load(B_ptr + bc_base + bc_off, mask=bc_mask, other=0.0)
        accG += tl.dot(Ct, tl.trans(Bt), input_precision=PREC)
        Sp = _load_st_tile(st_ptr, s_base, offs_p[None, :] * N + offs_n[:, None], mask_p[None, :] & mask_n[:, None],
                           se_ptr, offs_p, mask_p, n0, offs_n, N, GS, BN, 1)  # (BN, BP) = S_prev^T
        if SAVE_YNUM:
            accS = _xdot(Ct, Sp, accS, YPREC, "a")
        else:
            accS = _xdot(Ct, Sp, accS, SPREC, "a")
        if NORM and not NORM_APART:
            Sr = _load_st_row(st_ptr, s_base, offs_n, mask_n, se_ptr, n0, P, N, GS, BN)
            accR += tl.sum(Ct.to(tl.float32) * Sr[None, :], axis=1)
    if NORM and NORM_APART:
        # 16-bit states: the normaliser row in a loop of its own (C's tiles again, from L2). Inside the loop above,
        # with bf16 states and one n step, Triton 3.6 on the H200 computed a wrong numerator (2026-12-04; the
        # interpreter was right); with fp32 states it stays there (the extra loop cost 5-7 us per training call)
        for n0 in range(0, N, BN):
            offs_n = n0 + tl.arange(0, BN)
            mask_n = offs_n < N
            Ct = tl.load(C_ptr + bc_base + offs_t[:, None] * (G * N) + offs_n[None, :],
                         mask=mask_t[:, None] & mask_n[None, :], other=0.0)
            Sr = _load_st_row(st_ptr, s_base, offs_n, mask_n, se_ptr, n0, P, N, GS, BN)
            accR += tl.sum(Ct.to(tl.float32) * Sr[None, :], axis=1)
    decay, win, _ = _chunk_weights(doc_ptr, b, c, L, offs_t, mask_t, cs, cs_end, Q, HAS_DOC)
    M = accG * decay * dt[None, :]
    x = _load_rows(x_ptr + (b * L * H + h) * P, offs_t, mask_t, H * P, offs_p, mask_p)
    if SAVE_YNUM:
        y = _xdot(M, x, accS * win[:, None], YPREC, "b")
    else:
        y = tl.dot(M.to(x.dtype), x, input_precision=PREC)
        y += accS * win[:, None]
    yo = (b * L * H + h) * P + (offs_t[:, None] * (H * P) + offs_p[None, :])
    ym = mask_t[:, None] & mask_p[None, :]
    if SAVE_YNUM:  # the fp32 numerator (before 1 / den and D x), kept for the backward
        tl.store(ynum_ptr + yo, y, mask=ym)
    if NORM:  # the epilogue: y / den (+ D x below)
        den = tl.sum(M, axis=1) + win * accR
        if pb == 0:
            tl.store(den_ptr + (b * L * H + h) + offs_t * H, den, mask=mask_t)
        y = y / tl.where(mask_t, den, 1.0)[:, None]
    if HAS_D:  # D (h, p) fp32
        Dv = tl.load(D_ptr + h * P + offs_p, mask=mask_p, other=0.0)
        y += Dv[None, :] * x.to(tl.float32)
    tl.store(y_ptr + yo, y.to(y_ptr.dtype.element_ty), mask=ym)


def _pow2(v: int, lo: int = 16) -> int:
    return max(lo, next_pow2(int(v)))


def split_mode() -> str:
    """``HMSCALE_SSD_SPLIT``: which dots of bf16 inputs against fp32 operands use the bf16 hi/lo split.
    ``state`` (default): the dots that need about fp32 accuracy (state building, state gradients, the decay-gradient
    sums; 3xTF32 before); ``all``: also the scan's state term (slower there: it stays tf32 by default);
    ``off``: 3xTF32 / tf32 as before. (dB/dC's state dots have their own choice: ``dbc_state_precision``.)"""
    v = env("HMSCALE_SSD_SPLIT", "state").lower()
    if v not in ("state", "all", "off"):
        raise ValueError(f"HMSCALE_SSD_SPLIT must be state, all or off, got {v!r}")
    return v


def precisions(dtype: torch.dtype):
    """Dot precision for the input-dtype dots and for the scan's fp32 state dot (where tf32 suffices).

    fp32 inputs: exact fp32 ("ieee") everywhere. 16-bit inputs: tensor-core dots in that dtype,
    and tf32 for the dot against the fp32 states (better than rounding the states to 16 bits);
    bf16 with ``HMSCALE_SSD_SPLIT=all``: the bf16 split there too.
    """
    if dtype == torch.float32:
        return "ieee", "ieee"
    if dtype == torch.bfloat16 and split_mode() == "all":
        return "ieee", "bf16x2"
    return "ieee", "tf32"


def dbc_state_precision(dtype: torch.dtype) -> str:
    """Dot precision of the dB/dC kernel's dots against fp32 states (x^T dS, dy^T S0). bf16 inputs: ``bf16`` by
    default (the states rounded to bf16, one dot: dB and dC are bf16 outputs and, in the v2 backward, feed nothing
    that cancels; the carry gradient <dS, S0> this kernel also sums stays elementwise fp32). H200, 2026-12-02:
    dB/dC 638 -> 574 us at the 1.4b shape (L=2048) against the hi/lo split, full GPU check 225/225 with the same
    worst errors. ``HMSCALE_SSD_DBC_PREC=bf16|bf16x2|tf32`` overrides it for bf16 inputs. fp16 inputs: tf32;
    fp32: exact."""
    if dtype == torch.float32:
        return "ieee"
    v = env("HMSCALE_SSD_DBC_PREC", "bf16").lower()
    if v not in ("bf16x2", "bf16", "tf32"):
        raise ValueError(f"HMSCALE_SSD_DBC_PREC must be bf16, bf16x2 or tf32, got {v!r}")
    if dtype == torch.bfloat16:
        return v
    return "tf32"


def state_precision(dtype: torch.dtype) -> str:
    """Dot precision for fp32 operands that build or consume chunk states where accuracy matters
    (local states, their gradients, and the decay-gradient terms): about fp32 accuracy. fp32 inputs: exact;
    bf16: the bf16 hi/lo split (unless ``HMSCALE_SSD_SPLIT=off``); fp16: 3xTF32."""
    if dtype == torch.float32:
        return "ieee"
    if dtype == torch.bfloat16 and split_mode() != "off":
        return "bf16x2"
    return "tf32x3"


_STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def state_storage() -> tuple:
    """``HMSCALE_SSD_STATES=auto|S[,dS]``: the storage dtypes, for bf16 inputs, of the chunk-boundary states S that
    one kernel writes and later kernels read, and of the backward's state gradients dS, and whether the choice is
    ``auto``. Each of ``fp32``, ``bf16``, ``fp16``; dS defaults to S's dtype, fp32 for fp16 S. ``fp16`` is stored
    scaled: fp16 values with one power of two (an int8 exponent) per group of 16-64 columns of a state row, chosen by
    the writer from the group's largest magnitude (``_group_exp``), so neither the states' range (an undecayed state
    grows with the length) nor the gradients' (a mean loss's sit near fp16's smallest normal) is lost: range-safe,
    11 bits of each group's largest values. ``auto`` (default): fp16 for both where the groups are at least 32
    columns wide (``state_layout``), else fp32. (Until the readers took n tiles of two groups, 2026-12-06, 32-column
    groups narrowed dB/dC's tiles and cost more than the halved bytes gave, so ``auto`` wanted 64; since, at 1.4b
    L=16384 x 1, whose halved walk tiles make 32-column groups, fp16 takes the call 2.04 / 2.01 -> 1.95 / 1.94 ms on an
    H100.) Only the stored copies are rounded: the running state is carried in fp32 registers along the walk (the
    split passes' per-chunk local states stay fp32 too) and every consumer accumulates in fp32. bf16 storage
    (unscaled: bf16 has fp32's range) misses dA's 1e-2 on the grid (kernels/NOTES.md, 2026-12-04). fp16 and fp32
    inputs always keep fp32."""
    v = env("HMSCALE_SSD_STATES", "auto").lower()
    if v == "auto":
        return torch.float16, torch.float16, True
    parts = [t.strip() for t in v.split(",")]
    s_name = parts[0]
    ds_name = parts[1] if len(parts) > 1 else ("bf16" if s_name == "bf16" else "fp32")
    if len(parts) > 2 or s_name not in _STATE_DTYPES or ds_name not in _STATE_DTYPES:
        raise ValueError(f"HMSCALE_SSD_STATES must be auto, S or S,dS with each one of fp32, bf16, fp16 (e.g. "
                         f"fp16,fp32), got {v!r}")
    return _STATE_DTYPES[s_name], _STATE_DTYPES[ds_name], False


def state_dtype(dtype: torch.dtype, grad: bool = False) -> torch.dtype:
    """Storage dtype of the per-chunk states (``grad``: of the state gradients) between kernels, for inputs of
    ``dtype``: ``state_storage`` for bf16 inputs, else fp32.

    (The first bf16 storage, 2026-11-29, rounded the chunks' local states before the serial pass summed them and
    made dA miss the 1e-2 bf16 tolerance, up to 4e-2. Local states stay fp32 now: the fused passes never store
    one, the split passes write them to an fp32 buffer that the serial pass reads.)
    """
    if dtype != torch.bfloat16:
        return torch.float32
    return state_storage()[1 if grad else 0]


# Default launch configurations (BP, BN, warps[, stages]; pass: BLOCK, warps) for 16-bit inputs, chosen from
# per-kernel profiles of tiling sweeps on the H200 (kernels/NOTES.md); fp32 inputs keep the earlier ones.
DEFAULT_CFG = {
    "state": (64, 128, 4), "dstate": (64, 128, 4), "scan": (128, 64, 4, 2), "dx": (64, 64, 4, 0),
    "pass": (1024, 8), "pass_b": (1024, 8), "fpass": (64, 64, 4, 3), "fpass_b": (64, 64, 4, 3),
    "fbwd": (32, 4, 2), "pair": (64, 64, 4, 3),
}
# chunk 128 (16-bit inputs): the Q x Q kernels need 8 warps and smaller tiles to stay free of register spills
# (compiled for sm_90 and counted by benchmarks/ssd_registers.py; zero spill bytes except the scan's 8)
DEFAULT_CFG_Q128 = {"scan": (64, 64, 8, 0), "dx": (16, 64, 8, 0), "fpass": (64, 64, 8, 3), "fpass_b": (64, 64, 8, 3)}
# heads whose tile has 128 or more channels (P > 64; 16-bit inputs, chunk 64): the scan's n steps of 32 (1.4b
# shape, H200 sweep of 2026-12-03: 338 -> 299 us at L=2048, 357 -> 317 at L=16384; every other kernel's default
# was already the best there)
# the fused state passes: one 128-channel tile of 8 warps, whose narrower B / C side takes the chunk weights
# (2026-12-04 late: fstate + fdstate 675 -> 587 us at 1.4b L=2048, 607 -> 567 at L=8192)
# the paired dx + dB/dC launch: dx in 64 x 32 tiles (three blocks a multiprocessor under the 168-register cap;
# 2026-12-04, 1.4b dx + dB/dC 838 -> 733 us)
# the scan's tile since fp16 state storage (H100, 2026-12-06 twentieth session, sweeps/wide_scan_walks.txt): 128 x 64,
# 330 / 304 / 294 us at 1.4b L=16384 / 8192 / 2048 against 358 / 356 / 335 for the 128 x 32 of fp32 storage
DEFAULT_CFG_WIDE = {"scan": (128, 64, 4, 0), "fpass": (128, 64, 8, 3), "fpass_b": (128, 64, 8, 3),
                    "pair": (64, 32, 4, 3)}
DEFAULT_CFG_FP32 = {
    "state": (64, 64, 4), "dstate": (64, 64, 4), "scan": (64, 64, 8, 0), "dx": (64, 32, 8, 0),
    "pass": (1024, 4), "pass_b": (1024, 4), "fpass": (32, 64, 4, 2), "fpass_b": (32, 64, 4, 2),
    "pair": (64, 32, 4, 3),
}


# Register caps (Triton's ``maxnreg``) for 16-bit inputs at chunk 64, by kcfg's kernel names. Every SSD kernel holds
# 196-255 registers a thread, 2 blocks of 4 warps per multiprocessor (Nsight Compute, kernels/NOTES.md 2026-12-04);
# a cap of 168 lets 3 blocks share one for a few spilled bytes. H200 sweeps of 2026-12-04
# (benchmarks/results/sweep_maxnreg*_2026-12-04.md), per-kernel us: dbc (its one-head form) 574 -> 482 at 1.4b
# L=2048, 596 -> 495 at L=16384, 259 -> 237 / 193 -> 178 at the 410m / 160m training calls; the scan (with 2 pipeline
# stages, so that 3 blocks' shared memory fits) 131 -> 115 at 410m L=2048, 142 -> 132 / 110 -> 99 at the training
# calls; fdstate 344 -> 314 at 1.4b L=2048. 128 registers was slower everywhere.
DEFAULT_MAXNREG = {"dbc": 168, "scan": 168}
# heads of 128+ channels: the wide scan tile stays uncapped (2 stages + 168: 300 -> 381 us at 1.4b); the paired
# dx + dB/dC launch is capped there (its 64 x 32 dx tiles: 849 uncapped -> 733 us at 1.4b), not below (P = 64 with
# 64 x 64 dx tiles: 410m training call 464-534 capped, 408-410 uncapped)
DEFAULT_MAXNREG_WIDE = {"scan": 0, "pair": 168}
# (fdstate was capped at 168 when its programs queued, 344 -> 314 us at 1.4b L=2048; its two-chunk walk spills
# under that cap and is faster uncapped: 478 against 328 us, 2026-12-04 late)
# the launches a cap can be set for
_CAP_NAMES = frozenset(("state", "fpass", "scan", "dstate", "fpass_b", "dx", "dbc", "fbwd", "pair"))


def register_cap(name: str, dtype: torch.dtype, Q: int = 64, p: int = 0) -> dict:
    """``{"maxnreg": cap}`` for kernel ``name`` (kcfg's names), or ``{}`` for none: ``DEFAULT_MAXNREG`` for 16-bit
    inputs at chunk 64 (``DEFAULT_MAXNREG_WIDE`` for heads of ``p`` >= 128 channels).
    ``HMSCALE_SSD_MAXNREG="dbc=168;scan=0"`` overrides it for tuning runs (0: no cap; else 24-255)."""
    table = DEFAULT_MAXNREG_WIDE if _pow2(p) >= 128 and name in DEFAULT_MAXNREG_WIDE else DEFAULT_MAXNREG
    cap = table.get(name, 0) if dtype != torch.float32 and Q == 64 else 0
    for item in filter(None, (t.strip() for t in env("HMSCALE_SSD_MAXNREG", "").split(";"))):
        k, _, v = item.partition("=")
        if (k.strip() not in _CAP_NAMES or not v.strip().isdigit()
                or not (int(v) == 0 or 24 <= int(v) <= 255)):
            raise ValueError(f"HMSCALE_SSD_MAXNREG: {item!r} is not NAME=REGISTERS (NAME one of "
                             f"{', '.join(sorted(_CAP_NAMES))}; 24 to 255, 0 for none), e.g. dbc=168")
        if k.strip() == name:
            cap = int(v)
    return {"maxnreg": cap} if cap else {}


def kcfg(name: str, dtype: torch.dtype, Q: int = 64, p: int = 0) -> tuple:
    """Launch configuration of one kernel; ``HMSCALE_SSD_CFG="state=64,64,4;scan=64,128,8;..."`` overrides it
    (tuning runs only; tile sizes powers of two >= 16, trailing values may be left out). Names: state, dstate
    (BP, BN, warps), scan, dx (BP, BN, warps, stages; 0 = Triton's default), pass, pass_b (BLOCK, warps),
    fpass, fpass_b (the fused state passes of ``HMSCALE_SSD_PASS=fused``: BP, BN, warps, stages), fbwd (the fused
    dx + dB/dC backward, 16-bit inputs only: BN, warps, stages), pair (dB/dC and dx in one launch,
    ``HMSCALE_SSD_BWD_PAIR``: dx's BP, BN, then warps, stages; dB/dC keeps ``dbc_config``'s tiles). ``Q``: the chunk
    size (chunks of 128 and more have their own defaults for 16-bit inputs); ``p``: the head dim, where it matters
    (heads of 128 channels and more have their own defaults, ``DEFAULT_CFG_WIDE``)."""
    if dtype == torch.float32:
        default = DEFAULT_CFG_FP32[name]
    elif Q >= 128 and name in DEFAULT_CFG_Q128:
        default = DEFAULT_CFG_Q128[name]
    elif _pow2(p) >= 128 and name in DEFAULT_CFG_WIDE:
        default = DEFAULT_CFG_WIDE[name]
    else:
        default = DEFAULT_CFG[name]
    got = _cfg_override(name)
    return got + default[len(got):] if got else default


def _cfg_override(name: str) -> tuple:
    """The values ``HMSCALE_SSD_CFG`` sets for kernel ``name`` (empty when it sets none)."""
    for item in env("HMSCALE_SSD_CFG", "").split(";"):
        k, _, v = item.partition("=")
        if k.strip() == name and v:
            return tuple(int(t) for t in v.split(","))
    return ()


def block_sizes(p: int, n: int, dtype: torch.dtype, name: str = "state", Q: int = 64):
    """(BP, BN, num_warps) of the state-building kernels (chunk_state, dstate)."""
    bp, bn, nw = kcfg(name, dtype, Q)
    return min(bp, _pow2(p)), min(bn, _pow2(n)), nw


def pass_mode() -> str:
    """``HMSCALE_SSD_PASS``: how the state building and the serial state pass run, each way.
    ``split``: two launches (chunk_state + state_pass, dstate + state_pass_bwd); ``fused``: one launch that builds
    each chunk's (gradient) state in registers while it walks the chunks (``_state_fused_fwd`` /
    ``_dstate_fused_bwd``: 2 fewer state sweeps each way, but one serial walk per state tile); ``auto`` (default):
    fused when the (batch x head x state tile) programs occupy at least 7/8 of the GPU's multiprocessors, split
    otherwise (long single sequences of small states, where the serial walk would leave most of the GPU idle).
    A walk's time is about its chunk count times one chunk step's latency whatever the program count up to one
    wave, the split passes' time grows with the state bytes: on the H200 at 1.4b L=16384 (b=1, 128 programs on 132
    multiprocessors) fused 972 against split 1068 us of passes, at 410m (32 programs) 894 against 287; the linear
    crossover between them is ~0.88 of the multiprocessors (kernels/NOTES.md, 2026-12-04 evening)."""
    v = env("HMSCALE_SSD_PASS", "auto").lower()
    if v not in ("split", "fused", "auto"):
        raise ValueError(f"HMSCALE_SSD_PASS must be auto, split or fused, got {v!r}")
    return v


def walk_unroll(dtype: torch.dtype = torch.bfloat16) -> int:
    """``HMSCALE_SSD_WALK_UNROLL=2|1``: chunks per step of the fused state passes' walks. 2 (the default for bf16
    inputs) issues both chunks' loads and dots before carrying the state through them: a walk is a chain of
    per-chunk latencies (H200, 2026-12-04 late: fstate + fdstate 1250 -> 1097 us at 1.4b L=16384, 724 -> 671 at
    L=2048 uncapped). fp16 and fp32 inputs keep 1 by default: their walks' fp32 dots spill 5-8x more bytes unrolled
    (sm_90, Triton 3.6: fp32 fdstate 432 -> 3504), and neither was timed."""
    v = env("HMSCALE_SSD_WALK_UNROLL", "2" if dtype == torch.bfloat16 else "1")
    if v not in ("1", "2"):
        raise ValueError(f"HMSCALE_SSD_WALK_UNROLL must be 1 or 2, got {v!r}")
    return int(v)


_SM_COUNT: dict = {}


def _sm_count(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _SM_COUNT:
        _SM_COUNT[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return _SM_COUNT[i]


def use_fused_pass(b: int, h: int, p: int, n: int, dtype: torch.dtype, device: torch.device, name: str,
                   Q: int = 64) -> bool:
    """Whether this call's state passes (``name`` fpass or fpass_b) run fused (see ``pass_mode``)."""
    mode = pass_mode()
    if mode != "auto":
        return mode == "fused"
    sms = _sm_count(device)
    if sms is None:  # the CPU interpreter: the split passes (the fused ones are tested explicitly)
        return False
    bp, bn = kcfg(name, dtype, Q)[:2]  # the tile the rule was measured with (64 x 64 for 16-bit inputs)
    return 8 * b * h * cdiv(p, min(bp, _pow2(p))) * cdiv(n, min(bn, _pow2(n))) >= 7 * sms


def fused_pass_config(p: int, n: int, dtype: torch.dtype, name: str = "fpass", Q: int = 64, bh: int = 0,
                      device: torch.device | None = None):
    """(BP, BN, num_warps, num_stages) of a fused state pass over ``bh`` (batch x head) states on ``device``. When
    the default tile leaves resident slots idle (long single sequences), its BN is halved: a multiprocessor holds two
    4-warp walks or one 8-warp walk, so the tile is halved while twice its programs still fit in one round, i.e.
    2 x programs < multiprocessors x (8 / warps). H200, 2026-12-04: 1.4b L=16384 at b=1 with 64 x 64 tiles, 128 ->
    256 programs, fstate + fdstate 1097 -> 891 us; the wide heads' 8-warp 128 x 64 tile at b=2 (128 programs) walks
    in 567 us and halved (two rounds) in 732, at b=1 (64 programs) it is halved. The backward walk of those heads
    halves its rows too, into 4-warp 64 x 32 tiles, two a multiprocessor (H100, 2026-12-06 twentieth session: fdstate
    340 -> 307 us at 1.4b L=16384 x 1; the forward walk unchanged that way, 362 -> 360; where the rule does not
    halve, the 4-warp tile is slower: 227 -> 353 us at b=2). Not with a tile set through ``HMSCALE_SSD_CFG``."""
    bp, bn, nw, st = kcfg(name, dtype, Q, p)
    bp, bn = min(bp, _pow2(p)), min(bn, _pow2(n))
    sms = _sm_count(device) if device is not None else None
    if (sms and bn >= 64 and not _cfg_override(name)
            and 2 * bh * cdiv(p, bp) * cdiv(n, bn) < sms * max(1, 8 // nw)):
        bn //= 2
        if name == "fpass_b" and nw == 8 and bp >= 128:  # the wide heads' backward walk: 4-warp tiles of half the rows
            bp, nw = bp // 2, 4
    return bp, bn, nw, st


def scale_group(n: int, walk_bn: int | None) -> int:
    """The group size GS of scaled fp16 state storage (one exponent per GS consecutive columns of a state row) for
    states of ``n`` columns written by a fused walk of ``walk_bn``-column tiles (each tile row is a group) or, with
    None, by the split pass (the largest of 64, 32, 16 dividing n); 0 where none divides n (the call then stores
    fp32)."""
    if walk_bn is not None:
        return walk_bn if n % walk_bn == 0 else 0
    return next((gs for gs in (64, 32, 16) if n % gs == 0), 0)


def state_layout(b: int, h: int, p: int, n: int, dtype: torch.dtype, device: torch.device, Q: int = 64,
                 grad: bool = False):
    """(storage dtype, GS, fused walk config or None) of one call's chunk states (``grad``: state gradients):
    ``state_dtype``, and for fp16 the scale group of ``scale_group`` (fp32 where no group fits, where ``auto`` finds
    it under 32 columns, and under the v1 backward, whose kernels read unscaled states), and the walk's (BP, BN, warps,
    stages) when the pass is fused."""
    name = "fpass_b" if grad else "fpass"
    st = state_dtype(dtype, grad)
    cfg = fused_pass_config(p, n, dtype, name, Q, b * h, device) if use_fused_pass(b, h, p, n, dtype, device, name,
                                                                                    Q) else None
    gs = 0
    if st == torch.float16:
        gs = scale_group(n, cfg[1] if cfg else None) if bwd_variant() == "v2" else 0
        if gs < (32 if state_storage()[2] else 1):
            st, gs = torch.float32, 0
    return st, gs, cfg


def reader_bn(bn: int, *gs: int) -> int:
    """A reader kernel's n tile under scaled fp16 storage: at most two scale groups (``gs``, 0 for unscaled tensors),
    so that each tile row has one exponent or two (``_load_st_tile``)."""
    return min([bn] + [2 * g for g in gs if g])


def state_exponents(states: torch.Tensor, gs: int) -> torch.Tensor:
    """The int8 exponents of scaled fp16 states (one per ``gs`` columns of each state row), or an empty tensor. Their
    storage is padded to whole 4-byte words, so that ``exponent_words`` can give readers int32 words over it."""
    if not gs:
        return states.new_empty(0, dtype=torch.int8)
    shape = (*states.shape[:-1], states.shape[-1] // gs)
    numel = math.prod(shape)
    return states.new_empty(-(-numel // 4) * 4, dtype=torch.int8)[:numel].view(shape)


def exponent_load_mode() -> str:
    """``HMSCALE_SSD_EXP_LOAD=word|byte`` (default word): how the readers (the scan, dx, dB/dC) load the scaled
    states' int8 exponents: the int32 word holding a tile row's exponent, or the byte itself. Triton 3.6's pipeliner
    stages only loads of 32 bits or more a thread through asynchronous copies, so byte loads stay synchronous inside
    the readers' loops (kernels/NOTES.md, twenty-second session). H200, 2026-12-07 (sweeps/exp_words.txt), fwd+bwd:
    1.4b L=2048 x 8 1.543 / 1.530 -> 1.486 / 1.476 ms, L=16384 x 1 1.822 / 1.806 -> 1.706 / 1.698 (the pair -61-67 us,
    the b = 1 scan -55 us); the 160m / 410m training calls within noise."""
    v = env("HMSCALE_SSD_EXP_LOAD", "word").lower()
    if v not in ("byte", "word"):
        raise ValueError(f"HMSCALE_SSD_EXP_LOAD must be byte or word, got {v!r}")
    return v


def exponent_words(exps: torch.Tensor) -> torch.Tensor:
    """What the readers get for ``exps`` (``state_exponents``, or an empty / unscaled placeholder): with word loads
    (``HMSCALE_SSD_EXP_LOAD``, the default), an int32 view of its padded storage, where a reader whose tile row spans
    two groups finds both in one word; otherwise ``exps`` itself. The words need an even number of groups per row (so
    that a row's groups 2j and 2j + 1 share a word) or one group; other layouts keep byte loads."""
    if exps.dtype != torch.int8 or not exps.numel() or exponent_load_mode() != "word":
        return exps
    groups = exps.shape[-1]
    if groups != 1 and groups % 2:
        return exps
    storage = exps.untyped_storage()
    if exps.storage_offset() or storage.nbytes() % 4 or not exps.is_contiguous():
        return exps
    return torch.empty(0, dtype=torch.int32, device=exps.device).set_(storage, 0, (storage.nbytes() // 4,))


def pass_config(pn: int, dtype: torch.dtype, name: str = "pass"):
    block, nw = kcfg(name, dtype)
    return min(block, _pow2(pn)), nw


def bwd_variant() -> str:
    """``v2`` (default: the decay-gradient terms live in ``_chunk_bwd_dx_dcs``, and ``_chunk_bwd_dbc`` only does
    dB and dC; 1.1-1.3x faster fwd+bwd than v1 on the H200, full GPU check 225/225) or ``v1`` (the decay-gradient
    terms inside ``_chunk_bwd_dbc``). Env ``HMSCALE_SSD_BWD``."""
    v = env("HMSCALE_SSD_BWD", "v2").lower()
    if v not in ("v1", "v2"):
        raise ValueError(f"HMSCALE_SSD_BWD must be v1 or v2, got {v!r}")
    return v


def save_y_mode() -> bool:
    """``HMSCALE_SSD_SAVE_Y=1|0``: whether the forward keeps the fp32 numerator y for the backward's dx kernel,
    which then reads it instead of recomputing y from the entering states (default 1: +4 bytes per element of x
    held for the backward, and without normalize a (b, l, h, p) fp32 write in the forward; 0 recomputes, and the
    fused normaliser then keeps the numerator only for its own gradient)."""
    v = env("HMSCALE_SSD_SAVE_Y", "1")
    if v not in ("0", "1"):
        raise ValueError(f"HMSCALE_SSD_SAVE_Y must be 0 or 1, got {v!r}")
    return v == "1"


def keeps_ynum(norm: bool, save_ynum: bool) -> bool:
    """Whether a forward asked to keep what its backward needs (``save_ynum``) writes the fp32 numerator: the fused
    normaliser's gradient always needs it, dx too under ``save_y_mode`` (v2 backward)."""
    return save_ynum and (norm or (save_y_mode() and bwd_variant() == "v2"))


class FwdPlan(NamedTuple):
    """What one forward launches, from its shapes, options and the switches (``fwd_plan``)."""
    nc: int
    ps: int  # state rows: p, plus the normaliser's
    st_dtype: torch.dtype
    gs: int  # scale group of scaled fp16 states, 0 otherwise
    keep_ynum: bool
    fused: bool  # one walk launch (_state_fused_fwd) instead of _chunk_state_fwd + _state_pass_fwd
    grid_state: tuple
    state_kw: dict
    grid_pass: tuple
    pass_kw: dict
    grid_scan: tuple
    scan_kw: dict


@switch_cached
def fwd_plan(b: int, l: int, h: int, p: int, n: int, dtype: torch.dtype, Q: int, norm: bool, has_d: bool,
             has_doc: bool, has_init: bool, save_ynum: bool, dev: torch.device, sms) -> FwdPlan:
    """The launch plan of one forward call (``sms``: the multiprocessor count ``_sm_count`` gives, part of the key).
    Memoised with the switches' values: a repeated call shape reads no switch and recomputes no tile."""
    nc = cdiv(l, Q)
    ps = p + int(norm)
    st_dtype, gs, walk = state_layout(b, h, p, n, dtype, dev, Q)
    common = dict(Q=Q, HAS_DOC=has_doc, PREC=state_precision(dtype), NORM=int(norm))
    if walk is not None:
        BP, BN, nw, nst = walk
        grid_state = (b * h, cdiv(p, BP) * cdiv(n, BN))
        state_kw = dict(common, BP=BP, BN=BN, HAS_INIT=has_init, UNROLL=walk_unroll(dtype), GS=gs, num_warps=nw,
                        num_stages=nst, **register_cap("fpass", dtype, Q))
        grid_pass, pass_kw = (), {}
    else:
        BP, BN, nw = block_sizes(p, n, dtype, "state", Q)
        grid_state = (nc, b * h, cdiv(p, BP) * cdiv(n, BN))
        state_kw = dict(common, BP=BP, BN=BN, num_warps=nw, **register_cap("state", dtype, Q))
        BLOCK, nwp = pass_config(ps * n, dtype)
        grid_pass = (b * h, cdiv(ps * n, BLOCK))
        pass_kw = dict(HAS_INIT=has_init, BLOCK=BLOCK, GS=gs, num_warps=nwp)
    prec, sprec = precisions(dtype)
    keep = keeps_ynum(norm, save_ynum)
    bp, bn, nw, nst = kcfg("scan", dtype, Q, p)
    bp = min(bp, _pow2(p))
    scan_kw = dict(Q=Q, BP=bp, BN=reader_bn(min(bn, _pow2(n)), gs), HAS_DOC=has_doc, PREC=prec, SPREC=sprec,
                   NORM=int(norm), SAVE_YNUM=keep, HAS_D=has_d, YPREC=state_precision(dtype), GS=gs, num_warps=nw,
                   **(dict(num_stages=nst) if nst else {}), **register_cap("scan", dtype, Q, p))
    return FwdPlan(nc, ps, st_dtype, gs, keep, walk is not None, grid_state, state_kw, grid_pass, pass_kw,
                   (nc, b * h, cdiv(p, bp)), scan_kw)


def ssd_fwd(x, dt, A, B, C, initial_state, doc, Q: int, out_dtype=None, norm: bool = False, D=None,
            save_ynum: bool = False):
    """Run the forward. Returns y, ynum, den, final_state, states (S_prev of each chunk, p + norm rows, in the
    storage dtype of ``state_layout``), gdecay, and the states' exponents (``state_exponents``: int8, empty unless
    the states are scaled fp16). With ``norm`` (the fused normaliser) y is already divided by den (b, l, h) fp32, and
    ynum, the fp32 numerator, is kept when ``save_ynum`` (else None); ``D`` ((h, p) fp32, or None) adds ``D x``."""
    b, l, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    dev = x.device
    assert dt.shape == (b, h, l), "ssd_fwd takes dt heads-major, (b, h, l)"
    has_doc, has_init = doc is not None, initial_state is not None
    pl = fwd_plan(b, l, h, p, n, x.dtype, Q, norm, D is not None, has_doc, has_init, save_ynum, dev, _sm_count(dev))
    nc, ps = pl.nc, pl.ps
    states = torch.empty(b, h, nc, ps, n, device=dev, dtype=pl.st_dtype)
    sexp = state_exponents(states, pl.gs)
    gdec = torch.empty(b * h, nc, device=dev, dtype=torch.float32)
    final = torch.empty(b, h, ps, n, device=dev, dtype=torch.float32)
    y = torch.empty(b, l, h, p, device=dev, dtype=out_dtype or x.dtype)
    den = torch.empty(b, l, h, device=dev, dtype=torch.float32) if norm else None
    ynum = torch.empty(b, l, h, p, device=dev, dtype=torch.float32) if pl.keep_ynum else None
    doc_arg = doc if has_doc else dt
    e_arg = sexp if pl.gs else gdec
    init_arg = initial_state if has_init else final
    if pl.fused:
        launch(_state_fused_fwd, pl.grid_state, x, dt, A, B, doc_arg, states, gdec, init_arg, final, e_arg,
               l, h, g, p, n, nc, **pl.state_kw)
    else:
        # the chunks' local states in fp32 (the serial pass sums them), then the entering states in their storage
        local = states if states.dtype == torch.float32 else torch.empty(states.shape, device=dev,
                                                                        dtype=torch.float32)
        launch(_chunk_state_fwd, pl.grid_state, x, dt, A, B, doc_arg, local, gdec, l, h, g, p, n, nc, **pl.state_kw)
        launch(_state_pass_fwd, pl.grid_pass, local, states, gdec, init_arg, final, e_arg, nc, ps * n, **pl.pass_kw)
    launch(_chunk_scan_fwd, pl.grid_scan, x, dt, A, B, C, doc_arg, states, y, den if norm else y,
           ynum if ynum is not None else y, D if D is not None else dt, exponent_words(e_arg), l, h, g, p, n, nc,
           **pl.scan_kw)
    return y, ynum, den, final, states, gdec, sexp


@triton.jit
def _norm_bwd_prologue(dy_ptr, ynum_ptr, den_ptr, dyn_ptr, dden_ptr, R, P,
                       BR: tl.constexpr, BPF: tl.constexpr, WRITE_DYN: tl.constexpr = True):
    """Gradient through y = ynum / den, per row (token, head): dynum = dy / den, dden = -sum_p dy ynum / den^2."""
    rows = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    cols = tl.arange(0, BPF)
    rm = rows < R
    m = rm[:, None] & (cols[None, :] < P)
    off = rows[:, None] * P + cols[None, :]
    dy = tl.load(dy_ptr + off, mask=m, other=0.0).to(tl.float32)
    yn = tl.load(ynum_ptr + off, mask=m, other=0.0)
    rden = 1.0 / tl.load(den_ptr + rows, mask=rm, other=1.0)
    dyn = dy * rden[:, None]
    if WRITE_DYN:
        tl.store(dyn_ptr + off, dyn, mask=m)
    tl.store(dden_ptr + rows, -tl.sum(dyn * yn, axis=1) * rden, mask=rm)


def norm_bwd_prologue(dy, ynum, den, write_dyn: bool = True):
    """(dynum fp32 like ynum, dden fp32 like den) from the gradient of y = ynum / den (+ D x). With
    ``write_dyn=False`` dynum (= dy / den) is not materialised (None): the backward kernels apply 1 / den
    themselves (``ssd_bwd(..., dy_den=den)``)."""
    b, l, h, p = ynum.shape
    dy = dy.contiguous()
    dyn = torch.empty_like(ynum) if write_dyn else None
    dden = torch.empty_like(den)
    R = b * l * h
    BPF = _pow2(p)
    BR = max(1, 2048 // BPF)
    launch(_norm_bwd_prologue, (cdiv(R, BR),), dy, ynum, den, dyn if write_dyn else dden, dden, R, p, BR=BR, BPF=BPF,
           WRITE_DYN=write_dyn, num_warps=8)
    return dyn, dden
