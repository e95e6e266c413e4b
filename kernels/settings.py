"""The kernels' environment switches (``HMSCALE_SSD_*``), read at most once per SSD call, and the glue kernels'
tile overrides (``tile_config``).

One forward+backward consults ~30 switches (about 23 us of host time when each is an ``os.environ`` lookup). Inside
``env_frozen()`` (the SSD entry points open it) each name is looked up once and remembered until the block ends;
outside it every read goes to ``os.environ``. The memo lives in a ``contextvars.ContextVar``, so threads (autograd's
backward thread included) never share one. Inside a ``torch.compile`` trace (which cannot trace a ContextVar) reads
go straight to ``os.environ`` and ``env_frozen`` does nothing.

``switch_cached`` memoises a pure function of its arguments and of the switches (the SSD's per-call launch plans):
its key holds the current value of every switch ``env`` has ever been asked for, so setting, changing or removing
one makes the next call compute afresh.
"""

from __future__ import annotations

import contextvars
import functools
import os
from contextlib import contextmanager

import torch

_MEMO: contextvars.ContextVar = contextvars.ContextVar("hmscale_kernel_env", default=None)
# every switch env() has been asked for -> its key in os.environ's underlying mapping (switches_fingerprint)
_SEEN: dict = {}
_ENV_DATA = getattr(os.environ, "_data", None)  # CPython's os.environ keeps its (encoded) entries here
_ENCODE = getattr(os.environ, "encodekey", None)


def env(name: str, default: str | None = None) -> str | None:
    """``os.environ.get(name, default)``, memoised inside ``env_frozen()``. Inside a ``torch.compile`` trace the name
    is not recorded either: a traced dict mutation made Dynamo (torch 2.11) fail its own guard on ``_SEEN`` ("Guard
    failed on the same frame it was created"); the launch plans, computed outside traces, record what they read."""
    if torch.compiler.is_compiling():
        return os.environ.get(name, default)
    if name not in _SEEN:
        _SEEN[name] = _ENCODE(name) if _ENV_DATA is not None and _ENCODE is not None else name
    memo = _MEMO.get()
    if memo is None:
        return os.environ.get(name, default)
    if name not in memo:
        memo[name] = os.environ.get(name)
    v = memo[name]
    return default if v is None else v


@contextmanager
def env_frozen():
    """Read each switch at most once until the block ends (nested blocks share the outer memo)."""
    if torch.compiler.is_compiling() or _MEMO.get() is not None:
        yield
        return
    token = _MEMO.set({})
    try:
        yield
    finally:
        _MEMO.reset(token)


def switches_fingerprint() -> tuple:
    """The current raw values (None where unset) of every switch ``env`` has been asked for, in first-asked order:
    ~1 us for the SSD's ~30 switches, read from os.environ's own mapping where CPython has one."""
    if _ENV_DATA is not None and _ENCODE is not None:
        return tuple(map(_ENV_DATA.get, _SEEN.values()))
    return tuple(map(os.environ.get, _SEEN))


_CACHE_LIMIT = 256  # entries per cached function (a plan per call shape; cleared whole when full)


def switch_cached(fn):
    """Memoise ``fn(*args)`` (hashable positional arguments) together with the switches' values. The key's
    fingerprint is taken before the call: a call that reads a switch for the first time stores its result under a
    fingerprint that no later call can have (later ones are longer), so the next call computes it again and the
    entry after it is the one that serves. A result is not stored when a switch it may have read changed during the
    call (another thread setting os.environ): it answers that call only. Errors are not cached.
    ``fn.cache_clear()`` empties the memo."""
    memo: dict = {}

    @functools.wraps(fn)
    def cached(*args):
        fp = switches_fingerprint()
        key = (args, fp)
        got = memo.get(key)
        if got is None:
            got = fn(*args)
            if switches_fingerprint()[:len(fp)] == fp:
                if len(memo) >= _CACHE_LIMIT:
                    memo.clear()
                memo[key] = got
        return got

    cached.cache_clear = memo.clear
    return cached


def tile_config(var: str, defaults: dict, forms: str) -> dict:
    """``defaults`` ({name: tuple of ints}) with the entries that ``var="name=v,v,..;name=.."`` gives replaced (each
    with all its integers); a one-line ValueError naming ``var`` and the ``forms`` it accepts otherwise."""
    cfg = dict(defaults)
    for item in filter(None, (s.strip() for s in os.environ.get(var, "").split(";"))):
        name, _, vals = item.partition("=")
        name, parts = name.strip(), vals.split(",")
        if name not in cfg or len(parts) != len(cfg[name]) or not all(v.strip().isdigit() for v in parts):
            raise ValueError(f"{var}: {item!r} is not {forms} (integers)")
        cfg[name] = tuple(int(v) for v in parts)
    return cfg
