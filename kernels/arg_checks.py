"""Argument checks shared by the SSD scan and its decode step (``chunked_torch.check_ssd_args``,
``step_torch.check_step_args``): shapes, dtypes and devices only, never tensor data (no host synchronisation); each
failure is one ``ValueError`` line that starts with the public function's name."""

from __future__ import annotations

import torch


def fail(fn: str, msg: str):
    raise ValueError(f"{fn}: {msg}")


def check_tensors(fn: str, named: tuple, ref_name: str, ref: torch.Tensor, optional=(), integer=()) -> None:
    """Each ``(name, value)`` of ``named`` is a tensor (``optional`` ones may be None), floating-point (``integer``
    ones may be integer), on ``ref``'s device (``ref`` itself first: the others are compared with it)."""
    if not isinstance(ref, torch.Tensor):
        fail(fn, f"{ref_name} must be a tensor, got {type(ref).__name__}")
    for name, t in named:
        if t is None and name in optional:
            continue
        if not isinstance(t, torch.Tensor):
            fail(fn, f"{name} must be a tensor, got {type(t).__name__}")
        if name not in integer and not t.is_floating_point():
            fail(fn, f"{name} must be a floating-point tensor, got {t.dtype}")
        if t.device != ref.device:
            fail(fn, f"{name} is on {t.device} but {ref_name} is on {ref.device}: put every tensor on one device")


def check_decay(fn: str, A: torch.Tensor, h: int) -> None:
    """A is one decay rate per head, (h,)."""
    if tuple(A.shape) != (h,):
        hint = f"; one decay per head: A.reshape({h})" if A.numel() == h else (
            "; one decay per head (a per-channel A is Mamba-1's: kernels.compat.selective_state_update takes it)"
            if A.dim() == 3 else "")
        fail(fn, f"A must be (h,) = ({h},), got {tuple(A.shape)}{hint}")
