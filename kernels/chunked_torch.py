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

import torch
import torch.nn.functional as F

from .reference import doc_ids_from_seq_idx, expand_groups

__all__ = ["ssd_chunked_torch"]


def ssd_chunked_torch(x, dt, A, B, C, chunk_size=64, D=None, initial_state=None, seq_idx=None,
                      normalize=False, return_final_state=False, **_ignored):
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
