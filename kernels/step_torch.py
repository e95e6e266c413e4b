"""One-token SSD decode step in plain PyTorch: ``S <- exp(dt A) S + dt x B^T``, ``y = S C`` (+ D x), optional
normaliser; and the decode step's argument check. No Triton here: the CPU decode path (the model's generation on a
machine where Triton does not install) imports only this module. ``kernels.step`` holds the fused Triton step.
"""

from __future__ import annotations

import torch

from .arg_checks import check_decay, check_tensors, fail
from .reference import expand_groups

__all__ = ["ssd_step_torch", "check_step_args"]


def check_step_args(state, x_t, dt_t, A, B_t, C_t, D=None, normalize=False, fn="ssd_step") -> None:
    """The contract of :func:`kernels.ssd_step` on shapes, dtypes and devices, checked before any work: a one-line
    ``ValueError`` naming the argument and what to pass. Reads no tensor data (no host synchronisation)."""

    def bad(msg):
        fail(fn, msg)

    check_tensors(fn, (("state", state), ("x_t", x_t), ("dt_t", dt_t), ("A", A), ("B_t", B_t), ("C_t", C_t), ("D", D)),
                  "x_t", x_t, optional=("D",))
    if x_t.dim() != 3:
        hint = "; one token: pass x[:, t] of the (b, l, h, p) sequence" if x_t.dim() == 4 else ""
        bad(f"x_t must be (b, h, p), got {tuple(x_t.shape)}{hint}")
    b, h, p = x_t.shape
    if tuple(dt_t.shape) != (b, h):
        hint = "; one step per head: dt_t[..., 0]" if dt_t.dim() == 3 and dt_t.shape[:2] == (b, h) else ""
        bad(f"dt_t must be (b, h) = {(b, h)}, got {tuple(dt_t.shape)}{hint}")
    check_decay(fn, A, h)
    for name, t in (("B_t", B_t), ("C_t", C_t)):
        if t.dim() != 3 or t.shape[0] != b or t.shape[1] == 0 or h % t.shape[1] != 0:
            bad(f"{name} must be (b, g, n) with b = {b} and h = {h} a multiple of g, got {tuple(t.shape)}")
    if B_t.shape != C_t.shape:
        bad(f"B_t and C_t must have one shape (b, g, n), got {tuple(B_t.shape)} and {tuple(C_t.shape)}")
    n = B_t.shape[2]
    ps = p + int(bool(normalize))
    if tuple(state.shape) != (b, h, ps, n):
        extra = " (p + 1 rows with normalize=True: the last one is the normaliser's)" if normalize else ""
        bad(f"state must be (b, h, p, n) = {(b, h, ps, n)}{extra}, got {tuple(state.shape)}")
    if D is not None and tuple(D.shape) not in ((h,), (h, p), (h, 1)):
        bad(f"D must be (h,) = ({h},) or (h, p) = {(h, p)}, got {tuple(D.shape)}")


def ssd_step_torch(state, x_t, dt_t, A, B_t, C_t, D=None, normalize=False):
    check_step_args(state, x_t, dt_t, A, B_t, C_t, D, normalize)
    b, h, p = x_t.shape
    cd = torch.float64 if state.dtype == torch.float64 else torch.float32
    xx = x_t.to(cd)
    if normalize:
        xx = torch.cat([xx, torch.ones_like(xx[..., :1])], dim=-1)
    Bh = expand_groups(B_t.unsqueeze(1).to(cd), h)[:, 0]  # (b, h, n)
    Ch = expand_groups(C_t.unsqueeze(1).to(cd), h)[:, 0]
    dtc = dt_t.to(cd)
    decay = torch.exp(dtc * A.to(cd).view(1, h))
    new = decay[..., None, None] * state.to(cd) + (dtc[..., None] * xx)[..., :, None] * Bh[:, :, None, :]
    y = torch.einsum("bhpn,bhn->bhp", new, Ch)
    if normalize:
        y = y[..., :p] / y[..., p:]
    if D is not None:
        Dv = D.to(cd)
        y = y + (Dv[:, None] if Dv.dim() == 1 else Dv) * x_t.to(cd)
    return y.to(x_t.dtype), new.to(state.dtype)
