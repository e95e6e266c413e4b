"""mamba_ssm's two SSD entry points with their signatures, computed by hmscale's kernels: a drop-in for code written
against mamba_ssm (``from kernels.compat import mamba_chunk_scan_combined, selective_state_update``).

``mamba_chunk_scan_combined`` (training / prefill) runs :func:`kernels.ssd`; ``selective_state_update`` (one decode
step, the state updated in place) runs :func:`kernels.ssd_step` where dt, A and dt_bias are tied across a head's
channels (Mamba-2: mamba_ssm's callers pass them expanded with stride 0) and plain PyTorch otherwise.

What it adds around ``kernels.ssd`` is what mamba_ssm folds into its scan: ``dt + dt_bias``, the softplus, the
clamp to ``dt_limit`` (applied always, as mamba_ssm's scan does: the default ``(0, inf)`` sends a negative dt to
0 when there is no softplus; all in fp32, on dt's (b, l, h) elements) and the output gate ``y * silu(z)`` (after the D
skip, as mamba_ssm applies it). Gradients reach x, dt, A, B, C, D, z, dt_bias and initial_states.

Differences, by design:

- ``chunk_size`` is accepted (mamba_ssm requires it) but does not choose the kernels' chunk: hmscale runs its own
  tuned chunk (``HMSCALE_COMPAT_CHUNK``, default 64). The chunk changes the order of the sums, not the function:
  outputs agree with mamba_ssm's to rounding whatever chunk either side uses.
- ``return_varlen_states`` with ``cu_seqlens`` (batch 1, as mamba_ssm): the state after each sequence's last token,
  as the scan reaches it (``seq_idx`` decides the resets, as in mamba_ssm, and must be given with several sequences),
  computed in PyTorch from the same processed dt (host reads of ``cu_seqlens`` and ``seq_idx``, checked to agree;
  differentiable, where mamba_ssm's backward refuses it). Without ``initial_states`` the two libraries agree to
  rounding (``benchmarks/compat_check.py``); with them, the initial state enters the first sequence's state here
  wherever that sequence ends, while mamba_ssm 2.3.2 leaves it out when the first sequence ends inside its first
  chunk (seen on the CPU, 2026-12-05: 1.8e-3 from the float64 scan for that sequence, ours 5.8e-8).
- the gate is applied by PyTorch after the scan's output is rounded to x's dtype (mamba_ssm gates the fp32
  accumulator): in bf16 the two differ by about one rounding.
- ``initial_states`` with ``seq_idx``: the initial state belongs to each row's first document whatever its
  ``seq_idx`` value (``kernels.ssd``'s contract: changes count, values are not read); mamba_ssm ties it to the
  value 0, so a row whose ``seq_idx`` starts elsewhere drops it there. The same where rows start at 0.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F

from .reference import expand_groups

__all__ = ["mamba_chunk_scan_combined", "selective_state_update"]


def _chunk() -> int:
    raw = os.environ.get("HMSCALE_COMPAT_CHUNK", "64")
    try:
        q = int(raw)
    except ValueError:
        q = -1
    if q < 16 or q & (q - 1):
        raise ValueError(f"HMSCALE_COMPAT_CHUNK must be a power of two >= 16 (64 is the tuned one), got {raw!r}")
    return q


def _fp32(t):
    """fp32, or float64 kept (the references' precision)."""
    return t if t.dtype == torch.float64 else t.float()


def _check_dt_options(fn, dt, dt_bias, dt_limit) -> None:
    """dt_bias (h,) floating-point on dt's device, dt_limit a (min, max) pair: one-line ``ValueError`` each."""
    h = dt.shape[-1]
    if dt_bias is not None:
        if not isinstance(dt_bias, torch.Tensor) or not dt_bias.is_floating_point():
            raise ValueError(f"{fn}: dt_bias must be a floating-point tensor (h,), got "
                             f"{getattr(dt_bias, 'dtype', type(dt_bias).__name__)}")
        if dt_bias.device != dt.device:
            raise ValueError(f"{fn}: dt_bias is on {dt_bias.device} but dt is on {dt.device}")
        if dt_bias.shape != (h,):
            raise ValueError(f"{fn}: dt_bias must be (h,) = ({h},), got {tuple(dt_bias.shape)}")
    try:
        lo, hi = dt_limit
        float(lo), float(hi)
    except (TypeError, ValueError):
        raise ValueError(f"{fn}: dt_limit must be a (min, max) pair of numbers, got {dt_limit!r}") from None


def _dt_processed(dt, dt_bias, dt_softplus, dt_limit):
    d = _fp32(dt)
    if dt_bias is not None:
        d = d + dt_bias.to(d.dtype)
    if dt_softplus:
        d = F.softplus(d)  # the identity above 20, as mamba_ssm's
    # always, as mamba_ssm's scan: the default (0, inf) too sends a negative dt (no softplus) to 0
    lo, hi = dt_limit
    return d.clamp(min=float(lo), max=float(hi))


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size=64, D=None, z=None, dt_bias=None, initial_states=None,
                              seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                              return_final_states=False, return_varlen_states=False, backend=None):
    """mamba_ssm's ``mamba_chunk_scan_combined`` on hmscale's kernels.

    x (b, l, h, p); dt (b, l, h); A (h,); B, C (b, l, g, n) with h % g == 0; D (h,) or (h, p); z (b, l, h, p);
    dt_bias (h,); initial_states (b, h, p, n); seq_idx (b, l). Returns y (b, l, h, p) in x's dtype, and the
    final state (b, h, p, n) fp32 with ``return_final_states``. ``backend`` as in :func:`kernels.ssd`.
    """
    from kernels import check_ssd_args, ssd

    # first: a wrong dt is named as such (not as a dt_bias of the wrong length), a wrong seq_idx before it is read
    check_ssd_args(x, dt, A, B, C, _chunk(), D, initial_states, seq_idx, fn="mamba_chunk_scan_combined",
                   init_name="initial_states")
    _check_dt_options("mamba_chunk_scan_combined", dt, dt_bias, dt_limit)
    if return_varlen_states:
        _check_varlen(x, cu_seqlens, seq_idx)
    if z is not None and (not isinstance(z, torch.Tensor) or z.shape != x.shape):
        got = tuple(z.shape) if isinstance(z, torch.Tensor) else type(z).__name__
        raise ValueError(f"mamba_chunk_scan_combined: z must have x's shape {tuple(x.shape)}, got {got}")
    del chunk_size  # the function does not depend on it; see the module docstring
    if z is not None and z.device != x.device:
        raise ValueError(f"mamba_chunk_scan_combined: z is on {z.device} but x is on {x.device}")

    d = _dt_processed(dt, dt_bias, dt_softplus, dt_limit)
    out = ssd(x, d, _fp32(A), B, C, chunk_size=_chunk(), D=D, initial_state=initial_states, seq_idx=seq_idx,
              return_final_state=return_final_states, backend=backend)
    y, final = out if return_final_states else (out, None)
    if z is not None:
        y = (_fp32(y) * F.silu(_fp32(z))).to(x.dtype)
    if not return_varlen_states:
        return (y, final) if return_final_states else y
    varlen = _varlen_states(x, d, _fp32(A), B, initial_states, cu_seqlens)
    return (y, final, varlen) if return_final_states else (y, varlen)


def _check_varlen(x, cu_seqlens, seq_idx) -> None:
    """Before any work: what ``return_varlen_states`` needs (host reads of ``cu_seqlens`` and ``seq_idx``)."""
    def bad(msg):
        raise ValueError(f"mamba_chunk_scan_combined: {msg}")

    b, l = x.shape[:2]
    if cu_seqlens is None:
        bad("return_varlen_states needs cu_seqlens (num_sequences + 1,): where each sequence starts")
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.is_floating_point() or cu_seqlens.is_complex():
        bad(f"cu_seqlens must be an integer tensor (num_sequences + 1,), got "
            f"{getattr(cu_seqlens, 'dtype', type(cu_seqlens).__name__)}")
    if b != 1:
        bad(f"return_varlen_states supports batch 1 (sequences packed along l), as mamba_ssm; got batch {b}")
    cu = cu_seqlens.tolist() if cu_seqlens.dim() == 1 else None
    if cu is None or len(cu) < 2 or cu[0] != 0 or cu[-1] != l or any(e <= s for s, e in zip(cu, cu[1:])):
        bad(f"cu_seqlens must rise strictly from 0 to l = {l} (num_sequences + 1 entries), got {cu_seqlens.tolist()}")
    if seq_idx is None and len(cu) > 2:
        bad("return_varlen_states with several sequences needs seq_idx (1, l) numbering them as cu_seqlens does: "
            "without it the scan carries the state across sequences")
    if seq_idx is not None:
        changes = (torch.nonzero(seq_idx[0, 1:] != seq_idx[0, :-1]).flatten() + 1).tolist()
        if changes != cu[1:-1]:
            bad(f"seq_idx must change exactly where cu_seqlens starts a sequence ({cu[1:-1]}), "
                f"it changes at {changes[:8]}{'...' if len(changes) > 8 else ''}")


def _varlen_states(x, d, A, B, initial_states, cu_seqlens):
    """(num_sequences, h, p, n) fp32 (float64 for float64 x): the scan's state after the last token of each
    ``cu_seqlens`` sequence (batch 1).

    ``_check_varlen`` made the scan restart exactly where each sequence starts, so the state after sequence [s, e) is
    sum_{t=s}^{e-1} exp(sum_{u=t+1}^{e-1} dt_u A) dt_t x_t B_t^T, plus exp(sum_{u<e} dt_u A) S0 for the first one
    (the initial state enters the first document only)."""
    h = x.shape[2]
    cu = [int(v) for v in cu_seqlens.tolist()]
    # one dtype for all (the scan's final state's: float64 for float64 x, else fp32): mixed input dtypes (a float64 dt
    # with fp32 B, say) made the einsum below raise "expected scalar type Double but found Float"
    cd = torch.float64 if x.dtype == torch.float64 else torch.float32
    xs, Bs = x[0].to(cd), expand_groups(B.to(cd), h)[0]  # (l, h, p), (l, h, n)
    d, A = d.to(cd), A.to(cd)
    dA = d[0] * A  # (l, h)
    out = []
    for s, e in zip(cu[:-1], cu[1:]):
        tail = torch.flip(torch.cumsum(torch.flip(dA[s:e], [0]), 0), [0]) - dA[s:e]  # sum_{u=t+1}^{e-1} dA_u
        w = torch.exp(tail) * d[0, s:e]  # (t, h)
        state = torch.einsum("thp,thn->hpn", w[..., None] * xs[s:e], Bs[s:e])
        if s == 0 and initial_states is not None:
            state = state + torch.exp(dA[:e].sum(0))[:, None, None] * initial_states[0].to(cd)
        out.append(state)
    return torch.stack(out)


def _tied(t, dims) -> bool:
    """Whether ``t`` is broadcast (stride 0) along ``dims``: one value per head, as Mamba-2 passes dt, A, dt_bias."""
    return t is None or all(t.stride(d) == 0 or t.shape[d] == 1 for d in dims)


def _check_step(state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices) -> None:
    """Shapes, dtypes and devices of :func:`selective_state_update`'s arguments (after the head dim is added), beyond
    the state / x / dt / A check there: one-line ``ValueError`` each, no tensor data read."""

    def bad(msg):
        raise ValueError(f"selective_state_update: {msg}")

    # x first: the others' devices are compared with its
    for name, t in (("x", x), ("state", state), ("dt", dt), ("A", A), ("B", B), ("C", C), ("D", D), ("z", z),
                    ("dt_bias", dt_bias), ("state_batch_indices", state_batch_indices)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            bad(f"{name} must be a tensor, got {type(t).__name__}")
        if (name == "state_batch_indices") == t.is_floating_point():
            bad(f"{name} must be {'an integer' if name == 'state_batch_indices' else 'a floating-point'} tensor, "
                f"got {t.dtype}")
        if t.device != x.device:
            bad(f"{name} is on {t.device} but x is on {x.device}: put every tensor on one device")
    if x.dim() != 3:
        bad(f"x must be (b, h, p) (or (b, p) with a (b, p, n) state), got {tuple(x.shape)}")
    b, h, p = x.shape
    n = state.shape[-1]
    for name, t in (("B", B), ("C", C)):
        if t.dim() != 3 or t.shape[0] != b or t.shape[1] == 0 or h % t.shape[1] != 0 or t.shape[2] != n:
            bad(f"{name} must be (b, g, n) with b = {b}, n = {n} (the state's) and h = {h} a multiple of g, "
                f"got {tuple(t.shape)}")
    if B.shape != C.shape:
        bad(f"B and C must have one shape (b, g, n), got {tuple(B.shape)} and {tuple(C.shape)}")
    if D is not None and tuple(D.shape) not in ((h,), (h, p)):
        bad(f"D must be (h, p) = {(h, p)} or (h,), got {tuple(D.shape)}")
    if z is not None and z.shape != x.shape:
        bad(f"z must have x's shape {tuple(x.shape)}, got {tuple(z.shape)}")
    if dt_bias is not None and tuple(dt_bias.shape) not in ((h, p), (h,)):
        bad(f"dt_bias must be (h, p) = {(h, p)} (as mamba_ssm) or (h,), got {tuple(dt_bias.shape)}")
    if state_batch_indices is not None and tuple(state_batch_indices.shape) != (b,):
        bad(f"state_batch_indices must be (b,) = ({b},), got {tuple(state_batch_indices.shape)}")


def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                           state_batch_indices=None, backend=None):
    """mamba_ssm's ``selective_state_update``: one token, ``state`` updated in place, the output returned.

    state (b, h, p, n) (or (b, p, n) without heads); x, dt, z (b, h, p); A (h, p, n); B, C (b, g, n) (or (b, n): one
    group); D, dt_bias (h, p), or (h,) for one per head; ``state_batch_indices`` (b,): the state rows this batch
    updates. Returns out (b, h, p) in x's dtype. Differentiable (mamba_ssm's is not): gradients reach x, dt, A, B, C,
    D, z, dt_bias and the state's value before the update.
    """
    if not isinstance(state, torch.Tensor):
        raise ValueError(f"selective_state_update: state must be a tensor, got {type(state).__name__}")
    if state.dim() not in (3, 4):
        raise ValueError(f"selective_state_update: state must be (b, h, p, n) (or (b, p, n) without heads), "
                         f"got {tuple(state.shape)}")
    heads = state.dim() == 4
    if not heads:  # (b, p, n): one head (non-tensors left for _check_step to name)
        def one(t, dim):
            return t.unsqueeze(dim) if isinstance(t, torch.Tensor) else t

        state, x, dt, A = one(state, 1), one(x, 1), one(dt, 1), one(A, 0)
        D, z, dt_bias = one(D, 0), one(z, 1), one(dt_bias, 0)
    # B, C (b, n): one group, with or without heads (mamba_ssm's rule: a 2-D B or C gets its group dim, whatever the
    # state's rank; a (b, g, n) one is kept)
    B, C = (t.unsqueeze(1) if isinstance(t, torch.Tensor) and t.dim() == 2 else t for t in (B, C))
    _check_step(state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices)
    b, h, p = x.shape
    if dt_bias is not None and dt_bias.dim() == 1:  # one bias per head (Mamba-2's parameter): tied, stride 0
        dt_bias = dt_bias[:, None].expand(h, p)
    if state_batch_indices is not None and state_batch_indices.numel():
        # a negative index would wrap to another sequence's row (-1: the last), a large one is out of the pool: an
        # error (asynchronous on CUDA, no host synchronisation), before anything is read or written
        sbi = state_batch_indices
        torch._assert_async(((sbi >= 0) & (sbi < state.shape[0])).all(),
                            f"selective_state_update: state_batch_indices must lie in [0, {state.shape[0]}) "
                            "(the state's rows)")
    rows = state if state_batch_indices is None else state[state_batch_indices]
    if rows is state and torch.is_grad_enabled() and any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in (state, x, dt, A, B, C, D, z, dt_bias)):
        # the step's autograd saves the state it read, which the in-place update below overwrites (backward then
        # raised "modified by an inplace operation"): read a copy of it (indexing by state_batch_indices copies)
        rows = state.clone()
    if rows.shape[:3] != (b, h, p) or A.shape != (h, p, rows.shape[3]) or dt.shape != x.shape:
        raise ValueError(f"selective_state_update: state {tuple(rows.shape)}, x {tuple(x.shape)}, dt {tuple(dt.shape)} "
                         f"and A {tuple(A.shape)} must be (b, h, p, n), (b, h, p), (b, h, p) and (h, p, n)")
    if _tied(dt, [2]) and _tied(A, [1, 2]) and _tied(dt_bias, [1]):  # Mamba-2: one dt and A per head: ssd_step
        from kernels import ssd_step

        # no dt_limit here: mamba_ssm's step has none (a negative dt without softplus stays negative)
        d = _dt_processed(dt[..., 0], None if dt_bias is None else dt_bias[:, 0], dt_softplus, (-math.inf, math.inf))
        y, new = ssd_step(rows, x, d, _fp32(A[:, 0, 0]), B, C, D=D, backend=backend)
    else:  # per-channel dt or A (Mamba-1 style): plain PyTorch
        d = _fp32(dt) + (0 if dt_bias is None else _fp32(dt_bias))
        d = F.softplus(d) if dt_softplus else d
        Bh = expand_groups(_fp32(B)[:, None], h)[:, 0, :, None, :]  # (b, h, 1, n)
        Ch = expand_groups(_fp32(C)[:, None], h)[:, 0, :, None, :]
        new = torch.exp(d[..., None] * _fp32(A)) * _fp32(rows) + (d * _fp32(x))[..., None] * Bh
        y = (new * Ch).sum(-1)
        if D is not None:
            Dv = _fp32(D)
            y = y + (Dv[:, None] if Dv.dim() == 1 else Dv) * _fp32(x)  # D (h,): one per head, over its p channels
        y = y.to(x.dtype)
    with torch.no_grad():
        if state_batch_indices is None:
            state.copy_(new)
        else:
            state[state_batch_indices] = new.to(state.dtype)
    if z is not None:
        y = (_fp32(y) * F.silu(_fp32(z))).to(x.dtype)
    return y if heads else y[:, 0]
