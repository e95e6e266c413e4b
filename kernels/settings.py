"""The kernels' environment switches (``HMSCALE_SSD_*``), read at most once per SSD call, and the glue kernels'
tile overrides (``tile_config``).

One forward+backward consults ~30 switches (about 23 us of host time when each is an ``os.environ`` lookup). Inside
``env_frozen()`` (the SSD entry points open it) each name is looked up once and remembered until the block ends;
outside it every read goes to ``os.environ``. The memo lives in a ``contextvars.ContextVar``, so threads (autograd's
backward thread included) never share one. Inside a ``torch.compile`` trace (which cannot trace a ContextVar) reads
go straight to ``os.environ`` and ``env_frozen`` does nothing.
"""

from __future__ import annotations

import contextvars
import os
from contextlib import contextmanager

import torch

_MEMO: contextvars.ContextVar = contextvars.ContextVar("hmscale_kernel_env", default=None)


def env(name: str, default: str | None = None) -> str | None:
    """``os.environ.get(name, default)``, memoised inside ``env_frozen()``."""
    if torch.compiler.is_compiling():
        return os.environ.get(name, default)
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
