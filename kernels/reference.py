"""Plain-PyTorch references for the SSD (Mamba-2 state-space duality) operator.

Both functions compute exactly the contract of :func:`kernels.ssd` (see DESIGN.md):

    y_t = sum_{s<=t} (C_t . B_s) * exp(sum_{s<r<=t} dt_r A) * dt_s * x_s   (+ D x_t)

``ssd_reference`` uses the quadratic (attention-like) form, ``ssd_recurrent_reference``
the token-by-token recurrence ``S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T, y_t = S_t C_t``.
They are written for clarity, not speed, and work in any floating dtype (float64 in tests).
"""

from __future__ import annotations

import torch

__all__ = ["cross_entropy_reference", "ssd_reference", "ssd_recurrent_reference", "doc_ids_from_seq_idx", "expand_groups",
           "hedgehog_feature_map_reference", "causal_depthwise_conv_reference", "sigmoid_gate_reference"]


def doc_ids_from_seq_idx(seq_idx: torch.Tensor | None, b: int, l: int, device) -> torch.Tensor:
    """Turn ``seq_idx`` (b, l) into monotone document ids starting at 0.

    A new document starts wherever ``seq_idx`` changes from one token to the next, so the
    ids count the changes; ``initial_state`` belongs to document 0.
    """
    if seq_idx is None:
        return torch.zeros(b, l, dtype=torch.int32, device=device)
    change = (seq_idx[:, 1:] != seq_idx[:, :-1]).to(torch.int32)
    doc = torch.cat([change.new_zeros(change.shape[0], 1), torch.cumsum(change, dim=1, dtype=torch.int32)], dim=1)  # (l = 1 too)
    return doc.to(torch.int32)


def expand_groups(t: torch.Tensor, h: int) -> torch.Tensor:
    """(b, l, g, n) -> (b, l, h, n): head i reads group i // (h // g)."""
    g = t.shape[2]
    if h % g != 0:
        raise ValueError(f"number of heads {h} is not a multiple of number of groups {g}")
    return t.repeat_interleave(h // g, dim=2)


def _augment_ones(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, torch.ones_like(x[..., :1])], dim=-1)


def _finish(y_aug, x, D, normalize, p):
    if normalize:
        y = y_aug[..., :p] / y_aug[..., p:]
    else:
        y = y_aug
    if D is not None:
        Dv = D.to(y.dtype)
        Dv = Dv[:, None] if Dv.dim() == 1 else Dv  # (h, 1) or (h, p)
        y = y + Dv * x.to(y.dtype)
    return y


def ssd_reference(x, dt, A, B, C, chunk_size=64, D=None, initial_state=None, seq_idx=None,
                  normalize=False, return_final_state=False):
    """Quadratic-form reference. Computes in the promoted dtype of the inputs (use float64 to check).

    Memory is O(b h l^2): for tests and small CPU runs only. ``chunk_size`` is accepted and ignored.
    """
    b, l, h, p = x.shape
    dtype = torch.promote_types(x.dtype, torch.float32)
    if x.dtype == torch.float64 or B.dtype == torch.float64:
        dtype = torch.float64
    xx = x.to(dtype)
    if normalize:
        xx = _augment_ones(xx)
    Bh = expand_groups(B.to(dtype), h)  # (b, l, h, n)
    Ch = expand_groups(C.to(dtype), h)
    a = dt.to(dtype) * A.to(dtype).view(1, 1, h)  # (b, l, h) log-decay per step
    cs = torch.cumsum(a, dim=1)  # (b, l, h)
    doc = doc_ids_from_seq_idx(seq_idx, b, l, x.device)
    # segment sums sum_{s<r<=t} a_r = cs_t - cs_s, masked to s <= t and same document
    diff = cs.unsqueeze(2) - cs.unsqueeze(1)  # (b, t, s, h)
    causal = torch.ones(l, l, dtype=torch.bool, device=x.device).tril()
    same = doc.unsqueeze(2) == doc.unsqueeze(1)  # (b, t, s)
    mask = (causal.unsqueeze(0) & same).unsqueeze(-1)  # (b, t, s, 1)
    decay = torch.where(mask, torch.exp(torch.where(mask, diff, torch.zeros_like(diff))), torch.zeros_like(diff))
    cb = torch.einsum("bthn,bshn->btsh", Ch, Bh)
    w = cb * decay * dt.to(dtype).unsqueeze(1)  # (b, t, s, h)
    y = torch.einsum("btsh,bshp->bthp", w, xx)
    first = (doc == 0).to(dtype)  # tokens that still see the initial state
    if initial_state is not None:
        s0 = initial_state.to(dtype)  # (b, h, p', n)
        y = y + torch.einsum("bhpn,bthn->bthp", s0, Ch) * (torch.exp(cs) * first.unsqueeze(-1)).unsqueeze(-1)
    out = _finish(y, x.to(dtype), D.to(dtype) if D is not None else None, normalize, p).to(x.dtype)
    if not return_final_state:
        return out
    last_doc = doc[:, -1:]  # (b, 1)
    in_last = (doc == last_doc).to(dtype)  # (b, l)
    wend = torch.exp(cs[:, -1:, :] - cs) * dt.to(dtype) * in_last.unsqueeze(-1)  # (b, l, h)
    final = torch.einsum("blh,blhp,blhn->bhpn", wend, xx, Bh)
    if initial_state is not None:
        keep = torch.exp(cs[:, -1, :]) * (last_doc[:, 0] == 0).to(dtype).unsqueeze(-1)  # (b, h)
        final = final + keep[:, :, None, None] * initial_state.to(dtype)
    return out, final.to(torch.float32 if x.dtype != torch.float64 else torch.float64)


def ssd_recurrent_reference(x, dt, A, B, C, chunk_size=64, D=None, initial_state=None, seq_idx=None,
                            normalize=False, return_final_state=False):
    """Token-by-token recurrence (the definition). O(l) sequential steps; tests only."""
    b, l, h, p = x.shape
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    xx = x.to(dtype)
    if normalize:
        xx = _augment_ones(xx)
    Bh = expand_groups(B.to(dtype), h)
    Ch = expand_groups(C.to(dtype), h)
    n = B.shape[-1]
    pp = xx.shape[-1]
    if initial_state is not None:
        state = initial_state.to(dtype).clone()
    else:
        state = torch.zeros(b, h, pp, n, dtype=dtype, device=x.device)
    doc = doc_ids_from_seq_idx(seq_idx, b, l, x.device)
    ys = []
    for t in range(l):
        if t > 0:
            reset = (doc[:, t] != doc[:, t - 1]).to(dtype).view(b, 1, 1, 1)
            state = state * (1 - reset)
        decay = torch.exp(dt[:, t].to(dtype) * A.to(dtype).view(1, h))  # (b, h)
        state = decay[:, :, None, None] * state + dt[:, t].to(dtype)[:, :, None, None] * \
            xx[:, t, :, :, None] * Bh[:, t, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", state, Ch[:, t]))
    y = torch.stack(ys, dim=1)
    out = _finish(y, x.to(dtype), D.to(dtype) if D is not None else None, normalize, p).to(x.dtype)
    if return_final_state:
        return out, state.to(torch.float32 if x.dtype != torch.float64 else torch.float64)
    return out


def hedgehog_feature_map_reference(u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The Hedgehog feature map ``phi(u) = softmax([W u + b, -(W u + b)])`` per head, plain PyTorch:
    u (..., h, P), weight (h, F, P), bias (h, F) -> phi (..., h, 2F) in u's dtype. The projection runs in u's
    dtype (a bf16 model gets a bf16 tensor-core matmul with fp32 accumulation); bias and softmax in fp32.
    The CPU path of ``models.feature_map`` and the reference of ``kernels.feature_map``."""
    z = torch.einsum("...hp,hfp->...hf", u, weight.to(u.dtype)).float() + bias.float()
    return torch.softmax(torch.cat([z, -z], dim=-1), dim=-1).to(u.dtype)


def causal_depthwise_conv_reference(x: torch.Tensor, prev: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor):
    """Causal depthwise conv, plain PyTorch: ``y[t] = b + sum_j w[:, j] xp[t + j]``, ``xp = [prev, x]``;
    x (b, l, C), prev (b, W-1, C), weight (C, W), bias (C) -> (y in x's dtype, the last W-1 rows of xp).
    The reference of ``kernels.conv`` and the mixer's conv inside compiled graphs."""
    l, W = x.shape[1], weight.shape[1]
    xp = torch.cat([prev.to(x.dtype), x], dim=1)
    w = weight.to(x.dtype)
    y = xp[:, W - 1:] * w[:, W - 1]
    for j in range(W - 1):
        y = y + xp[:, j:j + l] * w[:, j]
    return y + bias.to(x.dtype), xp[:, xp.shape[1] - (W - 1):]


def sigmoid_gate_reference(y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """The mixer's output gate ``y * 2 sigmoid(z)``, plain PyTorch: z (same number of elements) read in y's
    layout; the result in y's shape and dtype. The reference of ``kernels.gate``."""
    return y * (2.0 * torch.sigmoid(z)).view(y.shape).to(y.dtype)


def cross_entropy_reference(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Sum over rows of ``-log softmax(logits)[target]`` in fp32 (``ignore_index`` rows skipped)."""
    return torch.nn.functional.cross_entropy(logits.float(), target, ignore_index=ignore_index, reduction="sum")
