"""Shared input builders for the kernels tests (random, never zeros), and where the Triton tests run."""

from __future__ import annotations

import os

import pytest
import torch

# The Triton tests: under TRITON_INTERPRET=1 on CPU, or on a GPU
needs_triton = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                  reason="needs TRITON_INTERPRET=1 or a GPU")
TRITON_DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


def make_inputs(b, l, h, g, p, n, *, dtype=torch.float64, normalize=False, D=False, init=False,
                seq=False, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rn(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float64)

    x = rn(b, l, h, p)
    dt = torch.rand(b, l, h, generator=gen, dtype=torch.float64) * 0.5 + 0.05
    A = -(torch.rand(h, generator=gen, dtype=torch.float64) + 0.05)
    if normalize:
        B = torch.softmax(rn(b, l, g, n), -1)
        C = torch.softmax(rn(b, l, g, n), -1)
    else:
        B = rn(b, l, g, n) / n ** 0.5
        C = rn(b, l, g, n) / n ** 0.5
    kw = {}
    if D:
        kw["D"] = rn(h)
    if init:
        s = rn(b, h, p + int(normalize), n)
        if normalize:
            s[:, :, -1] = s[:, :, -1].abs() / n
        kw["initial_state"] = s
    seq_idx = None
    if seq:
        seq_idx = torch.zeros(b, l, dtype=torch.int32)
        for i in range(b):
            for c in sorted(torch.randint(1, l, (2,), generator=gen).tolist()):
                seq_idx[i, c:] += 1
        seq_idx[0, -1] += 3  # a one-token document at the very end
    tensors = dict(x=x, dt=dt, A=A, B=B, C=C, **kw)
    out = {}
    for k, v in tensors.items():
        out[k] = v if k in ("dt", "A", "D", "initial_state") else v.to(dtype)
        if k in ("dt", "A", "D", "initial_state") and dtype != torch.float64:
            out[k] = v.float()
    return out, seq_idx


def rel(a, b):
    a = a.detach().double().cpu()
    b = b.detach().double().cpu()
    return ((a - b).norm() / b.norm()).item()


def on_triton_device(ins: dict, seq_idx=None):
    """The inputs of :func:`make_inputs` moved to where the Triton kernels run (the GPU, or the CPU under the
    interpreter)."""
    moved = {k: v.to(TRITON_DEVICE) for k, v in ins.items()}
    return moved, None if seq_idx is None else seq_idx.to(TRITON_DEVICE)


def fused_and_plain(monkeypatch, module, name: str, run):
    """``run()`` with the kernels' backend forced to Triton, then to torch; checks that ``module.name`` (the
    Triton function) was called by the first run only. Returns both results."""
    calls = []
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a: calls.append(1) or real(*a))
    monkeypatch.setenv("HMSCALE_SSD_BACKEND", "triton")
    fused = run()
    assert calls == [1], f"{name} was not called with the Triton backend"
    monkeypatch.setenv("HMSCALE_SSD_BACKEND", "torch")
    plain = run()
    assert calls == [1], f"{name} was called with the torch backend"
    return fused, plain
