"""Launching the SSD's Triton kernels with less host work than ``fn[grid](*args, **kwargs)``.

``fn[grid](...)`` binds the arguments, specialises every one of them (dtype, 16-byte alignment, integer
divisibility), builds a cache key from that and the options, looks the compiled kernel up, checks the kernel's
globals and asks the driver for the current device and stream: 12-32 us of host time for a 4-argument kernel and
25-48 us for a 32-argument one on the H200 machines' hosts (``benchmarks/ssd_host.py --launch-cost``). One SSD
fwd+bwd issues 5-7 such launches; at the 410m shape the call is host-bound (0.8-1.7 ms of host time for 0.64 ms of
kernels), though mostly through torch-side work: this path saves ~5 us per launch (25.2 -> 19.8 us for 32
arguments, 410m host 850 -> 817 us per call; BENCHMARKS.md).

:func:`launch` keeps, per kernel, the compiled kernels it has launched, keyed by what Triton specialises on:
each tensor argument's dtype and whether its address is 16-byte aligned, every other argument's value (the
integer arguments here are shapes and strides, so their values also fix Triton's divisibility
specialisation) and the constexpr keyword arguments with ``num_warps`` / ``num_stages``. The first launch of a
key goes through ``fn[grid]`` (which compiles if needed) and remembers the compiled kernel it returns; later
launches call the compiled kernel's launcher directly with the arguments in signature order.

Used only where it is safe: real CUDA launches (not the CPU interpreter), no Triton launch hooks installed
(profilers that use them get the ordinary path), and a Triton whose compiled kernels have the launcher layout
this module calls (checked once per kernel; otherwise the ordinary path). ``HMSCALE_SSD_LAUNCH=jit`` turns it off.
"""

from __future__ import annotations

import inspect
import os

import torch

from .settings import env

__all__ = ["launch", "launch_mode", "clear_launch_cache", "launch_counts"]

_CACHE: dict = {}  # fn -> {key: (compiled kernel, constexpr/default tail in signature order)}
_TAILS: dict = {}  # fn -> (names of the parameters, their defaults)
_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")
_COUNTS = {"direct": 0, "jit": 0}


def launch_mode() -> str:
    """``HMSCALE_SSD_LAUNCH``: ``direct`` (default: remembered compiled kernels, see the module docstring) or
    ``jit`` (every launch through ``fn[grid]``)."""
    v = env("HMSCALE_SSD_LAUNCH", "direct").lower()
    if v not in ("direct", "jit"):
        raise ValueError(f"HMSCALE_SSD_LAUNCH must be direct or jit, got {v!r}")
    return v


def clear_launch_cache() -> None:
    _CACHE.clear()


def launch_counts(reset: bool = False) -> dict:
    """How many launches went each way since the last reset: ``{"direct": n, "jit": m}``."""
    out = dict(_COUNTS)
    if reset:
        _COUNTS.update(direct=0, jit=0)
    return out


_INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"  # read by Triton when it is imported, as here


def _hooks_installed() -> bool:
    try:
        from triton import knobs
    except ImportError:  # pragma: no cover - older Triton: no knobs, always the ordinary path
        return True
    rt = knobs.runtime
    return _hook_set(rt.launch_enter_hook) or _hook_set(rt.launch_exit_hook)


def _hook_set(hook) -> bool:
    """Whether a launch hook does anything: Triton 3.6+ keeps each as a ``HookChain`` (never None; empty unless
    a profiler added a call), older ones as a callable or None."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return bool(calls) if calls is not None else True


def _spec(args) -> tuple:
    """What Triton specialises a launch on, per argument (its value for ints and bools, which here are shapes,
    strides and flags; only the type for floats, which Triton does not specialise)."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append((a.dtype, a.data_ptr() & 15 == 0))
        elif isinstance(a, float):
            out.append(float)
        else:
            out.append(a)
    return tuple(out)


def _params(fn):
    """(names, defaults) of fn's parameters in signature order (defaults ``inspect.Parameter.empty`` if none)."""
    got = _TAILS.get(fn)
    if got is None:
        sig = inspect.signature(fn.fn)
        got = (tuple(sig.parameters), tuple(p.default for p in sig.parameters.values()))
        _TAILS[fn] = got
    return got


def _tail(fn, n_args: int, kwargs: dict) -> tuple | None:
    """The values after the positional arguments, in signature order (keyword, else default), or None when a
    parameter has neither (let Triton raise its own error)."""
    names, defaults = _params(fn)
    out = []
    for name, default in zip(names[n_args:], defaults[n_args:]):
        if name in kwargs:
            out.append(kwargs[name])
        elif default is inspect.Parameter.empty:
            return None
        else:
            out.append(default)
    return tuple(out)


def _launchable(kernel) -> bool:
    return all(hasattr(kernel, a) for a in ("run", "function", "packed_metadata"))


def launch(fn, grid: tuple, *args, **kwargs) -> None:
    """``fn[grid](*args, **kwargs)``, with the compiled kernel remembered per specialisation (module docstring)."""
    if (_INTERPRETING or launch_mode() != "direct" or not args or not isinstance(args[0], torch.Tensor)
            or not args[0].is_cuda or _hooks_installed()):
        _COUNTS["jit"] += 1
        fn[grid](*args, **kwargs)
        return
    per_fn = _CACHE.get(fn)
    if per_fn is None:
        per_fn = _CACHE[fn] = {}
    dev = torch.cuda.current_device()  # as Triton: compiled kernels and streams are per current device
    key = (dev, _spec(args), tuple(kwargs.items()))
    hit = per_fn.get(key)
    if hit is None:
        _COUNTS["jit"] += 1
        kernel = fn[grid](*args, **kwargs)
        params = {k: v for k, v in kwargs.items() if k not in _OPTIONS}
        tail = _tail(fn, len(args), params)
        if tail is not None and _launchable(kernel):
            per_fn[key] = (kernel, tail)
        return
    kernel, tail = hit
    _COUNTS["direct"] += 1
    stream = torch._C._cuda_getCurrentRawStream(dev)
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    kernel.run(grid[0], g1, g2, stream, kernel.function, kernel.packed_metadata, None, None, None, *args, *tail)
