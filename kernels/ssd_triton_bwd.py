"""Triton backward of the chunked SSD.

Notation per chunk (Q tokens, positions t >= s): cs the within-chunk cumulative log-decay,
``decay_ts = exp(cs_t - cs_s)`` (zero across documents), ``win_t = exp(cs_t)`` (zero once a new document
started in the chunk), ``wend_s = exp(cs_end - cs_s)`` (zero unless s is in the chunk's last document),
``S0`` the state entering the chunk, ``dS`` the gradient of the state leaving it.

Launches (default, backward variant v2):

0. ``norm_bwd_prologue`` (normalize only, ssd_triton_fwd): the gradient through y = ynum / den.
1. ``_chunk_dstate_bwd`` (parallel): ``dlocal_c = sum_t win_t dy_t C_t^T`` (plus the normaliser row).
2. ``_state_pass_bwd`` (sequential over chunks, reversed): ``dS_prev = g_c dS + dlocal_c``; overwrites
   the buffer with the gradient leaving each chunk and writes d initial_state.
3. ``_chunk_bwd_dx_dcs`` (grid: chunk x batch*head x p tiles): ``dx_s = dt_s [ sum_t (C_t.B_s) decay_ts dy_t
   + wend_s dS B_s ]`` (+ D dy), and per p tile the partial direct dt gradient and d cs (and dD).
4. ``_chunk_bwd_dbc`` (grid: chunk x batch*group x n tiles, looping over the group's heads so that
   groups shared by several heads are reduced without atomics): dB, dC, and per n tile the partial dot
   <dS, S_prev> that is the gradient of the carry factor g_c (it reads both states anyway: the passes of 1-2
   then never read the forward's states).
5. ``_finish_bwd`` (grid: chunk x batch*head): d cs -> d(dt A) by a reverse cumulative sum within each chunk,
   then ddt and the per-chunk partials of dA.

``_dstate_fused_bwd`` replaces 1 and 2 by one launch under the same rule as the forward's fused pass
(``use_fused_pass``). With the fused normaliser and bf16 inputs the prologue only computes dden, and the kernels
apply 1/den to the output's gradient themselves (``dy_den``). Kernels 3 and 4 launch the tiles of one chunk next
to each other where that was measured to pay (``tile_major``).

``_chunk_bwd_fused`` replaces 3 and 4 by one launch per (chunk, batch*head) where ``use_fused_bwd`` says so (one head
per B/C group, P <= 64 by default): each tile of dS and S0 is read once for dx, dB, dC and the carry gradient.
``_chunk_bwd_pair`` runs 3 and 4 as one launch where ``use_bwd_pair`` says so (one head per B/C group, bf16, P >= 64
by default): the same programs, interleaved by chunk, so that dx's and dB/dC's reads of one chunk's dS, x, dy, B
and C meet in L2.

Variant v1 (``HMSCALE_SSD_BWD=v1``) has ``_chunk_bwd_dx`` (dx only) and the decay-gradient partials in
``_chunk_bwd_dbc`` instead.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .host_math import cdiv
from .launch import launch
from . import ssd_triton_fwd as _fwd
from .settings import env, switch_cached
from .ssd_triton_fwd import (_chunk_decay, _chunk_docs, _chunk_weights, _load_rows, _load_st_row, _load_st_tile,
                             _load_state, _pass_block, _pass_store, _pow2, _state_tile, _store_st_tile, _store_state,
                             _xdot, block_sizes, bwd_variant, dbc_state_precision, exponent_words, kcfg, pass_config,
                             precisions, reader_bn, register_cap, state_exponents, state_layout, state_precision,
                             walk_unroll)


@triton.jit
def _chunk_dstate_bwd(dy_ptr, dden_ptr, dt_ptr, A_ptr, C_ptr, doc_ptr, dst_ptr, den_ptr,
                      L, H, G, P, N, NC,
                      Q: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
                      HAS_DOC: tl.constexpr, PREC: tl.constexpr, NORM: tl.constexpr, DY_SCALE: tl.constexpr = False):
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
    win = tl.exp(cs)
    if HAS_DOC:
        doc, doc_end, doc_prev = _chunk_docs(doc_ptr, b, c, L, offs_t, mask_t, Q)
        win = tl.where(doc == doc_prev, win, 0.0)
    offs_p = pb * BP + tl.arange(0, BP)
    offs_n = nb * BN + tl.arange(0, BN)
    mask_p = offs_p < P
    mask_n = offs_n < N
    dy = _load_rows(dy_ptr + (b * L * H + h) * P, offs_t, mask_t, H * P, offs_p, mask_p)
    Ct = _load_rows(C_ptr + (b * L * G + grp) * N, offs_t, mask_t, G * N, offs_n, mask_n)
    wy = win
    if DY_SCALE:  # dy holds the output's gradient; the numerator's is dy / den (row scale)
        wy = win / tl.load(den_ptr + (b * L * H + h) + offs_t * H, mask=mask_t, other=1.0)
    dyw = dy.to(tl.float32) * wy[:, None]  # about fp32 accuracy (PREC)
    dS = _xdot(tl.trans(dyw), Ct, tl.zeros([BP, BN], dtype=tl.float32), PREC, "b")
    d_base = dst_ptr + (bh * NC + c) * (P + NORM) * N
    tl.store(d_base + (offs_p[:, None] * N + offs_n[None, :]), dS, mask=mask_p[:, None] & mask_n[None, :])
    if NORM:
        if pb == 0:  # the normaliser row: sum_t win_t dden_t C_t
            dr = tl.load(dden_ptr + (b * L * H + h) + offs_t * H, mask=mask_t, other=0.0)
            dSr = tl.sum((win * dr)[:, None] * Ct.to(tl.float32), axis=0)
            tl.store(d_base + P * N + offs_n, dSr, mask=mask_n)


@triton.jit
def _state_pass_bwd(dst_ptr, out_ptr, gdec_ptr, dfinal_ptr, dinit_ptr, e_ptr, NC, PN,
                    HAS_DFINAL: tl.constexpr, HAS_DINIT: tl.constexpr, BLOCK: tl.constexpr, GS: tl.constexpr = 0):
    """The serial backward pass: reads the chunks' fp32 local state gradients at ``dst_ptr`` and writes the gradient
    of the state leaving each chunk at ``out_ptr`` (its storage dtype; the same buffer for fp32), and dinit.
    GS > 0: scaled fp16 storage, as in ``_state_pass_fwd``."""
    bh = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    offs, mask, erow, emask = _pass_block(blk, PN, BLOCK, GS)
    if HAS_DFINAL:
        dS = tl.load(dfinal_ptr + bh * PN + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        dS = (offs * 0).to(tl.float32)
    dbase = dst_ptr + bh * NC * PN + offs
    obase = out_ptr + bh * NC * PN + offs
    ebase = e_ptr + (bh * NC * PN) // tl.maximum(GS, 1)
    EPC = PN // tl.maximum(GS, 1)  # exponents per chunk
    gbase = gdec_ptr + bh * NC
    # four chunks per step (reversed), the next step's loads issued before this step's stores
    # (see _state_pass_fwd)
    k0 = NC - 1
    k1 = tl.maximum(NC - 2, 0)
    k2 = tl.maximum(NC - 3, 0)
    k3 = tl.maximum(NC - 4, 0)
    d0 = tl.load(dbase + k0 * PN, mask=mask, other=0.0)
    d1 = tl.load(dbase + k1 * PN, mask=mask, other=0.0)
    d2 = tl.load(dbase + k2 * PN, mask=mask, other=0.0)
    d3 = tl.load(dbase + k3 * PN, mask=mask, other=0.0)
    g0 = tl.load(gbase + k0)
    g1 = tl.load(gbase + k1)
    g2 = tl.load(gbase + k2)
    g3 = tl.load(gbase + k3)
    for i0 in range(0, NC, 4):
        c0 = NC - 1 - i0
        n0 = tl.maximum(c0 - 4, 0)
        n1 = tl.maximum(c0 - 5, 0)
        n2 = tl.maximum(c0 - 6, 0)
        n3 = tl.maximum(c0 - 7, 0)
        e0 = tl.load(dbase + n0 * PN, mask=mask, other=0.0)
        e1 = tl.load(dbase + n1 * PN, mask=mask, other=0.0)
        e2 = tl.load(dbase + n2 * PN, mask=mask, other=0.0)
        e3 = tl.load(dbase + n3 * PN, mask=mask, other=0.0)
        h0 = tl.load(gbase + n0)
        h1 = tl.load(gbase + n1)
        h2 = tl.load(gbase + n2)
        h3 = tl.load(gbase + n3)
        _pass_store(obase + c0 * PN, dS, mask, ebase + c0 * EPC, erow, emask, GS)
        dS = g0 * dS + d0
        if i0 + 1 < NC:
            _pass_store(obase + (c0 - 1) * PN, dS, mask, ebase + (c0 - 1) * EPC, erow, emask, GS)
            dS = g1 * dS + d1
        if i0 + 2 < NC:
            _pass_store(obase + (c0 - 2) * PN, dS, mask, ebase + (c0 - 2) * EPC, erow, emask, GS)
            dS = g2 * dS + d2
        if i0 + 3 < NC:
            _pass_store(obase + (c0 - 3) * PN, dS, mask, ebase + (c0 - 3) * EPC, erow, emask, GS)
            dS = g3 * dS + d3
        d0, d1, d2, d3 = e0, e1, e2, e3
        g0, g1, g2, g3 = h0, h1, h2, h3
    if HAS_DINIT:
        tl.store(dinit_ptr + bh * PN + offs, dS, mask=mask)


@triton.jit
def _bwd_chunk_term(dy_base, c_base, dt_ptr, A_ptr, doc_ptr, gdec_ptr, dden_ptr, den_ptr, b, h, bh, c, L, H, G, P, N,
                    NC, offs_p, mask_p, offs_n, mask_n, Q: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
                    HAS_DOC: tl.constexpr, PREC: tl.constexpr, NORM: tl.constexpr, DY_SCALE: tl.constexpr):
    """What chunk c adds to a (BP x BN) state-gradient tile and its normaliser row, and its decay g: the gradient
    entering c (leaving c - 1) is ``g dS + T`` with dS the one leaving c (``Tr`` for the row; zeros without NORM)."""
    offs_t, mask_t, dt, cs, cs_end = _chunk_decay(dt_ptr, A_ptr, b, h, c, L, H, Q)
    win = tl.exp(cs)
    if HAS_DOC:
        doc, doc_end, doc_prev = _chunk_docs(doc_ptr, b, c, L, offs_t, mask_t, Q)
        win = tl.where(doc == doc_prev, win, 0.0)
    g = tl.where(c < NC, tl.load(gdec_ptr + bh * NC + tl.minimum(c, NC - 1)), 1.0)  # (c = NC: the walks' pad)
    dy = _load_rows(dy_base, offs_t, mask_t, H * P, offs_p, mask_p)
    Ct = _load_rows(c_base, offs_t, mask_t, G * N, offs_n, mask_n)
    wy = win
    if DY_SCALE:
        wy = win / tl.load(den_ptr + (b * L * H + h) + offs_t * H, mask=mask_t, other=1.0)
    if BN < BP:  # the weights scale the smaller operand (see the forward's _fwd_chunk_term)
        T = _xdot(tl.trans(dy), Ct.to(tl.float32) * wy[:, None], tl.zeros([BP, BN], dtype=tl.float32), PREC, "a")
    else:
        T = _xdot(tl.trans(dy.to(tl.float32) * wy[:, None]), Ct, tl.zeros([BP, BN], dtype=tl.float32), PREC, "b")
    if NORM:
        dr = tl.load(dden_ptr + (b * L * H + h) + offs_t * H, mask=mask_t, other=0.0)
        Tr = tl.sum((win * dr)[:, None] * Ct.to(tl.float32), axis=0)
    else:
        Tr = tl.zeros([BN], dtype=tl.float32)
    return T, Tr, g


@triton.jit
def _dstate_fused_bwd(dy_ptr, dden_ptr, dt_ptr, A_ptr, C_ptr, doc_ptr, gdec_ptr, dst_ptr,
                      dfinal_ptr, dinit_ptr, den_ptr, e_ptr,
                      L, H, G, P, N, NC,
                      Q: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
                      HAS_DOC: tl.constexpr, PREC: tl.constexpr, NORM: tl.constexpr,
                      HAS_DFINAL: tl.constexpr, HAS_DINIT: tl.constexpr, DY_SCALE: tl.constexpr = False,
                      UNROLL: tl.constexpr = 1, GS: tl.constexpr = 0):
    """``_chunk_dstate_bwd`` and ``_state_pass_bwd`` in one launch (``HMSCALE_SSD_PASS=fused``): one program per
    (batch*head, state tile) walks the chunks backwards, builds each chunk's local state gradient in registers
    and writes only the gradient leaving each chunk (the first p tile's programs also the normaliser row's).
    UNROLL 2: two chunks per step, as in ``_state_fused_fwd``."""
    bh = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    b, h, grp, offs_p, offs_n, mask_p, mask_n, soff, smask, rmask = _state_tile(bh, blk, H, G, P, N, BP, BN, NORM)
    PN = (P + NORM) * N
    if HAS_DFINAL:
        dS, dSr = _load_state(dfinal_ptr + bh * PN, soff, smask, offs_n, rmask, P, N, NORM)
    else:
        dS = tl.zeros([BP, BN], dtype=tl.float32)
        dSr = tl.zeros([BN], dtype=tl.float32)
    dy_base = dy_ptr + (b * L * H + h) * P
    c_base = C_ptr + (b * L * G + grp) * N
    n0 = (blk // tl.cdiv(P, BP)) * BN  # the tile's first column
    EPC = PN // tl.maximum(GS, 1)  # exponents per chunk (GS > 0)
    for i in range(0, NC, UNROLL):
        c = NC - 1 - i
        T, Tr, g = _bwd_chunk_term(dy_base, c_base, dt_ptr, A_ptr, doc_ptr, gdec_ptr, dden_ptr, den_ptr, b, h, bh, c,
                                   L, H, G, P, N, NC, offs_p, mask_p, offs_n, mask_n, Q, BP, BN, HAS_DOC, PREC, NORM,
                                   DY_SCALE)
        if UNROLL == 2:
            # a lone first chunk pairs with the chunk past the end: masked loads give T1 = 0, g1 = 1, nothing stored
            c1 = tl.where(c > 0, c - 1, NC)
            T1, Tr1, g1 = _bwd_chunk_term(dy_base, c_base, dt_ptr, A_ptr, doc_ptr, gdec_ptr, dden_ptr, den_ptr, b, h,
                                          bh, c1, L, H, G, P, N, NC, offs_p, mask_p, offs_n, mask_n, Q, BP, BN,
                                          HAS_DOC, PREC, NORM, DY_SCALE)
        # the gradient of the state leaving chunk c
        _store_st_tile(dst_ptr + (bh * NC + c) * PN, e_ptr + (bh * NC + c) * EPC, dS, dSr, soff, smask, offs_p,
                       mask_p, offs_n, rmask, n0, P, N, NORM, GS)
        dS = g * dS + T
        if NORM:
            dSr = dSr * g + Tr
        if UNROLL == 2:
            in1 = (offs_n * 0 + c) > 0  # (a vector: a scalar is not a valid mask everywhere)
            _store_st_tile(dst_ptr + (bh * NC + c1) * PN, e_ptr + (bh * NC + c1) * EPC, dS, dSr, soff,
                           smask & in1[None, :], offs_p, mask_p & ((offs_p * 0 + c) > 0), offs_n, rmask & in1, n0,
                           P, N, NORM, GS)
            dS = g1 * dS + T1
            if NORM:
                dSr = dSr * g1 + Tr1
    if HAS_DINIT:
        _store_state(dinit_ptr + bh * PN, dS, dSr, soff, smask, offs_n, rmask, P, N, NORM)


@triton.jit
def _chunk_bwd_dx(dy_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, doc_ptr, dst_ptr, dx_ptr,
                  L, H, G, P, N, NC,
                  Q: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
                  HAS_DOC: tl.constexpr, PREC: tl.constexpr, SPREC: tl.constexpr,
                  IN_DTYPE: tl.constexpr):
    c = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    pb = tl.program_id(2)
    b = bh // H
    h = bh % H
    grp = h // (H // G)
    offs_t, mask_t, dt, cs, cs_end = _chunk_decay(dt_ptr, A_ptr, b, h, c, L, H, Q)
    offs_p = pb * BP + tl.arange(0, BP)
    mask_p = offs_p < P
    bc_base = (b * L * G + grp) * N
    accGT = tl.zeros([Q, Q], dtype=tl.float32)  # [s, t] = B_s . C_t
    accZ = tl.zeros([Q, BP], dtype=tl.float32)  # [s, p] = (dS B_s)_p
    for n0 in range(0, N, BN):
        offs_n = n0 + tl.arange(0, BN)
        mask_n = offs_n < N
        bc_off = offs_t[:, None] * (G * N) + offs_n[None, :]
        bc_mask = mask_t[:, None] & mask_n[None, :]
        Bt = tl.load(B_ptr + bc_base + bc_off, mask=bc_mask, other=0.0)
        Ct = tl.load(C_ptr + bc_base + bc_off, mask=bc_mask, other=0.0)
        accGT += tl.dot(Bt, tl.trans(Ct), input_precision=PREC)
        dSt = tl.load((dst_ptr + (bh * NC + c) * P * N) + (offs_p[None, :] * N + offs_n[:, None]),
                      mask=mask_p[None, :] & mask_n[:, None], other=0.0).to(tl.float32)  # (BN, BP) = dS^T
        accZ = _xdot(Bt, dSt, accZ, SPREC, "a")
    tt = tl.arange(0, Q)
    keep = tt[:, None] <= tt[None, :]  # s <= t
    wend = tl.exp(cs_end - cs)
    if HAS_DOC:
        doc, doc_end, doc_prev = _chunk_docs(doc_ptr, b, c, L, offs_t, mask_t, Q)
        keep = keep & (doc[:, None] == doc[None, :])
        wend = tl.where(doc == doc_end, wend, 0.0)
    decayT = tl.exp(tl.where(keep, cs[None, :] - cs[:, None], float("-inf")))
    dy = _load_rows(dy_ptr + (b * L * H + h) * P, offs_t, mask_t, H * P, offs_p, mask_p).to(IN_DTYPE)
    dx = tl.dot((accGT * decayT).to(IN_DTYPE), dy, input_precision=PREC)
    dx = dt[:, None] * (dx + wend[:, None] * accZ)
    tl.store((dx_ptr + (b * L * H + h) * P) + (offs_t[:, None] * (H * P) + offs_p[None, :]),
             dx.to(dx_ptr.dtype.element_ty), mask=mask_t[:, None] & mask_p[None, :])


@triton.jit
def _dx_tile(MT, dy, x, accZ, dt, wend, rden, dyo_ptr, D_ptr, dD_ptr, dx_ptr, xo, xt, xm, h, P, offs_p, mask_p, bh, c,
             NC, XPREC: tl.constexpr, DY_EXACT: tl.constexpr, DY_SCALE: tl.constexpr, HAS_D: tl.constexpr):
    """dx of one (chunk, p tile), stored, with dD's per-chunk partial (HAS_D); returns dx / dt and x in fp32.
    MT [s, t] = (B_s . C_t) decay; accZ [s, p] = (dS B_s)_p; rden (DY_SCALE) the rows' 1 / den."""
    if DY_SCALE:  # dx / dt, with dy / den = dy * rden (rows t)
        stuff = _xdot(MT * rden[None, :], dy, wend[:, None] * accZ, XPREC, "b")
    elif DY_EXACT:  # dx / dt
        stuff = _xdot(MT, dy, wend[:, None] * accZ, XPREC, "b")
    else:
        stuff = _xdot(MT, dy, wend[:, None] * accZ, XPREC, "none")
    xf = x.to(tl.float32)
    dxv = dt[:, None] * stuff
    if HAS_D:  # D (h, p) fp32; dD partial (b*h, nc, p)
        dyo = tl.load(dyo_ptr + xo + xt, mask=xm, other=0.0).to(tl.float32)
        Dv = tl.load(D_ptr + h * P + offs_p, mask=mask_p, other=0.0)
        dxv += Dv[None, :] * dyo
        tl.store(dD_ptr + (bh * NC + c) * P + offs_p, tl.sum(dyo * xf, axis=0), mask=mask_p)
    tl.store(dx_ptr + xo + xt, dxv.to(dx_ptr.dtype.element_ty), mask=xm)
    return stuff, xf


@triton.jit
def _dcs_store(ddt_direct, u, dyy, dt, wend, tt, ddt_ptr, dcs_ptr, po, Q: tl.constexpr):
    """The chunk's d cs from the row sums (dy . y, x . dx / dt, x . dS B) and both partials' stores at ``po``."""
    endterm = wend * dt * u
    dcs = dyy - dt * ddt_direct
    dcs = tl.where(tt == Q - 1, dcs + tl.sum(endterm, axis=0), dcs)
    tl.store(ddt_ptr + po, ddt_direct)
    tl.store(dcs_ptr + po, dcs)


@triton.jit
def _chunk_bwd_dx_dcs(x_ptr, dy_ptr, dden_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, doc_ptr, st_ptr, dst_ptr, se_ptr, de_ptr,
                      dx_ptr, ddt_ptr, dcs_ptr, dyo_ptr, D_ptr, dD_ptr, den_ptr, ys_ptr,
                      L, H, G, P, N, NC, NPB,
                      Q: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
                      HAS_DOC: tl.constexpr, PREC: tl.constexpr, XPREC: tl.constexpr,
                      DY_EXACT: tl.constexpr, NORM: tl.constexpr, HAS_D: tl.constexpr = False,
                      DY_SCALE: tl.constexpr = False, TILE_MAJOR: tl.constexpr = False,
                      Y_SAVED: tl.constexpr = False, GSS: tl.constexpr = 0, GSD: tl.constexpr = 0):
    """Backward variant "v2" (the default; HMSCALE_SSD_BWD=v1 selects the older one): dx plus, as partial sums over
    this p tile, the direct dt gradient and d cs, using ``rowsum(PG dt) + v = dy . y`` (y recomputed in fp32) and
    ``colPG + wend u = x . (dx / dt)``. All dots feeding those sums run at about fp32 accuracy (XPREC). With NORM
    the first p tile also adds the normaliser column's terms (x = 1, dy = dden, state row P). HAS_D: the D skip's
    gradients from ``dyo`` (the gradient of the final output): dx += D dyo, and per-chunk partial sums of dyo x.
    DY_SCALE: ``dy`` is the output's gradient and the numerator's is ``dy / den`` (per row): the 1/den scale goes on
    the t columns of the Q x Q operand and on the dy . y sums, so dy stays an exact 16-bit operand.
    TILE_MAJOR: grid (chunks x p tiles, batch*head), the p tiles of a chunk launched together (they read the same
    B, C tiles: L2 hits instead of HBM reads); else (chunks, batch*head, p tiles).
    Y_SAVED: the forward kept y (the fp32 numerator, before 1/den and D) at ``ys_ptr``, and with NORM its
    normaliser den at ``den_ptr``: dy . y reads them instead of recomputing y, so the entering states S0 are not
    read and 4 of the kernel's 9 state-precision dots go."""
    if TILE_MAJOR:
        c = tl.program_id(0) // NPB
        pb = tl.program_id(0) % NPB
    else:
        c = tl.program_id(0)
        pb = tl.program_id(2)
    _dx_dcs_body(x_ptr, dy_ptr, dden_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, doc_ptr, st_ptr, dst_ptr, se_ptr, de_ptr,
                 dx_ptr, ddt_ptr, dcs_ptr, dyo_ptr, D_ptr, dD_ptr, den_ptr, ys_ptr, c, pb,
                 tl.program_id(1).to(tl.int64), L, H, G, P, N, NC, NPB, Q, BP, BN, HAS_DOC, PREC, XPREC, DY_EXACT,
                 NORM, HAS_D, DY_SCALE, Y_SAVED, GSS, GSD)


@triton.jit
def _dx_dcs_body(x_ptr, dy_ptr, dden_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, doc_ptr, st_ptr, dst_ptr, se_ptr, de_ptr, dx_ptr,
                 ddt_ptr, dcs_ptr, dyo_ptr, D_ptr, dD_ptr, den_ptr, ys_ptr, c, pb, bh,
                 L, H, G, P, N, NC, NPB,
                 Q: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
                 HAS_DOC: tl.constexpr, PREC: tl.constexpr, XPREC: tl.constexpr,
                 DY_EXACT: tl.constexpr, NORM: tl.constexpr, HAS_D: tl.constexpr,
                 DY_SCALE: tl.constexpr, Y_SAVED: tl.constexpr, GSS: tl.constexpr, GSD: tl.constexpr):
    """One (chunk ``c``, p tile ``pb``, batch*head ``bh``) program of ``_chunk_bwd_dx_dcs`` (also run by
    ``_chunk_bwd_pair``)."""
    b = bh // H
    h = bh % H
    grp = h // (H // G)
    offs_t, mask_t, dt, cs, cs_end = _chunk_decay(dt_ptr, A_ptr, b, h, c, L, H, Q)
    offs_p = pb * BP + tl.arange(0, BP)
    mask_p = offs_p < P
    bc_base = (b * L * G + grp) * N
    s_base = (bh * NC + c) * (P + NORM) * N
    accGT = tl.zeros([Q, Q], dtype=tl.float32)  # [s, t] = B_s . C_t
    accZ = tl.zeros([Q, BP], dtype=tl.float32)  # [s, p] = (dS B_s)_p
    accYI = tl.zeros([Q, BP], dtype=tl.float32)  # [t, p] = (S0 C_t)_p
    accZr = tl.zeros([Q], dtype=tl.float32)  # normaliser row: dS[P] . B_s
    accYIr = tl.zeros([Q], dtype=tl.float32)  # S0[P] . C_t
    for n0 in range(0, N, BN):
        offs_n = n0 + tl.arange(0, BN)
        mask_n = offs_n < N
        bc_off = offs_t[:, None] * (G * N) + offs_n[None, :]
        bc_mask = mask_t[:, None] & mask_n[None, :]
        Bt = tl.load(B_ptr + bc_base + bc_off, mask=bc_mask, other=0.0)
        Ct = tl.load(C_ptr + bc_base + bc_off, mask=bc_mask, other=0.0)
        accGT += tl.dot(Bt, tl.trans(Ct), input_precision=PREC)
        so = offs_p[None, :] * N + offs_n[:, None]
        sm = mask_p[None, :] & mask_n[:, None]
        # (BN, BP) = dS^T
        dSt = _load_st_tile(dst_ptr, s_base, so, sm, de_ptr, offs_p, mask_p, n0, offs_n, N, GSD, BN, 1)
        accZ = _xdot(Bt, dSt, accZ, XPREC, "a")
        if not Y_SAVED:
            # (BN, BP) = S0^T
            S0t = _load_st_tile(st_ptr, s_base, so, sm, se_ptr, offs_p, mask_p, n0, offs_n, N, GSS, BN, 1)
            accYI = _xdot(Ct, S0t, accYI, XPREC, "a")
        if NORM:
            dSr = _load_st_row(dst_ptr, s_base, offs_n, mask_n, de_ptr, n0, P, N, GSD, BN)
            accZr += tl.sum(Bt.to(tl.float32) * dSr[None, :], axis=1)
            if not Y_SAVED:
                S0r = _load_st_row(st_ptr, s_base, offs_n, mask_n, se_ptr, n0, P, N, GSS, BN)
                accYIr += tl.sum(Ct.to(tl.float32) * S0r[None, :], axis=1)
    tt = tl.arange(0, Q)
    keep = tt[:, None] <= tt[None, :]  # s <= t
    wend = tl.exp(cs_end - cs)
    win = tl.exp(cs)
    if HAS_DOC:
        doc, doc_end, doc_prev = _chunk_docs(doc_ptr, b, c, L, offs_t, mask_t, Q)
        keep = keep & (doc[:, None] == doc[None, :])
        wend = tl.where(doc == doc_end, wend, 0.0)
        win = tl.where(doc == doc_prev, win, 0.0)
    MT = accGT * tl.exp(tl.where(keep, cs[None, :] - cs[:, None], float("-inf")))  # [s, t]
    xo = (b * L * H + h) * P
    xt = offs_t[:, None] * (H * P) + offs_p[None, :]
    xm = mask_t[:, None] & mask_p[None, :]
    dy = tl.load(dy_ptr + xo + xt, mask=xm, other=0.0)
    x = tl.load(x_ptr + xo + xt, mask=xm, other=0.0)
    rden = dt  # unused without DY_SCALE
    if DY_SCALE:
        rden = 1.0 / tl.load(den_ptr + (b * L * H + h) + offs_t * H, mask=mask_t, other=1.0)
    stuff, xf = _dx_tile(MT, dy, x, accZ, dt, wend, rden, dyo_ptr, D_ptr, dD_ptr, dx_ptr, xo, xt, xm, h, P, offs_p,
                         mask_p, bh, c, NC, XPREC, DY_EXACT, DY_SCALE, HAS_D)
    if Y_SAVED:
        y = tl.load(ys_ptr + xo + xt, mask=xm, other=0.0)
    else:
        y = _xdot(tl.trans(MT * dt[:, None]), x, win[:, None] * accYI, XPREC, "b")
    ddt_direct = tl.sum(xf * stuff, axis=1)
    u = tl.sum(xf * accZ, axis=1)
    dyy = tl.sum(dy.to(tl.float32) * y, axis=1)
    if DY_SCALE:
        dyy = dyy * rden
    if NORM:  # the normaliser column (x = 1), on the first p tile only
        fr = tl.where(pb == 0, 1.0, 0.0)
        dr = tl.load(dden_ptr + (b * L * H + h) + offs_t * H, mask=mask_t, other=0.0)
        stuff_r = tl.sum(MT * dr[None, :], axis=1) + wend * accZr
        if Y_SAVED:
            y_r = tl.load(den_ptr + (b * L * H + h) + offs_t * H, mask=mask_t, other=0.0)
        else:
            y_r = tl.sum(MT * dt[:, None], axis=0) + win * accYIr
        ddt_direct += fr * stuff_r
        u += fr * accZr
        dyy += fr * (dr * y_r)
    _dcs_store(ddt_direct, u, dyy, dt, wend, tt, ddt_ptr, dcs_ptr, (bh * NPB + pb) * (NC * Q) + c * Q + tt, Q)


@triton.jit
def _dbc_head(x_ptr, dy_ptr, dden_ptr, dt_ptr, A_ptr, doc_ptr, st_ptr, dst_ptr, se_ptr, de_ptr,
              den_ptr, dg_ptr, b, h, c, nb,
              L, H, P, N, NC, NNB, offs_n, mask_n, Q: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
              HAS_DOC: tl.constexpr, PREC: tl.constexpr, SPREC: tl.constexpr, IN_DTYPE: tl.constexpr,
              NORM: tl.constexpr, DY_EXACT: tl.constexpr, DY_SCALE: tl.constexpr, GSS: tl.constexpr,
              GSD: tl.constexpr):
    """One head's part of dB/dC for one (chunk, n tile): the sums over P, dy_t . x_s [t, s], x_s^T dS [s, n] and
    dy_t^T S0 [t, n] (the numerator's dy / den with DY_SCALE; the normaliser column's terms with NORM), and the
    chunk's weights. Stores this n tile's share of <dS, S0> (the gradient of the chunk's carry factor) and returns
    the chunk's dt, Pm = decay o (dy . x) [t, s], win, wend, x^T dS and dy^T S0."""
    bh = b * H + h
    offs_t, mask_t, dt, cs, cs_end = _chunk_decay(dt_ptr, A_ptr, b, h, c, L, H, Q)
    x_base = (b * L * H + h) * P
    s_base = (bh * NC + c) * (P + NORM) * N
    accDYX = tl.zeros([Q, Q], dtype=tl.float32)  # [t, s] = dy_t . x_s
    accXS = tl.zeros([Q, BN], dtype=tl.float32)  # x_s^T dS
    accDYS = tl.zeros([Q, BN], dtype=tl.float32)  # dy_t^T S0
    dg = tl.zeros([BP, BN], dtype=tl.float32)  # <dS, S0>, summed over the p steps elementwise (reduced once)
    for p0 in range(0, P, BP):
        offs_p = p0 + tl.arange(0, BP)
        mask_p = offs_p < P
        xo = offs_t[:, None] * (H * P) + offs_p[None, :]
        xm = mask_t[:, None] & mask_p[None, :]
        x = tl.load(x_ptr + x_base + xo, mask=xm, other=0.0)
        dy = tl.load(dy_ptr + x_base + xo, mask=xm, other=0.0)
        accDYX += tl.dot(dy.to(IN_DTYPE), tl.trans(x.to(IN_DTYPE)), input_precision=PREC)
        so = offs_p[:, None] * N + offs_n[None, :]
        sm = mask_p[:, None] & mask_n[None, :]
        dS = _load_st_tile(dst_ptr, s_base, so, sm, de_ptr, offs_p, mask_p, nb * BN, offs_n, N, GSD, BN, 0)
        accXS = _xdot(x, dS, accXS, SPREC, "a")
        S0 = _load_st_tile(st_ptr, s_base, so, sm, se_ptr, offs_p, mask_p, nb * BN, offs_n, N, GSS, BN, 0)
        dg += dS.to(tl.float32) * S0.to(tl.float32)
        if DY_EXACT:
            accDYS = _xdot(dy, S0, accDYS, SPREC, "a")
        else:
            accDYS = _xdot(dy, S0, accDYS, SPREC, "none")
    dgs = tl.sum(tl.sum(dg, axis=1), axis=0)
    if DY_SCALE:  # the numerator's gradient is dy / den (rows t)
        rden = 1.0 / tl.load(den_ptr + (b * L * H + h) + offs_t * H, mask=mask_t, other=1.0)
        accDYX = accDYX * rden[:, None]
        accDYS = accDYS * rden[:, None]
    if NORM:  # the normaliser column: x = 1, dy = dden, state row P
        dr = tl.load(dden_ptr + (b * L * H + h) + offs_t * H, mask=mask_t, other=0.0)
        ones = tl.where(mask_t, 1.0, 0.0)
        dSr = _load_st_row(dst_ptr, s_base, offs_n, mask_n, de_ptr, nb * BN, P, N, GSD, BN)
        S0r = _load_st_row(st_ptr, s_base, offs_n, mask_n, se_ptr, nb * BN, P, N, GSS, BN)
        accDYX += dr[:, None] * ones[None, :]
        accXS += ones[:, None] * dSr[None, :]
        accDYS += dr[:, None] * S0r[None, :]
        dgs += tl.sum(dSr * S0r, axis=0)
    tl.store(dg_ptr + (bh * NNB + nb) * NC + c, dgs)
    decay, win, wend = _chunk_weights(doc_ptr, b, c, L, offs_t, mask_t, cs, cs_end, Q, HAS_DOC)
    return dt, decay * accDYX, win, wend, accXS, accDYS


@triton.jit
def _chunk_bwd_dbc(x_ptr, dy_ptr, dden_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, doc_ptr, st_ptr, dst_ptr, se_ptr, de_ptr,
                   dB_ptr, dC_ptr, ddt_ptr, dcs_ptr, den_ptr, dg_ptr,
                   L, H, G, P, N, NC, NNB,
                   Q: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
                   HAS_DOC: tl.constexpr, PREC: tl.constexpr, SPREC: tl.constexpr,
                   IN_DTYPE: tl.constexpr, DCS: tl.constexpr = True, NORM: tl.constexpr = 0,
                   DY_EXACT: tl.constexpr = True, DY_SCALE: tl.constexpr = False, TILE_MAJOR: tl.constexpr = False,
                   ONE_HEAD: tl.constexpr = False, GSS: tl.constexpr = 0, GSD: tl.constexpr = 0):
    """dB, dC (and with DCS the decay-gradient partials), and per (batch*head, n tile, chunk) the partial <dS, S0>
    at ``dg_ptr`` (the gradient of the chunk's carry factor: dB/dC reads both states anyway).
    TILE_MAJOR: grid (chunks x n tiles, batch*group), the n tiles of a chunk launched together (they read the same
    x, dy tiles); else (chunks, batch*group, n tiles).
    ONE_HEAD (one head per B/C group, as in HedgeMamba; not with DCS): no running sum over heads, B and C loaded
    after the sums over P, and the state terms used as the dots' accumulators: fewer live (Q x BN) tiles."""
    if TILE_MAJOR:
        c = tl.program_id(0) // NNB
        nb = tl.program_id(0) % NNB
    else:
        c = tl.program_id(0)
        nb = tl.program_id(2)
    _dbc_body(x_ptr, dy_ptr, dden_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, doc_ptr, st_ptr, dst_ptr, se_ptr, de_ptr,
              dB_ptr, dC_ptr, ddt_ptr, dcs_ptr, den_ptr, dg_ptr, c, nb, tl.program_id(1).to(tl.int64), L, H, G, P, N,
              NC, NNB, Q, BP, BN, HAS_DOC, PREC, SPREC, IN_DTYPE, DCS, NORM, DY_EXACT, DY_SCALE, ONE_HEAD, GSS, GSD)


@triton.jit
def _dbc_body(x_ptr, dy_ptr, dden_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, doc_ptr, st_ptr, dst_ptr, se_ptr, de_ptr,
              dB_ptr, dC_ptr, ddt_ptr, dcs_ptr, den_ptr, dg_ptr, c, nb, bg, L, H, G, P, N, NC, NNB,
              Q: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, HAS_DOC: tl.constexpr, PREC: tl.constexpr,
              SPREC: tl.constexpr, IN_DTYPE: tl.constexpr, DCS: tl.constexpr, NORM: tl.constexpr,
              DY_EXACT: tl.constexpr, DY_SCALE: tl.constexpr, ONE_HEAD: tl.constexpr, GSS: tl.constexpr = 0,
              GSD: tl.constexpr = 0):
    """One (chunk ``c``, n tile ``nb``, batch*group ``bg``) program of ``_chunk_bwd_dbc`` (also run by
    ``_chunk_bwd_pair``)."""
    b = bg // G
    grp = bg % G
    HPG = H // G
    offs_n = nb * BN + tl.arange(0, BN)
    mask_n = offs_n < N
    offs_tt = c * Q + tl.arange(0, Q)
    mask_tt = offs_tt < L
    bc_base = (b * L * G + grp) * N
    bc_off = offs_tt[:, None] * (G * N) + offs_n[None, :]
    bc_mask = mask_tt[:, None] & mask_n[None, :]
    if ONE_HEAD:
        dt, Pm, win, wend, accXS, accDYS = _dbc_head(x_ptr, dy_ptr, dden_ptr, dt_ptr, A_ptr, doc_ptr, st_ptr, dst_ptr,
                                                     se_ptr, de_ptr, den_ptr, dg_ptr, b, grp, c, nb, L, H, P, N, NC,
                                                     NNB, offs_n, mask_n, Q, BP, BN, HAS_DOC, PREC, SPREC, IN_DTYPE,
                                                     NORM, DY_EXACT, DY_SCALE, GSS, GSD)
        Bt = tl.load(B_ptr + bc_base + bc_off, mask=bc_mask, other=0.0)
        Ct = tl.load(C_ptr + bc_base + bc_off, mask=bc_mask, other=0.0)  # both loads in flight at once
        dC = tl.dot((Pm * dt[None, :]).to(IN_DTYPE), Bt.to(IN_DTYPE), win[:, None] * accDYS, input_precision=PREC)
        tl.store(dC_ptr + bc_base + bc_off, dC.to(dC_ptr.dtype.element_ty), mask=bc_mask)
        dB = tl.dot(tl.trans(Pm).to(IN_DTYPE), Ct.to(IN_DTYPE), wend[:, None] * accXS, input_precision=PREC)
        tl.store(dB_ptr + bc_base + bc_off, (dt[:, None] * dB).to(dB_ptr.dtype.element_ty), mask=bc_mask)
        return
    Bt = tl.load(B_ptr + bc_base + bc_off, mask=bc_mask, other=0.0)
    Ct = tl.load(C_ptr + bc_base + bc_off, mask=bc_mask, other=0.0)
    if DCS:
        Gnb = tl.dot(Ct, tl.trans(Bt), input_precision=PREC)  # [t, s], partial over this n tile
    dB = tl.zeros([Q, BN], dtype=tl.float32)
    dC = tl.zeros([Q, BN], dtype=tl.float32)
    tt = tl.arange(0, Q)
    for hh in range(HPG):
        h = grp * HPG + hh
        dt, Pm, win, wend, accXS, accDYS = _dbc_head(x_ptr, dy_ptr, dden_ptr, dt_ptr, A_ptr, doc_ptr, st_ptr, dst_ptr,
                                                     se_ptr, de_ptr, den_ptr, dg_ptr, b, h, c, nb, L, H, P, N, NC,
                                                     NNB, offs_n, mask_n, Q, BP, BN, HAS_DOC, PREC, SPREC, IN_DTYPE,
                                                     NORM, DY_EXACT, DY_SCALE, GSS, GSD)
        dC += tl.dot((Pm * dt[None, :]).to(IN_DTYPE), Bt.to(IN_DTYPE), input_precision=PREC) + win[:, None] * accDYS
        dB += dt[:, None] * (tl.dot(tl.trans(Pm).to(IN_DTYPE), Ct.to(IN_DTYPE), input_precision=PREC)
                             + wend[:, None] * accXS)
        if DCS:  # partial (over this n tile) direct dt gradient and d cs; v2 does these in the dx kernel
            PG = Pm * Gnb
            colPG = tl.sum(PG, axis=0)  # per s
            rowPGdt = tl.sum(PG * dt[None, :], axis=1)  # per t
            v = tl.sum(Ct.to(tl.float32) * accDYS, axis=1) * win
            u = tl.sum(Bt.to(tl.float32) * accXS, axis=1)
            ddt_direct = colPG + wend * u
            endterm = wend * dt * u
            dcs = rowPGdt - colPG * dt + v - endterm
            dcs = tl.where(tt == Q - 1, dcs + tl.sum(endterm, axis=0), dcs)
            po = ((b * H + h) * NNB + nb) * (NC * Q) + c * Q + tt
            tl.store(ddt_ptr + po, ddt_direct)
            tl.store(dcs_ptr + po, dcs)
    tl.store(dB_ptr + bc_base + bc_off, dB.to(dB_ptr.dtype.element_ty), mask=bc_mask)
    tl.store(dC_ptr + bc_base + bc_off, dC.to(dC_ptr.dtype.element_ty), mask=bc_mask)


@triton.jit
def _chunk_bwd_pair(x_ptr, dy_ptr, dden_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, doc_ptr, st_ptr, dst_ptr, se_ptr, de_ptr,
                    dx_ptr, dB_ptr, dC_ptr, ddt_ptr, dcs_ptr, dg_ptr, dyo_ptr, D_ptr, dD_ptr, den_ptr, ys_ptr,
                    L, H, P, N, NC, NPB, NNB,
                    Q: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, BPD: tl.constexpr, BND: tl.constexpr,
                    HAS_DOC: tl.constexpr, PREC: tl.constexpr, XPREC: tl.constexpr, SPREC: tl.constexpr,
                    IN_DTYPE: tl.constexpr, DY_EXACT: tl.constexpr, NORM: tl.constexpr, HAS_D: tl.constexpr,
                    DY_SCALE: tl.constexpr, Y_SAVED: tl.constexpr, GSS: tl.constexpr = 0, GSD: tl.constexpr = 0):
    """``_chunk_bwd_dbc`` (one head per group) and ``_chunk_bwd_dx_dcs`` in one launch, their programs interleaved by
    chunk: grid (chunks x (NNB + NPB), batch*head); program k of chunk c is dB/dC's n tile k for k < NNB, else dx's
    p tile k - NNB. The NNB + NPB programs of a chunk run at about the same time and read the same dS, x, dy, B and
    C tiles, so the second reader of each finds it in L2 instead of HBM (the two launches apart read dS, x, dy, B, C
    twice from HBM). BP, BN: dx's tiles; BPD, BND: dB/dC's."""
    per = NNB + NPB
    c = tl.program_id(0) // per
    k = tl.program_id(0) % per
    bh = tl.program_id(1).to(tl.int64)
    if k < NNB:
        _dbc_body(x_ptr, dy_ptr, dden_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, doc_ptr, st_ptr, dst_ptr, se_ptr, de_ptr,
                  dB_ptr, dC_ptr, ddt_ptr, dcs_ptr, den_ptr, dg_ptr, c, k, bh, L, H, H, P, N, NC, NNB, Q, BPD, BND,
                  HAS_DOC, PREC, SPREC, IN_DTYPE, False, NORM, DY_EXACT, DY_SCALE, True, GSS, GSD)
    else:
        _dx_dcs_body(x_ptr, dy_ptr, dden_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, doc_ptr, st_ptr, dst_ptr, se_ptr, de_ptr,
                     dx_ptr, ddt_ptr, dcs_ptr, dyo_ptr, D_ptr, dD_ptr, den_ptr, ys_ptr, c, k - NNB, bh, L, H, H, P, N,
                     NC, NPB, Q, BP, BN, HAS_DOC, PREC, XPREC, DY_EXACT, NORM, HAS_D, DY_SCALE, Y_SAVED, GSS, GSD)


@triton.jit
def _chunk_bwd_fused(x_ptr, dy_ptr, dden_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, doc_ptr, st_ptr, dst_ptr, se_ptr, de_ptr,
                     dx_ptr, dB_ptr, dC_ptr, ddt_ptr, dcs_ptr, dg_ptr, dyo_ptr, D_ptr, dD_ptr, den_ptr, ys_ptr,
                     L, H, P, N, NC,
                     Q: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
                     HAS_DOC: tl.constexpr, PREC: tl.constexpr, XPREC: tl.constexpr, SPREC: tl.constexpr,
                     IN_DTYPE: tl.constexpr, DY_EXACT: tl.constexpr, NORM: tl.constexpr, HAS_D: tl.constexpr,
                     DY_SCALE: tl.constexpr, GSS: tl.constexpr = 0, GSD: tl.constexpr = 0):
    """``_chunk_bwd_dx_dcs`` (with the saved numerator) and the one-head ``_chunk_bwd_dbc`` in one program per
    (chunk, batch*head), for one head per B/C group and all of P in one tile (BP >= P): each (P x BN) tile of
    the leaving state's gradient dS and of the entering state S0 is read once and serves dx's B dS^T, dB's x dS,
    dC's dy S0 and the carry gradient <dS, S0>; dy . x^T (over P) and B . C^T (over N) are formed once per chunk.
    dB and dC are written per n tile inside the loop; dx, the decay-gradient sums and <dS, S0> after it.
    Same arguments and precisions as the two kernels it replaces (XPREC: the dots feeding the decay gradient;
    SPREC: dB/dC's state dots)."""
    c = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    offs_t, mask_t, dt, cs, cs_end = _chunk_decay(dt_ptr, A_ptr, b, h, c, L, H, Q)
    offs_p = tl.arange(0, BP)
    mask_p = offs_p < P
    xo = (b * L * H + h) * P
    xt = offs_t[:, None] * (H * P) + offs_p[None, :]
    xm = mask_t[:, None] & mask_p[None, :]
    x = tl.load(x_ptr + xo + xt, mask=xm, other=0.0)
    dy = tl.load(dy_ptr + xo + xt, mask=xm, other=0.0)
    decay, win, wend = _chunk_weights(doc_ptr, b, c, L, offs_t, mask_t, cs, cs_end, Q, HAS_DOC)  # [t, s]
    accDYX = tl.dot(dy.to(IN_DTYPE), tl.trans(x.to(IN_DTYPE)), input_precision=PREC)  # [t, s] = dy_t . x_s
    if DY_SCALE:  # the numerator's gradient is dy / den (rows t)
        rden = 1.0 / tl.load(den_ptr + (b * L * H + h) + offs_t * H, mask=mask_t, other=1.0)
        accDYX = accDYX * rden[:, None]
    if NORM:  # the normaliser column: x = 1, dy = dden, state row P
        dr = tl.load(dden_ptr + (b * L * H + h) + offs_t * H, mask=mask_t, other=0.0)
        ones = tl.where(mask_t, 1.0, 0.0)
        accDYX += dr[:, None] * ones[None, :]
    Pm = decay * accDYX
    PmC = (Pm * dt[None, :]).to(IN_DTYPE)  # dC = (Pm dt) B + win dy S0
    PmT = tl.trans(Pm).to(IN_DTYPE)  # dB = dt (Pm^T C + wend x dS)
    bc_base = (b * L * H + h) * N
    s_base = (bh * NC + c) * (P + NORM) * N
    accGT = tl.zeros([Q, Q], dtype=tl.float32)  # [s, t] = B_s . C_t
    accZ = tl.zeros([Q, BP], dtype=tl.float32)  # [s, p] = (dS B_s)_p
    accZr = tl.zeros([Q], dtype=tl.float32)  # normaliser row: dS[P] . B_s
    dgv = tl.zeros([BN], dtype=tl.float32)  # <dS, S0>, summed over p per n tile
    dgr = 0.0
    for n0 in range(0, N, BN):
        offs_n = n0 + tl.arange(0, BN)
        mask_n = offs_n < N
        bc_off = offs_t[:, None] * (H * N) + offs_n[None, :]
        bc_mask = mask_t[:, None] & mask_n[None, :]
        Bt = tl.load(B_ptr + bc_base + bc_off, mask=bc_mask, other=0.0)
        Ct = tl.load(C_ptr + bc_base + bc_off, mask=bc_mask, other=0.0)
        accGT += tl.dot(Bt, tl.trans(Ct), input_precision=PREC)
        so = offs_p[:, None] * N + offs_n[None, :]
        sm = mask_p[:, None] & mask_n[None, :]
        dS = _load_st_tile(dst_ptr, s_base, so, sm, de_ptr, offs_p, mask_p, n0, offs_n, N, GSD, BN, 0)  # (BP, BN)
        S0 = _load_st_tile(st_ptr, s_base, so, sm, se_ptr, offs_p, mask_p, n0, offs_n, N, GSS, BN, 0)
        accZ = _xdot(Bt, tl.trans(dS), accZ, XPREC, "a")
        dgv += tl.sum(dS.to(tl.float32) * S0.to(tl.float32), axis=0)
        # x and dy are read again per n tile (L1 / L2 hits) rather than held across the loop: registers
        xl = tl.load(x_ptr + xo + xt, mask=xm, other=0.0)
        accXS = _xdot(xl, dS, tl.zeros([Q, BN], dtype=tl.float32), SPREC, "a")  # [s, n] = x_s^T dS
        dyl = tl.load(dy_ptr + xo + xt, mask=xm, other=0.0)
        if DY_EXACT:
            accDYS = _xdot(dyl, S0, tl.zeros([Q, BN], dtype=tl.float32), SPREC, "a")  # [t, n] = dy_t^T S0
        else:
            accDYS = _xdot(dyl, S0, tl.zeros([Q, BN], dtype=tl.float32), SPREC, "none")
        if DY_SCALE:
            accDYS = accDYS * rden[:, None]
        if NORM:
            dSr = _load_st_row(dst_ptr, s_base, offs_n, mask_n, de_ptr, n0, P, N, GSD, BN)
            S0r = _load_st_row(st_ptr, s_base, offs_n, mask_n, se_ptr, n0, P, N, GSS, BN)
            accZr += tl.sum(Bt.to(tl.float32) * dSr[None, :], axis=1)
            accXS += ones[:, None] * dSr[None, :]
            accDYS += dr[:, None] * S0r[None, :]
            dgr += tl.sum(dSr * S0r, axis=0)
        dC = tl.dot(PmC, Bt.to(IN_DTYPE), win[:, None] * accDYS, input_precision=PREC)
        tl.store(dC_ptr + bc_base + bc_off, dC.to(dC_ptr.dtype.element_ty), mask=bc_mask)
        dB = tl.dot(PmT, Ct.to(IN_DTYPE), wend[:, None] * accXS, input_precision=PREC)
        tl.store(dB_ptr + bc_base + bc_off, (dt[:, None] * dB).to(dB_ptr.dtype.element_ty), mask=bc_mask)
    tl.store(dg_ptr + bh * NC + c, tl.sum(dgv, axis=0) + dgr)
    # dx and the decay-gradient sums, as in _chunk_bwd_dx_dcs with Y_SAVED and one p tile
    tt = tl.arange(0, Q)
    keep = tt[:, None] <= tt[None, :]  # s <= t
    if HAS_DOC:
        doc, doc_end, doc_prev = _chunk_docs(doc_ptr, b, c, L, offs_t, mask_t, Q)
        keep = keep & (doc[:, None] == doc[None, :])
    MT = accGT * tl.exp(tl.where(keep, cs[None, :] - cs[:, None], float("-inf")))  # [s, t]
    dy = tl.load(dy_ptr + xo + xt, mask=xm, other=0.0)
    x = tl.load(x_ptr + xo + xt, mask=xm, other=0.0)
    if not DY_SCALE:
        rden = dt  # unused
    stuff, xf = _dx_tile(MT, dy, x, accZ, dt, wend, rden, dyo_ptr, D_ptr, dD_ptr, dx_ptr, xo, xt, xm, h, P, offs_p,
                         mask_p, bh, c, NC, XPREC, DY_EXACT, DY_SCALE, HAS_D)
    y = tl.load(ys_ptr + xo + xt, mask=xm, other=0.0)
    ddt_direct = tl.sum(xf * stuff, axis=1)
    u = tl.sum(xf * accZ, axis=1)
    dyy = tl.sum(dy.to(tl.float32) * y, axis=1)
    if DY_SCALE:
        dyy = dyy * rden
    if NORM:
        stuff_r = tl.sum(MT * dr[None, :], axis=1) + wend * accZr
        y_r = tl.load(den_ptr + (b * L * H + h) + offs_t * H, mask=mask_t, other=0.0)
        ddt_direct += stuff_r
        u += accZr
        dyy += dr * y_r
    _dcs_store(ddt_direct, u, dyy, dt, wend, tt, ddt_ptr, dcs_ptr, bh * (NC * Q) + c * Q + tt, Q)


@triton.jit
def _finish_bwd(dcs_ptr, ddtp_ptr, dg_ptr, gdec_ptr, dt_ptr, A_ptr, ddt_ptr, dAp_ptr, L, H, NC, NPART, NBLK,
                Q: tl.constexpr, BB: tl.constexpr):
    """Per chunk: sum the tile partials of d cs and of the direct dt gradient, add the carry factor's gradient
    (sum over dB/dC's n tiles of <dS, S_prev>, times g) to the chunk's last position, reverse cumulative sum
    (d cs -> d a, a = dt A), then ddt = direct + A d a (stored heads-major, (b, h, l)) and the chunk's partial of
    dA = sum d a dt."""
    c = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    h = bh % H
    tt = tl.arange(0, Q)
    dcs = tl.zeros([Q], dtype=tl.float32)
    ddt = tl.zeros([Q], dtype=tl.float32)
    for i in range(NPART):
        off = (bh * NPART + i) * (NC * Q) + c * Q + tt
        dcs += tl.load(dcs_ptr + off)
        ddt += tl.load(ddtp_ptr + off)
    bb = tl.arange(0, BB)
    dg = tl.sum(tl.load(dg_ptr + (bh * NBLK + bb) * NC + c, mask=bb < NBLK, other=0.0), axis=0)
    dcs = tl.where(tt == Q - 1, dcs + dg * tl.load(gdec_ptr + bh * NC + c), dcs)
    da = tl.cumsum(dcs, axis=0, reverse=True)
    offs_t = c * Q + tt
    mask = offs_t < L
    dtv = tl.load(dt_ptr + bh * L + offs_t, mask=mask, other=0.0)  # dt and ddt heads-major, (b, h, l)
    tl.store(ddt_ptr + bh * L + offs_t, ddt + tl.load(A_ptr + h) * da, mask=mask)
    tl.store(dAp_ptr + bh * NC + c, tl.sum(tl.where(mask, da * dtv, 0.0), axis=0))


def tile_major(kernel: str, tiles: int) -> bool:
    """Launch order of the v2 backward's two big kernels (``kernel`` "dx" or "dbc", ``tiles`` p or n tiles per
    chunk). ``HMSCALE_SSD_TILE_ORDER``: ``tile`` launches the tiles of one chunk next to each other (they read the
    same B, C or x, dy tiles: L2 hits), ``chunk`` the chunks of one tile; ``auto`` (default): tile order for dx
    always, for dB/dC from 4 n tiles on (H200 sweep, 2026-12-02: dx -5 to -10 %; dB/dC -2 to -4 % at 4 n tiles,
    +2 to +4 % at 2)."""
    v = env("HMSCALE_SSD_TILE_ORDER", "auto").lower()
    if v not in ("tile", "chunk", "auto"):
        raise ValueError(f"HMSCALE_SSD_TILE_ORDER must be auto, tile or chunk, got {v!r}")
    if v == "auto":
        return kernel == "dx" or tiles >= 4
    return v == "tile"


def dbc_one_head() -> bool:
    """``HMSCALE_SSD_DBC_ONE_HEAD=1|0``: with one head per B/C group, the dB/dC kernel's one-head form (default 1;
    0 keeps the general form with its running sum over the group's heads, for comparisons)."""
    v = env("HMSCALE_SSD_DBC_ONE_HEAD", "1")
    if v not in ("0", "1"):
        raise ValueError(f"HMSCALE_SSD_DBC_ONE_HEAD must be 0 or 1, got {v!r}")
    return v == "1"


def dbc_config(n: int, dtype: torch.dtype = torch.bfloat16, Q: int = 64):
    """(BP, BN, num_stages, num_warps) of ``_chunk_bwd_dbc``, the backward's slowest kernel.

    Defaults measured on the H200 (see kernels/NOTES.md): v2 (32, min(64, N), 3, 4) since the kernel also sums the
    carry factor's gradient (16-row p steps were the best before; 3 stages beat 2 by 17-25% with the bf16 split);
    v1 (16, min(64, N), 1, 8), its spill-free choice.
    ``HMSCALE_SSD_DBC_CFG="BP,BN,stages,warps"`` overrides it, for tuning runs only (powers of two, >= 16).
    Chunks of 128 with 16-bit inputs: (16, min(32, N), 3, 8), the tiling that compiles without register spills
    for sm_90 (benchmarks/ssd_registers.py).
    """
    cfg = env("HMSCALE_SSD_DBC_CFG")
    if cfg:
        bp, bn, st, nw = (int(v) for v in cfg.split(","))
        return bp, min(bn, _pow2(n)), st, nw
    if bwd_variant() == "v2":  # without the decay-gradient terms the kernel pipelines
        if Q >= 128 and dtype != torch.float32:
            return 16, min(32, _pow2(n)), 3, 8
        return 32, min(64, _pow2(n)), 3, 4
    return 16, min(64, _pow2(n)), 1, 8


def bwd_fuse_mode() -> str:
    """``HMSCALE_SSD_BWD_FUSE=auto|1|0``: dx and dB/dC as one kernel (``_chunk_bwd_fused``). It needs the v2
    backward, one head per B/C group, the saved numerator, 16-bit inputs and chunks of at most 64. ``auto``
    (default): where the H200 sweep found it faster, P <= 64 without the normaliser (410m L=2048: 323 us against
    381 for the two kernels; with the normaliser 497 against 475; at P = 128 it spills registers and takes 1.3-2.5
    ms against 0.93: benchmarks/results/sweep_fused_bwd_2026-12-02.md); ``1``: wherever it applies (P <= 128);
    ``0``: never."""
    v = env("HMSCALE_SSD_BWD_FUSE", "auto").lower()
    if v not in ("auto", "1", "0"):
        raise ValueError(f"HMSCALE_SSD_BWD_FUSE must be auto, 1 or 0, got {v!r}")
    return v


def bwd_pair_mode() -> str:
    """``HMSCALE_SSD_BWD_PAIR=auto|1|0``: dB/dC and dx in one launch, their programs interleaved by chunk
    (``_chunk_bwd_pair``), where they would otherwise be two launches of the v2 backward with one head per B/C group.
    ``auto`` (default): bf16 inputs, heads of 64+ channels (H200, 2026-12-04, dx + dB/dC: 1.4b 838 -> 733 us at
    L=2048, 864 -> 746 at L=16384; the 410m / 160m training calls 450 -> 410, 342 -> 307); ``1``: wherever it
    applies; ``0``: never. Without the normaliser, heads of up to 64 channels take ``_chunk_bwd_fused`` instead."""
    v = env("HMSCALE_SSD_BWD_PAIR", "auto").lower()
    if v not in ("auto", "1", "0"):
        raise ValueError(f"HMSCALE_SSD_BWD_PAIR must be auto, 1 or 0, got {v!r}")
    return v


def use_bwd_pair(p: int, one_head: bool, dtype: torch.dtype) -> bool:
    """Whether this v2 backward launches dB/dC and dx as one interleaved grid (see ``bwd_pair_mode``)."""
    mode = bwd_pair_mode()
    if mode == "0" or not one_head:
        return False
    return mode == "1" or (dtype == torch.bfloat16 and _pow2(p) >= 64)


def use_fused_bwd(g: int, h: int, p: int, dtype: torch.dtype, Q: int, saved_y: bool, norm: bool) -> bool:
    """Whether this backward runs dx and dB/dC as one kernel (see ``bwd_fuse_mode``)."""
    mode = bwd_fuse_mode()
    if mode == "0" or bwd_variant() != "v2":
        return False
    if not (g == h and saved_y and dtype != torch.float32 and Q <= 64 and _pow2(p) <= 128):
        return False
    return mode == "1" or (_pow2(p) <= 64 and not norm)


def fused_bwd_config(p: int, n: int, dtype: torch.dtype):
    """(BN, num_warps, num_stages) of ``_chunk_bwd_fused``: the (P x BN) state tiles of the n loop; ``kcfg("fbwd")``,
    (32, 4, 2) by default, the fastest in the H200 sweep at P = 64."""
    bn, nw, st = kcfg("fbwd", dtype)
    return min(bn, _pow2(n)), nw, st


_TL_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


class BwdPlan(NamedTuple):
    """What one backward launches, from its shapes, options and the switches (``bwd_plan``)."""
    dst_dtype: torch.dtype
    gsd: int  # scale group of the stored state gradients (scaled fp16), 0 otherwise
    fused_walk: bool  # one walk launch (_dstate_fused_bwd) instead of _chunk_dstate_bwd + _state_pass_bwd
    grid_dstate: tuple
    dstate_kw: dict
    grid_pass: tuple
    pass_kw: dict
    kind: str  # dx and dB/dC as: "fused" (_chunk_bwd_fused), "pair", "two" (v2: dx_dcs then dbc), "v1"
    nnb: int  # n tiles of dB/dC (1 for "fused")
    npb: int  # p tiles of dx
    grid_dx: tuple
    dx_kw: dict
    grid_dbc: tuple
    dbc_kw: dict


@switch_cached
def bwd_plan(b: int, h: int, g: int, p: int, n: int, dtype: torch.dtype, dy_dtype: torch.dtype, Q: int, nc: int,
             norm: bool, has_d: bool, has_doc: bool, has_dfinal: bool, need_dinit: bool, dy_scale: bool,
             y_saved: bool, gss: int, dev: torch.device, sms) -> BwdPlan:
    """The launch plan of one backward call (``sms``: the multiprocessor count, part of the key; ``gss``: the
    forward states' scale group). Memoised with the switches' values, like ``fwd_plan``."""
    v2 = bwd_variant() == "v2"
    prec, sprec = precisions(dtype)
    # dtype of the dots that involve dy: the input dtype, except when dy is fp32 for 16-bit inputs
    # (normalize: the normaliser's gradient can exceed the fp16 range): then fp32 operands, tf32 dots
    if dy_dtype == torch.float32 and dtype != torch.float32:
        in_dtype, prec = tl.float32, "tf32"
    else:
        in_dtype = _TL_DTYPE[dtype]
    dy_exact = dy_dtype == dtype
    dst_dtype, gsd, walk = state_layout(b, h, p, n, dtype, dev, Q, grad=True)
    xprec = state_precision(dtype)
    common = dict(Q=Q, HAS_DOC=has_doc, PREC=xprec, NORM=int(norm))
    ps = p + int(norm)
    if walk is not None:
        BP, BN, nw, nst = walk
        grid_dstate = (b * h, cdiv(p, BP) * cdiv(n, BN))
        dstate_kw = dict(common, BP=BP, BN=BN, HAS_DFINAL=has_dfinal, HAS_DINIT=need_dinit, DY_SCALE=dy_scale,
                         UNROLL=walk_unroll(dtype), GS=gsd, num_warps=nw, num_stages=nst,
                         **register_cap("fpass_b", dtype, Q))
        grid_pass, pass_kw = (), {}
    else:
        BP, BN, nw = block_sizes(p, n, dtype, "dstate", Q)
        grid_dstate = (nc, b * h, cdiv(p, BP) * cdiv(n, BN))
        dstate_kw = dict(common, BP=BP, BN=BN, DY_SCALE=dy_scale, num_warps=nw, **register_cap("dstate", dtype, Q))
        BLOCK, nwp = pass_config(ps * n, dtype, "pass_b")
        grid_pass = (b * h, cdiv(ps * n, BLOCK))
        pass_kw = dict(HAS_DFINAL=has_dfinal, HAS_DINIT=need_dinit, BLOCK=BLOCK, GS=gsd, num_warps=nwp)
    head = (dst_dtype, gsd, walk is not None, grid_dstate, dstate_kw, grid_pass, pass_kw)
    flags = dict(NORM=int(norm), HAS_D=has_d, DY_SCALE=dy_scale)
    if use_fused_bwd(g, h, p, dtype, Q, y_saved, norm):
        BNf, nwf, stf = fused_bwd_config(p, n, dtype)
        kw = dict(Q=Q, BP=_pow2(p), BN=reader_bn(BNf, gss, gsd), HAS_DOC=has_doc, PREC=prec, XPREC=xprec,
                  SPREC=dbc_state_precision(dtype), IN_DTYPE=in_dtype, DY_EXACT=dy_exact, **flags, GSS=gss, GSD=gsd,
                  num_warps=nwf, num_stages=stf, **register_cap("fbwd", dtype, Q))
        return BwdPlan(*head, "fused", 1, 1, (nc, b * h), kw, (), {})
    BP_dbc, BN_dbc, stages_dbc, warps_dbc = dbc_config(n, dtype, Q)
    BN_dbc = reader_bn(BN_dbc, gss, gsd)
    nnb = cdiv(n, BN_dbc)
    dbc_kw = dict(Q=Q, BP=BP_dbc, BN=BN_dbc, HAS_DOC=has_doc, PREC=prec, IN_DTYPE=in_dtype, DY_EXACT=dy_exact,
                  num_warps=warps_dbc, num_stages=stages_dbc)
    if not v2:
        BP, BN_big = min(64, _pow2(p)), min(128 if dtype != torch.float32 else 64, _pow2(n))
        dx_kw = dict(Q=Q, BP=BP, BN=BN_big, HAS_DOC=has_doc, PREC=prec, SPREC=sprec, IN_DTYPE=in_dtype, num_warps=8)
        # the decay gradient (dA, dt) sums terms x^T dS B and dy^T S0 C that largely cancel: their state
        # dots run at about fp32 accuracy (state_precision)
        return BwdPlan(*head, "v1", nnb, nnb, (nc, b * h, cdiv(p, BP)), dx_kw, (nc, b * g, nnb),
                       dict(dbc_kw, SPREC=xprec, DCS=True))
    one_head = g == h and dbc_one_head()
    pair = use_bwd_pair(p, one_head, dtype)
    bp2, bn2, nw2, st2 = kcfg("pair", dtype, Q, p) if pair else kcfg("dx", dtype, Q)
    BP2, BN2 = min(bp2, _pow2(p)), reader_bn(min(bn2, _pow2(n)), gss, gsd)
    npb = cdiv(p, BP2)
    extra = dict(num_stages=st2) if st2 else {}
    if pair:
        kw = dict(Q=Q, BP=BP2, BN=BN2, BPD=BP_dbc, BND=BN_dbc, HAS_DOC=has_doc, PREC=prec, XPREC=xprec,
                  SPREC=dbc_state_precision(dtype), IN_DTYPE=in_dtype, DY_EXACT=dy_exact, **flags, Y_SAVED=y_saved,
                  GSS=gss, GSD=gsd, num_warps=nw2, **extra, **register_cap("pair", dtype, Q, p))
        return BwdPlan(*head, "pair", nnb, npb, (nc * (npb + nnb), b * h), kw, (), {})
    tm = tile_major("dx", npb)
    dx_kw = dict(Q=Q, BP=BP2, BN=BN2, HAS_DOC=has_doc, PREC=prec, XPREC=xprec, DY_EXACT=dy_exact, **flags,
                 TILE_MAJOR=tm, Y_SAVED=y_saved, GSS=gss, GSD=gsd, num_warps=nw2, **extra,
                 **register_cap("dx", dtype, Q))
    tmb = tile_major("dbc", nnb)
    dbc_kw = dict(SPREC=dbc_state_precision(dtype), DCS=False, NORM=int(norm), DY_SCALE=dy_scale, TILE_MAJOR=tmb,
                  GSS=gss, GSD=gsd, ONE_HEAD=one_head, **dbc_kw, **(register_cap("dbc", dtype, Q) if one_head else {}))
    return BwdPlan(*head, "two", nnb, npb, (nc * npb, b * h) if tm else (nc, b * h, npb), dx_kw,
                   (nc * nnb, b * g) if tmb else (nc, b * g, nnb), dbc_kw)


def ssd_bwd(dy, dden, dfinal, x, dt, A, B, C, doc, states, gdec, Q: int, need_dinit: bool, D=None, dyo=None,
            dy_den=None, ysaved=None, den=None, sexp=None):
    """Gradients (dx, ddt, dA, dB, dC, dinit, dD); dt and ddt heads-major, (b, h, l). ``states`` holds S_prev per
    chunk (from ssd_fwd), with p + 1 rows when the normaliser is fused (``dden`` the gradient of ``den``, else None;
    v2 only). ``D`` ((h, p) fp32, v2 only): the D skip was fused into the forward; ``dyo`` is then the gradient of
    the final output (``dy`` that of the numerator when normalised, else the same) and dD (h, p) is returned, else
    None. ``dy_den`` (the normaliser ``den``, (b, l, h) fp32; v2 only): ``dy`` is the output's gradient and the
    numerator's is ``dy / den``, applied inside the kernels as a row scale (dy then stays an exact 16-bit operand: no
    fp32 copy, no tf32 dots).
    ``ysaved`` (v2 only): the forward's fp32 numerator y (b, l, h, p), and ``den`` its normaliser when normalised:
    the dx kernel reads them instead of recomputing y from the entering states. ``sexp``: the states' exponents
    from ``ssd_fwd`` (scaled fp16 storage; None or empty otherwise)."""
    b, l, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    nc = states.shape[2]
    norm = states.shape[3] == p + 1
    dy_scale = dy_den is not None
    if (norm or D is not None or dy_scale or ysaved is not None) and bwd_variant() != "v2":
        raise ValueError("the fused normaliser, the D skip, the row-scaled dy (dy_den) and the saved numerator "
                         "(ysaved) need the v2 backward")
    if ysaved is not None and norm and den is None:
        raise ValueError("the saved numerator (ysaved) of a normalised call needs its den")
    dev = x.device
    gss = n // sexp.shape[-1] if sexp is not None and sexp.numel() else 0
    has_d, has_doc, has_dfinal = D is not None, doc is not None, dfinal is not None
    pl = bwd_plan(b, h, g, p, n, x.dtype, dy.dtype, Q, nc, norm, has_d, has_doc, has_dfinal, need_dinit,
                  dy_scale, ysaved is not None, gss, dev, _fwd._sm_count(dev))
    den_arg = dy_den.contiguous() if dy_scale else (den.contiguous() if den is not None else dt)
    doc_arg = doc if has_doc else dt
    dy = dy.contiguous()
    dden = dden.contiguous() if norm else dy
    dst = torch.empty(states.shape, device=dev, dtype=pl.dst_dtype)  # dS leaving each chunk
    dexp = state_exponents(dst, pl.gsd)
    se_arg, de_arg = (sexp if gss else gdec), (dexp if pl.gsd else gdec)
    se_read, de_read = exponent_words(se_arg), exponent_words(de_arg)  # the readers' view (the walks write bytes)
    dinit = torch.empty(b, h, states.shape[3], n, device=dev, dtype=torch.float32) if need_dinit else None
    dfinal_arg = dfinal.contiguous() if has_dfinal else dst
    dinit_arg = dinit if need_dinit else dst
    if pl.fused_walk:
        launch(_dstate_fused_bwd, pl.grid_dstate, dy, dden, dt, A, C, doc_arg, gdec, dst, dfinal_arg, dinit_arg,
               den_arg, de_arg, l, h, g, p, n, nc, **pl.dstate_kw)
    else:
        # the chunks' local state gradients in fp32 (the serial pass sums them), then dS in its storage dtype
        local = dst if dst.dtype == torch.float32 else torch.empty(dst.shape, device=dev, dtype=torch.float32)
        launch(_chunk_dstate_bwd, pl.grid_dstate, dy, dden, dt, A, C, doc_arg, local, den_arg, l, h, g, p, n, nc,
               **pl.dstate_kw)
        launch(_state_pass_bwd, pl.grid_pass, local, dst, gdec, dfinal_arg, dinit_arg, de_arg, nc,
               states.shape[3] * n, **pl.pass_kw)
    dx = torch.empty_like(x)
    dB = torch.empty_like(B)
    dC = torch.empty_like(C)
    nnb, npb = pl.nnb, pl.npb
    dg, ddt_part, dcs_part, dA_part, dD_part = _partials(b * h, nnb, npb, nc, Q, p if has_d else 0, dev)
    dyo_arg = dyo.contiguous() if has_d else dy
    D_arg, dD_arg = (D, dD_part) if has_d else (dt, dt)
    if pl.kind == "fused":
        launch(_chunk_bwd_fused, pl.grid_dx, x, dy, dden, dt, A, B, C, doc_arg, states, dst, se_read, de_read,
               dx, dB, dC, ddt_part, dcs_part, dg, dyo_arg, D_arg, dD_arg, den_arg, ysaved, l, h, p, n, nc,
               **pl.dx_kw)
    elif pl.kind == "pair":
        launch(_chunk_bwd_pair, pl.grid_dx, x, dy, dden, dt, A, B, C, doc_arg, states, dst, se_read, de_read, dx,
               dB, dC, ddt_part, dcs_part, dg, dyo_arg, D_arg, dD_arg, den_arg,
               ysaved if ysaved is not None else dt, l, h, p, n, nc, npb, nnb, **pl.dx_kw)
    elif pl.kind == "two":
        launch(_chunk_bwd_dx_dcs, pl.grid_dx, x, dy, dden, dt, A, B, C, doc_arg, states, dst, se_read, de_read, dx,
               ddt_part, dcs_part, dyo_arg, D_arg, dD_arg, den_arg, ysaved if ysaved is not None else dt,
               l, h, g, p, n, nc, npb, **pl.dx_kw)
        launch(_chunk_bwd_dbc, pl.grid_dbc, x, dy, dden, dt, A, B, C, doc_arg, states, dst, se_read, de_read, dB, dC,
               ddt_part, dcs_part, den_arg, dg, l, h, g, p, n, nc, nnb, **pl.dbc_kw)
    else:  # v1
        launch(_chunk_bwd_dx, pl.grid_dx, dy, dt, A, B, C, doc_arg, dst, dx, l, h, g, p, n, nc, **pl.dx_kw)
        launch(_chunk_bwd_dbc, pl.grid_dbc, x, dy, dy, dt, A, B, C, doc_arg, states, dst, se_read, de_read,
               dB, dC, ddt_part, dcs_part, dt, dg, l, h, g, p, n, nc, nnb, **pl.dbc_kw)
    ddt, dA, dD = _finish(dcs_part, ddt_part, dg, gdec, dt, A, dD_part, dA_part, b, l, h, p, nc, nnb, Q, dev)
    return dx, ddt, dA, dB, dC, dinit, dD


def _partials(bh, nnb, npb, nc, Q, p_d, dev):
    """The backward's fp32 partial sums (uninitialised; every element is written by the kernels): <dS, S0> per n
    tile of dB/dC (bh, nnb, nc); the decay-gradient partials per p tile of dx, for dt (ddt) and for the decay's
    cumulative sum (dcs), (bh, npb, nc Q) each; dA's per chunk (bh, nc); dD's per chunk (bh, nc, p_d), or None."""
    f32 = torch.float32
    return (torch.empty(bh, nnb, nc, device=dev, dtype=f32), torch.empty(bh, npb, nc * Q, device=dev, dtype=f32),
            torch.empty(bh, npb, nc * Q, device=dev, dtype=f32), torch.empty(bh, nc, device=dev, dtype=f32),
            torch.empty(bh, nc, p_d, device=dev, dtype=f32) if p_d else None)


def _finish(dcs_part, ddt_part, dg, gdec, dt, A, dD_part, dA_part, b, l, h, p, nc, nnb, Q, dev):
    """d cs -> d a (reverse cumulative sum within each chunk), then dt and A: one launch; dA and dD summed from
    their per-chunk partials (dA_part (b h, nc) is filled here)."""
    ddt = torch.empty(b, h, l, device=dev, dtype=torch.float32)
    launch(_finish_bwd, (nc, b * h), dcs_part, ddt_part, dg, gdec, dt, A, ddt, dA_part, l, h, nc,
           dcs_part.shape[1], nnb,
           Q=Q, BB=_pow2(nnb, 2), num_warps=2)
    dA = dA_part.view(b, h, nc).sum((0, 2))
    dD = dD_part.view(b, h, nc, p).sum((0, 2)) if dD_part is not None else None
    return ddt, dA, dD
