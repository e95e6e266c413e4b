"""Triton backward of the chunked SSD.

Notation per chunk (Q tokens, positions t >= s): cs the within-chunk cumulative log-decay,
``decay_ts = exp(cs_t - cs_s)`` (zero across documents), ``win_t = exp(cs_t)`` (zero once a new document
started in the chunk), ``wend_s = exp(cs_end - cs_s)`` (zero unless s is in the chunk's last document),
``S0`` the state entering the chunk, ``dS`` the gradient of the state leaving it.

Four launches:

1. ``_chunk_dstate_bwd`` (parallel): ``dlocal_c = sum_t win_t dy_t C_t^T``.
2. ``_state_pass_bwd`` (sequential over chunks, reversed): ``dS_prev = g_c dS + dlocal_c``; overwrites
   the buffer with the gradient leaving each chunk, writes d initial_state and, per state tile,
   the partial dot <dS, S_prev> that is the gradient of the carry factor g_c.
3. ``_chunk_bwd_dx`` (grid: chunk x batch*head x p tiles): ``dx_s = dt_s [ sum_t (C_t.B_s) decay_ts dy_t
   + wend_s dS B_s ]``.
4. ``_chunk_bwd_dbc`` (grid: chunk x batch*group x n tiles, looping over the group's heads so that
   groups shared by several heads are reduced without atomics): dB, dC, and per head the partial
   (over the n tile) gradients of dt (direct) and of cs.

The caller turns d cs into d(dt A) by a reverse cumulative sum within each chunk.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .ssd_triton_fwd import _chunk_decay, _chunk_docs, _pow2, block_sizes, precisions, state_precision


@triton.jit
def _chunk_dstate_bwd(dy_ptr, dt_ptr, A_ptr, C_ptr, doc_ptr, dst_ptr,
                      L, H, G, P, N, NC,
                      Q: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
                      HAS_DOC: tl.constexpr, PREC: tl.constexpr):
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
    dy = tl.load((dy_ptr + (b * L * H + h) * P) + (offs_t[:, None] * (H * P) + offs_p[None, :]),
                 mask=mask_t[:, None] & mask_p[None, :], other=0.0)
    Ct = tl.load((C_ptr + (b * L * G + grp) * N) + (offs_t[:, None] * (G * N) + offs_n[None, :]),
                 mask=mask_t[:, None] & mask_n[None, :], other=0.0)
    dyw = dy.to(tl.float32) * win[:, None]  # fp32 operands, PREC tf32x3 for 16-bit inputs
    dS = tl.dot(tl.trans(dyw), Ct.to(tl.float32), input_precision=PREC)
    tl.store((dst_ptr + (bh * NC + c) * P * N) + (offs_p[:, None] * N + offs_n[None, :]), dS.to(dst_ptr.dtype.element_ty),
             mask=mask_p[:, None] & mask_n[None, :])


@triton.jit
def _state_pass_bwd(dst_ptr, st_ptr, gdec_ptr, dfinal_ptr, dinit_ptr, dg_ptr, NC, PN, NBLK,
                    HAS_DFINAL: tl.constexpr, HAS_DINIT: tl.constexpr, BLOCK: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < PN
    if HAS_DFINAL:
        dS = tl.load(dfinal_ptr + bh * PN + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        dS = tl.zeros([BLOCK], dtype=tl.float32)
    dbase = dst_ptr + bh * NC * PN + offs
    sbase = st_ptr + bh * NC * PN + offs
    gbase = gdec_ptr + bh * NC
    dgbase = dg_ptr + (bh * NBLK + blk) * NC
    for i0 in range(0, NC, 4):  # four chunks per step, loads first (see _state_pass_fwd)
        c0 = NC - 1 - i0
        c1 = tl.maximum(c0 - 1, 0)
        c2 = tl.maximum(c0 - 2, 0)
        c3 = tl.maximum(c0 - 3, 0)
        d0 = tl.load(dbase + c0 * PN, mask=mask, other=0.0).to(tl.float32)
        d1 = tl.load(dbase + c1 * PN, mask=mask, other=0.0).to(tl.float32)
        d2 = tl.load(dbase + c2 * PN, mask=mask, other=0.0).to(tl.float32)
        d3 = tl.load(dbase + c3 * PN, mask=mask, other=0.0).to(tl.float32)
        s0 = tl.load(sbase + c0 * PN, mask=mask, other=0.0).to(tl.float32)
        s1 = tl.load(sbase + c1 * PN, mask=mask, other=0.0).to(tl.float32)
        s2 = tl.load(sbase + c2 * PN, mask=mask, other=0.0).to(tl.float32)
        s3 = tl.load(sbase + c3 * PN, mask=mask, other=0.0).to(tl.float32)
        g0 = tl.load(gbase + c0)
        g1 = tl.load(gbase + c1)
        g2 = tl.load(gbase + c2)
        g3 = tl.load(gbase + c3)
        tl.store(dgbase + c0, tl.sum(dS * s0, axis=0))
        tl.store(dbase + c0 * PN, dS.to(dst_ptr.dtype.element_ty), mask=mask)
        dS = g0 * dS + d0
        if i0 + 1 < NC:
            tl.store(dgbase + c1, tl.sum(dS * s1, axis=0))
            tl.store(dbase + c1 * PN, dS.to(dst_ptr.dtype.element_ty), mask=mask)
            dS = g1 * dS + d1
        if i0 + 2 < NC:
            tl.store(dgbase + c2, tl.sum(dS * s2, axis=0))
            tl.store(dbase + c2 * PN, dS.to(dst_ptr.dtype.element_ty), mask=mask)
            dS = g2 * dS + d2
        if i0 + 3 < NC:
            tl.store(dgbase + c3, tl.sum(dS * s3, axis=0))
            tl.store(dbase + c3 * PN, dS.to(dst_ptr.dtype.element_ty), mask=mask)
            dS = g3 * dS + d3
    if HAS_DINIT:
        tl.store(dinit_ptr + bh * PN + offs, dS, mask=mask)


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
        accZ += tl.dot(Bt.to(tl.float32), dSt, input_precision=SPREC)
    tt = tl.arange(0, Q)
    keep = tt[:, None] <= tt[None, :]  # s <= t
    wend = tl.exp(cs_end - cs)
    if HAS_DOC:
        doc, doc_end, doc_prev = _chunk_docs(doc_ptr, b, c, L, offs_t, mask_t, Q)
        keep = keep & (doc[:, None] == doc[None, :])
        wend = tl.where(doc == doc_end, wend, 0.0)
    decayT = tl.exp(tl.where(keep, cs[None, :] - cs[:, None], float("-inf")))
    dy = tl.load((dy_ptr + (b * L * H + h) * P) + (offs_t[:, None] * (H * P) + offs_p[None, :]),
                 mask=mask_t[:, None] & mask_p[None, :], other=0.0).to(IN_DTYPE)
    dx = tl.dot((accGT * decayT).to(IN_DTYPE), dy, input_precision=PREC)
    dx = dt[:, None] * (dx + wend[:, None] * accZ)
    tl.store((dx_ptr + (b * L * H + h) * P) + (offs_t[:, None] * (H * P) + offs_p[None, :]),
             dx.to(dx_ptr.dtype.element_ty), mask=mask_t[:, None] & mask_p[None, :])


@triton.jit
def _chunk_bwd_dx_dcs(x_ptr, dy_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, doc_ptr, st_ptr, dst_ptr, dx_ptr,
                      ddt_ptr, dcs_ptr,
                      L, H, G, P, N, NC, NPB,
                      Q: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
                      HAS_DOC: tl.constexpr, PREC: tl.constexpr, XPREC: tl.constexpr):
    """Backward variant "v2" (the default; HMSCALE_SSD_BWD=v1 selects the older one): dx plus, as partial sums over this p tile,
    the direct dt gradient and d cs, using ``rowsum(PG dt) + v = dy . y`` (y recomputed in fp32) and
    ``colPG + wend u = x . (dx / dt)``. All dots feeding those sums use fp32 operands at XPREC."""
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
    s_base = (bh * NC + c) * P * N
    accGT = tl.zeros([Q, Q], dtype=tl.float32)  # [s, t] = B_s . C_t
    accZ = tl.zeros([Q, BP], dtype=tl.float32)  # [s, p] = (dS B_s)_p
    accYI = tl.zeros([Q, BP], dtype=tl.float32)  # [t, p] = (S0 C_t)_p
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
        dSt = tl.load(dst_ptr + s_base + so, mask=sm, other=0.0).to(tl.float32)  # (BN, BP) = dS^T
        accZ += tl.dot(Bt.to(tl.float32), dSt, input_precision=XPREC)
        S0t = tl.load(st_ptr + s_base + so, mask=sm, other=0.0).to(tl.float32)  # (BN, BP) = S0^T
        accYI += tl.dot(Ct.to(tl.float32), S0t, input_precision=XPREC)
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
    dy = tl.load(dy_ptr + xo + xt, mask=xm, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + xo + xt, mask=xm, other=0.0).to(tl.float32)
    stuff = tl.dot(MT, dy, input_precision=XPREC) + wend[:, None] * accZ  # dx / dt
    tl.store(dx_ptr + xo + xt, (dt[:, None] * stuff).to(dx_ptr.dtype.element_ty), mask=xm)
    y = tl.dot(tl.trans(MT * dt[:, None]), x, input_precision=XPREC) + win[:, None] * accYI
    ddt_direct = tl.sum(x * stuff, axis=1)
    endterm = wend * dt * tl.sum(x * accZ, axis=1)
    dcs = tl.sum(dy * y, axis=1) - dt * ddt_direct
    dcs = tl.where(tt == Q - 1, dcs + tl.sum(endterm, axis=0), dcs)
    po = (bh * NPB + pb) * (NC * Q) + c * Q + tt
    tl.store(ddt_ptr + po, ddt_direct)
    tl.store(dcs_ptr + po, dcs)


@triton.jit
def _chunk_bwd_dbc(x_ptr, dy_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, doc_ptr, st_ptr, dst_ptr,
                   dB_ptr, dC_ptr, ddt_ptr, dcs_ptr,
                   L, H, G, P, N, NC, NNB,
                   Q: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
                   HAS_DOC: tl.constexpr, PREC: tl.constexpr, SPREC: tl.constexpr,
                   IN_DTYPE: tl.constexpr, DCS: tl.constexpr = True):
    c = tl.program_id(0)
    bg = tl.program_id(1).to(tl.int64)
    nb = tl.program_id(2)
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
    Bt = tl.load(B_ptr + bc_base + bc_off, mask=bc_mask, other=0.0)
    Ct = tl.load(C_ptr + bc_base + bc_off, mask=bc_mask, other=0.0)
    if DCS:
        Gnb = tl.dot(Ct, tl.trans(Bt), input_precision=PREC)  # [t, s], partial over this n tile
    dB = tl.zeros([Q, BN], dtype=tl.float32)
    dC = tl.zeros([Q, BN], dtype=tl.float32)
    tt = tl.arange(0, Q)
    causal = tt[:, None] >= tt[None, :]
    for hh in range(HPG):
        h = grp * HPG + hh
        bh = b * H + h
        offs_t, mask_t, dt, cs, cs_end = _chunk_decay(dt_ptr, A_ptr, b, h, c, L, H, Q)
        x_base = (b * L * H + h) * P
        s_base = (bh * NC + c) * P * N
        accDYX = tl.zeros([Q, Q], dtype=tl.float32)  # [t, s] = dy_t . x_s
        accXS = tl.zeros([Q, BN], dtype=tl.float32)  # x_s^T dS
        accDYS = tl.zeros([Q, BN], dtype=tl.float32)  # dy_t^T S0
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
            dS = tl.load(dst_ptr + s_base + so, mask=sm, other=0.0).to(tl.float32)
            accXS += tl.dot(x.to(tl.float32), dS, input_precision=SPREC)
            S0 = tl.load(st_ptr + s_base + so, mask=sm, other=0.0).to(tl.float32)
            accDYS += tl.dot(dy.to(tl.float32), S0, input_precision=SPREC)
        keep = causal
        win = tl.exp(cs)
        wend = tl.exp(cs_end - cs)
        if HAS_DOC:
            doc, doc_end, doc_prev = _chunk_docs(doc_ptr, b, c, L, offs_t, mask_t, Q)
            keep = keep & (doc[:, None] == doc[None, :])
            win = tl.where(doc == doc_prev, win, 0.0)
            wend = tl.where(doc == doc_end, wend, 0.0)
        decay = tl.exp(tl.where(keep, cs[:, None] - cs[None, :], float("-inf")))
        Pm = decay * accDYX  # [t, s]
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
            po = (bh * NNB + nb) * (NC * Q) + c * Q + tt
            tl.store(ddt_ptr + po, ddt_direct)
            tl.store(dcs_ptr + po, dcs)
    tl.store(dB_ptr + bc_base + bc_off, dB.to(dB_ptr.dtype.element_ty), mask=bc_mask)
    tl.store(dC_ptr + bc_base + bc_off, dC.to(dC_ptr.dtype.element_ty), mask=bc_mask)


def bwd_variant() -> str:
    """``v2`` (default: the decay-gradient terms live in ``_chunk_bwd_dx_dcs``, and ``_chunk_bwd_dbc`` only does
    dB and dC; 1.1-1.3x faster fwd+bwd than v1 on the H200, full GPU check 225/225) or ``v1`` (the decay-gradient
    terms inside ``_chunk_bwd_dbc``). Env ``HMSCALE_SSD_BWD``."""
    v = os.environ.get("HMSCALE_SSD_BWD", "v2").lower()
    if v not in ("v1", "v2"):
        raise ValueError(f"HMSCALE_SSD_BWD must be v1 or v2, got {v!r}")
    return v


def dbc_config(n: int):
    """(BP, BN, num_stages, num_warps) of ``_chunk_bwd_dbc``, the backward's slowest kernel.

    Defaults measured on the H200 (see kernels/NOTES.md): v2 (16, min(64, N), 2, 4), the best of a sweep of six
    tilings at both the 410m and the 1.4b hedge shapes; v1 (16, min(64, N), 1, 8), its spill-free choice.
    ``HMSCALE_SSD_DBC_CFG="BP,BN,stages,warps"`` overrides it, for tuning runs only (powers of two, >= 16).
    """
    env = os.environ.get("HMSCALE_SSD_DBC_CFG")
    if env:
        bp, bn, st, nw = (int(v) for v in env.split(","))
        return bp, min(bn, _pow2(n)), st, nw
    if bwd_variant() == "v2":  # without the decay-gradient terms the kernel pipelines without spilling
        return 16, min(64, _pow2(n)), 2, 4
    return 16, min(64, _pow2(n)), 1, 8


_TL_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def ssd_bwd(dy, dfinal, x, dt, A, B, C, doc, states, gdec, Q: int, need_dinit: bool):
    """Gradients (dx, ddt, dA, dB, dC, dinit). ``states`` holds S_prev per chunk (from ssd_fwd)."""
    b, l, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    nc = states.shape[2]
    dev = x.device
    prec, sprec = precisions(x.dtype)
    # dtype of the dots that involve dy: the input dtype, except when dy is fp32 for 16-bit inputs
    # (normalize: the normaliser's gradient can exceed the fp16 range): then fp32 operands, tf32 dots
    if dy.dtype == torch.float32 and x.dtype != torch.float32:
        in_dtype, prec = tl.float32, "tf32"
    else:
        in_dtype = _TL_DTYPE[x.dtype]
    BP, BN = block_sizes(p, n, Q)
    BN_big = min(128 if x.dtype != torch.float32 else 64, _pow2(n))
    BP_dbc, BN_dbc, stages_dbc, warps_dbc = dbc_config(n)
    # the decay gradient (dA, dt) sums terms x^T dS B and dy^T S0 C that largely cancel: their state
    # dots run in 3xTF32 (about fp32 accuracy) for 16-bit inputs, exact fp32 for fp32 inputs
    sprec_dbc = state_precision(x.dtype)
    has_doc = doc is not None
    doc_arg = doc if has_doc else dt
    dy = dy.contiguous()
    dst = torch.empty_like(states)  # same storage dtype as the forward states
    grid1 = (nc, b * h, triton.cdiv(p, BP) * triton.cdiv(n, BN))
    _chunk_dstate_bwd[grid1](dy, dt, A, C, doc_arg, dst, l, h, g, p, n, nc,
                             Q=Q, BP=BP, BN=BN, HAS_DOC=has_doc, PREC=state_precision(x.dtype),
                             num_warps=4)
    PN = p * n
    BLOCK = min(1024, _pow2(PN))
    nblk = triton.cdiv(PN, BLOCK)
    dg = torch.empty(b * h, nblk, nc, device=dev, dtype=torch.float32)
    dinit = torch.empty(b, h, p, n, device=dev, dtype=torch.float32) if need_dinit else None
    has_dfinal = dfinal is not None
    _state_pass_bwd[(b * h, nblk)](dst, states, gdec, dfinal.contiguous() if has_dfinal else dst,
                                   dinit if need_dinit else dst, dg, nc, PN, nblk,
                                   HAS_DFINAL=has_dfinal, HAS_DINIT=need_dinit, BLOCK=BLOCK, num_warps=4)
    dx = torch.empty_like(x)
    dB = torch.empty_like(B)
    dC = torch.empty_like(C)
    dbc_kw = dict(Q=Q, BP=BP_dbc, BN=BN_dbc, HAS_DOC=has_doc, PREC=prec, IN_DTYPE=in_dtype,
                  num_warps=warps_dbc, num_stages=stages_dbc)
    if bwd_variant() == "v2":
        BP2 = min(64, _pow2(p))
        npb = triton.cdiv(p, BP2)
        ddt_part = torch.empty(b * h, npb, nc * Q, device=dev, dtype=torch.float32)
        dcs_part = torch.empty(b * h, npb, nc * Q, device=dev, dtype=torch.float32)
        _chunk_bwd_dx_dcs[(nc, b * h, npb)](x, dy, dt, A, B, C, doc_arg, states, dst, dx, ddt_part, dcs_part,
                                           l, h, g, p, n, nc, npb, Q=Q, BP=BP2, BN=min(32, _pow2(n)),
                                           HAS_DOC=has_doc, PREC=prec, XPREC=state_precision(x.dtype),
                                           num_warps=8)
        nnb = triton.cdiv(n, BN_dbc)
        _chunk_bwd_dbc[(nc, b * g, nnb)](x, dy, dt, A, B, C, doc_arg, states, dst, dB, dC, ddt_part, dcs_part,
                                         l, h, g, p, n, nc, nnb, SPREC=sprec, DCS=False, **dbc_kw)
    else:
        _chunk_bwd_dx[(nc, b * h, triton.cdiv(p, BP))](dy, dt, A, B, C, doc_arg, dst, dx, l, h, g, p, n, nc,
                                                      Q=Q, BP=BP, BN=BN_big, HAS_DOC=has_doc, PREC=prec,
                                                      SPREC=sprec, IN_DTYPE=in_dtype, num_warps=8)
        nnb = triton.cdiv(n, BN_dbc)
        ddt_part = torch.empty(b * h, nnb, nc * Q, device=dev, dtype=torch.float32)
        dcs_part = torch.empty(b * h, nnb, nc * Q, device=dev, dtype=torch.float32)
        _chunk_bwd_dbc[(nc, b * g, nnb)](x, dy, dt, A, B, C, doc_arg, states, dst, dB, dC, ddt_part, dcs_part,
                                         l, h, g, p, n, nc, nnb, SPREC=sprec_dbc, DCS=True, **dbc_kw)
    # d cs -> d a (reverse cumulative sum within each chunk), then dt and A
    dcs = dcs_part.sum(1).view(b, h, nc, Q)
    dg_tot = dg.sum(1).view(b, h, nc) * gdec.view(b, h, nc)
    dcs[..., Q - 1] += dg_tot
    da = dcs.flip(-1).cumsum(-1).flip(-1).view(b, h, nc * Q)[:, :, :l]
    ddt_direct = ddt_part.sum(1)[:, :l].view(b, h, l)
    ddt = (ddt_direct + A.view(1, h, 1) * da).transpose(1, 2)
    dA = (da * dt.transpose(1, 2)).sum((0, 2))
    return dx, ddt, dA, dB, dC, dinit
