"""Chunked SSD in plain PyTorch: the CPU path used by models (autograd through ordinary ops).

Same algorithm as the Triton kernels, written with batched tensor ops:

1. split the sequence into chunks of ``chunk_size`` (the tail is padded with dt = 0, x = 0, which
   changes nothing), and take the within-chunk cumulative log-decay ``cs``;
2. intra-chunk output: a (Q x Q) masked decay matrix times (C B^T) times dt, applied to x;
3. per-chunk local states, then a short sequential pass over chunks carrying the state
   (``S_end = g_c S_prev + local_c``), which also yields the final state;
4. inter-chunk output: ``exp(cs_t) * S_prev C_t``.

Memory is O(b h l chunk) for the decay matrices plus O(b h (l / chunk) p n) for chunk states.
Document boundaries (``seq_idx``) zero every term that would cross them.
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F

from .arg_checks import check_decay, check_tensors, fail
from .reference import doc_ids_from_seq_idx, expand_groups

__all__ = ["ssd_chunked_torch", "check_ssd_args"]


def check_ssd_args(x, dt, A, B, C, chunk_size=64, D=None, initial_state=None, seq_idx=None, normalize=False,
                   fn="ssd", init_name="initial_state") -> None:
    """The contract of :func:`kernels.ssd` on shapes, dtypes and devices, checked before any work: a one-line
    ``ValueError`` naming the argument and what to pass. Reads no tensor data (no host synchronisation)."""

    def bad(msg):
        fail(fn, msg)

    check_tensors(fn, (("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C), ("D", D), (init_name, initial_state),
                       ("seq_idx", seq_idx)), "x", x, optional=("D", init_name, "seq_idx"), integer=("seq_idx",))
    if x.dim() != 4:
        bad(f"x must be (b, l, h, p), got shape {tuple(x.shape)}")
    b, l, h, p = x.shape
    if l == 0:
        bad(f"x has no tokens (l = 0), got shape {tuple(x.shape)}: the state after no tokens is initial_state itself")
    if tuple(dt.shape) != (b, l, h):
        hint = "; drop the last dim (dt[..., 0])" if tuple(dt.shape) == (b, l, h, 1) else ""
        bad(f"dt must be (b, l, h) = {(b, l, h)}, one step per token and head, got {tuple(dt.shape)}{hint}")
    check_decay(fn, A, h)
    for name, t in (("B", B), ("C", C)):
        if t.dim() != 4 or tuple(t.shape[:2]) != (b, l) or t.shape[2] == 0 or h % t.shape[2] != 0:
            hint = "; add the group dim: B[:, :, None], C[:, :, None]" if t.dim() == 3 else ""
            bad(f"{name} must be (b, l, g, n) with b, l = {(b, l)} and h = {h} a multiple of g, "
                f"got {tuple(t.shape)}{hint}")
    if B.shape != C.shape:
        bad(f"B and C must have one shape (b, l, g, n), got {tuple(B.shape)} and {tuple(C.shape)}")
    n = B.shape[3]
    if D is not None and tuple(D.shape) not in ((h,), (h, p), (h, 1)):
        bad(f"D must be (h,) = ({h},) or (h, p) = {(h, p)}, got {tuple(D.shape)}")
    ps = p + int(bool(normalize))
    if initial_state is not None and tuple(initial_state.shape) != (b, h, ps, n):
        extra = " (p + 1 rows with normalize=True: the last one is the normaliser's)" if normalize else ""
        bad(f"{init_name} must be (b, h, p, n) = {(b, h, ps, n)}{extra}, got {tuple(initial_state.shape)}")
    if seq_idx is not None:
        if tuple(seq_idx.shape) != (b, l):
            bad(f"seq_idx must be (b, l) = {(b, l)}, got {tuple(seq_idx.shape)}")
        if seq_idx.is_floating_point() or seq_idx.is_complex():
            bad(f"seq_idx must be an integer tensor (int32, as mamba_ssm), got {seq_idx.dtype}")
    try:
        q = operator.index(chunk_size)
    except TypeError:
        q = 0
    if q < 1 or isinstance(chunk_size, bool):
        bad(f"chunk_size must be a positive int, got {chunk_size!r}")


def ssd_chunked_torch(x, dt, A, B, C, chunk_size=64, D=None, initial_state=None, seq_idx=None,
                      normalize=False, return_final_state=False):
    check_ssd_args(x, dt, A, B, C, chunk_size, D, initial_state, seq_idx, normalize)
    b, l, h, p = x.shape
    n = B.shape[-1]
    Q = int(chunk_size)
    cdtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    xx = x.to(cdtype)
    if normalize:
        xx = torch.cat([xx, torch.ones_like(xx[..., :1])], dim=-1)
    pp = xx.shape[-1]
    Bh = expand_groups(B.to(cdtype), h)
    Ch = expand_groups(C.to(cdtype), h)
    dtc = dt.to(cdtype)
    doc = doc_ids_from_seq_idx(seq_idx, b, l, x.device).long()
    nc = (l + Q - 1) // Q
    pad = nc * Q - l
    if pad:
        xx = F.pad(xx, (0, 0, 0, 0, 0, pad))
        Bh = F.pad(Bh, (0, 0, 0, 0, 0, pad))
        Ch = F.pad(Ch, (0, 0, 0, 0, 0, pad))
        dtc = F.pad(dtc, (0, 0, 0, pad))
        doc = torch.cat([doc, doc[:, -1:].expand(b, pad)], dim=1)
    # chunked views: (b, c, Q, h, ...)
    xc = xx.view(b, nc, Q, h, pp)
    Bc = Bh.view(b, nc, Q, h, n)
    Cc = Ch.view(b, nc, Q, h, n)
    dtk = dtc.view(b, nc, Q, h)
    dc = doc.view(b, nc, Q)
    a = dtk * A.to(cdtype).view(1, 1, 1, h)
    cs = torch.cumsum(a, dim=2)  # (b, c, Q, h)
    # intra-chunk
    causal = torch.ones(Q, Q, dtype=torch.bool, device=x.device).tril()
    same = dc.unsqueeze(3) == dc.unsqueeze(2)  # (b, c, t, s)
    mask = (causal & same).unsqueeze(-1)  # (b, c, t, s, 1)
    diff = cs.unsqueeze(3) - cs.unsqueeze(2)  # (b, c, t, s, h)
    decay = torch.exp(torch.where(mask, diff, torch.full_like(diff, float("-inf"))))
    cb = torch.einsum("bcthn,bcshn->bctsh", Cc, Bc)
    w = cb * decay * dtk.unsqueeze(2)
    y = torch.einsum("bctsh,bcshp->bcthp", w, xc)
    # chunk-local states and the decay/keep factor of each chunk
    doc_end = dc[:, :, -1]  # (b, c)
    doc_prev = torch.cat([torch.zeros_like(doc_end[:, :1]), doc_end[:, :-1]], dim=1)  # (b, c)
    cs_end = cs[:, :, -1, :]  # (b, c, h)
    in_end = (dc == doc_end.unsqueeze(-1)).unsqueeze(-1)  # (b, c, Q, 1)
    wend = torch.exp(torch.where(in_end, cs_end.unsqueeze(2) - cs, torch.full_like(cs, float("-inf")))) * dtk
    local = torch.einsum("bcsh,bcshp,bcshn->bchpn", wend, xc, Bc)
    keep = (doc_end == doc_prev).to(cdtype).unsqueeze(-1)  # (b, c, 1)
    g = torch.exp(cs_end) * keep  # (b, c, h)
    if initial_state is not None:
        state = initial_state.to(cdtype)
    else:
        state = xx.new_zeros(b, h, pp, n)
    prevs = []
    for c in range(nc):
        prevs.append(state)
        state = g[:, c, :, None, None] * state + local[:, c]
    sprev = torch.stack(prevs, dim=1)  # (b, c, h, pp, n)
    m0 = (dc == doc_prev.unsqueeze(-1)).unsqueeze(-1)  # (b, c, Q, 1)
    win = torch.exp(cs) * m0  # (b, c, Q, h)
    y = y + torch.einsum("bchpn,bcthn->bcthp", sprev, Cc) * win.unsqueeze(-1)
    y = y.reshape(b, nc * Q, h, pp)[:, :l]
    if normalize:
        y = y[..., :p] / y[..., p:]
    if D is not None:
        Dv = D.to(cdtype)
        Dv = Dv[:, None] if Dv.dim() == 1 else Dv
        y = y + Dv * x.to(cdtype)
    y = y.to(x.dtype)
    if return_final_state:
        return y, state.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    return y
