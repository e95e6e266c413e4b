"""kernels.launch: which launches reuse a remembered compiled kernel, and the arguments its launcher gets.

Triton itself is replaced by a stand-in with the same surface (``fn[grid](...)`` returning a compiled kernel whose
``run`` takes grid, stream, function, metadata, three hook slots, then every parameter in signature order), and the
tensors by CPU tensors that report ``is_cuda``: the real launches run on the H200 (benchmarks/ssd_gpu_check.py and
benchmarks/ssd_host.py).
"""

from __future__ import annotations

import pytest
import torch

from kernels import launch as L


def _kernel(x_ptr, y_ptr, n, BLOCK, FLAG=False):  # the signature the stand-in JIT function wraps
    pass


class FakeCompiled:
    def __init__(self, log):
        self.log = log
        self.function = "cufunction"
        self.packed_metadata = "meta"

    def run(self, *a):
        self.log.append(("direct",) + a)


class FakeJIT:
    fn = staticmethod(_kernel)

    def __init__(self):
        self.log = []
        self.compiled = FakeCompiled(self.log)

    def __getitem__(self, grid):
        def go(*args, **kwargs):
            self.log.append(("jit", grid, args, kwargs))
            return self.compiled
        return go


class CudaLike(torch.Tensor):
    """A CPU tensor that says it is on CUDA (the launcher reads only is_cuda, dtype and data_ptr)."""

    @property
    def is_cuda(self):
        return True


def _t(n=64, dtype=torch.float32, offset=0):
    base = torch.zeros(n + offset, dtype=dtype)
    return base[offset:].as_subclass(CudaLike)


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(L, "_INTERPRETING", False)
    monkeypatch.setattr(L, "_hooks_installed", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda dev: 1234, raising=False)
    monkeypatch.delenv("HMSCALE_SSD_LAUNCH", raising=False)
    L.clear_launch_cache()
    L.launch_counts(reset=True)
    yield
    L.clear_launch_cache()


def test_second_launch_is_direct_with_tail_in_signature_order(fake_cuda):
    fn = FakeJIT()
    x, y = _t(), _t()
    L.launch(fn, (4, 2), x, y, 64, BLOCK=16, num_warps=4)
    L.launch(fn, (8,), x, y, 64, BLOCK=16, num_warps=4)
    assert [e[0] for e in fn.log] == ["jit", "direct"]
    assert L.launch_counts(reset=True) == {"direct": 1, "jit": 1}
    assert L.launch_counts() == {"direct": 0, "jit": 0}
    direct = fn.log[1]
    # grid padded to 3 dims, the stream of the current device, function, metadata, no hooks, args + (BLOCK, FLAG)
    assert direct[1:4] == (8, 1, 1)
    assert direct[4:10] == (1234, "cufunction", "meta", None, None, None)
    assert direct[10:] == (x, y, 64, 16, False)


@pytest.mark.parametrize("change", ["int", "constexpr", "option", "dtype", "alignment"])
def test_what_triton_specialises_on_makes_a_new_entry(fake_cuda, change):
    fn = FakeJIT()
    x, y = _t(), _t()
    L.launch(fn, (1,), x, y, 64, BLOCK=16, num_warps=4)
    args, kw = [x, y, 64], dict(BLOCK=16, num_warps=4)
    if change == "int":
        args[2] = 65
    elif change == "constexpr":
        kw["BLOCK"] = 32
    elif change == "option":
        kw["num_warps"] = 8
    elif change == "dtype":
        args[1] = _t(dtype=torch.bfloat16)
    else:
        args[1] = _t(offset=1)  # 4 bytes past a 16-byte boundary
        assert args[1].data_ptr() % 16 != 0
    L.launch(fn, (1,), *args, **kw)
    assert [e[0] for e in fn.log] == ["jit", "jit"]
    L.launch(fn, (1,), *args, **kw)
    assert fn.log[-1][0] == "direct"


def test_same_specialisation_other_tensors_reuses(fake_cuda):
    fn = FakeJIT()
    L.launch(fn, (1,), _t(), _t(), 64, BLOCK=16)
    a, b = _t(), _t()
    L.launch(fn, (1,), a, b, 64, BLOCK=16)
    assert fn.log[-1][0] == "direct" and fn.log[-1][10:12] == (a, b)


def test_ordinary_path_when_off_or_not_cuda(fake_cuda, monkeypatch):
    fn = FakeJIT()
    L.launch(fn, (1,), torch.zeros(4), torch.zeros(4), 4, BLOCK=16)
    L.launch(fn, (1,), torch.zeros(4), torch.zeros(4), 4, BLOCK=16)
    assert [e[0] for e in fn.log] == ["jit", "jit"]  # CPU tensors: always fn[grid]
    monkeypatch.setenv("HMSCALE_SSD_LAUNCH", "jit")
    x, y = _t(), _t()
    for _ in range(2):
        L.launch(fn, (1,), x, y, 4, BLOCK=16)
    assert [e[0] for e in fn.log] == ["jit"] * 4
    monkeypatch.setenv("HMSCALE_SSD_LAUNCH", "fast")
    with pytest.raises(ValueError, match="HMSCALE_SSD_LAUNCH must be direct or jit"):
        L.launch(fn, (1,), x, y, 4, BLOCK=16)


def test_hooks_or_unknown_kernel_layout_keep_the_ordinary_path(fake_cuda, monkeypatch):
    fn = FakeJIT()
    x, y = _t(), _t()
    monkeypatch.setattr(L, "_hooks_installed", lambda: True)
    for _ in range(2):
        L.launch(fn, (1,), x, y, 4, BLOCK=16)
    assert [e[0] for e in fn.log] == ["jit", "jit"]
    monkeypatch.setattr(L, "_hooks_installed", lambda: False)
    fn2 = FakeJIT()
    del fn2.compiled.packed_metadata
    for _ in range(2):
        L.launch(fn2, (1,), x, y, 4, BLOCK=16)
    assert [e[0] for e in fn2.log] == ["jit", "jit"]


def test_missing_required_parameter_is_left_to_triton(fake_cuda):
    fn = FakeJIT()
    x, y = _t(), _t()
    for _ in range(2):
        L.launch(fn, (1,), x, y, 4)  # BLOCK missing: never remembered, Triton raises its own error
    assert [e[0] for e in fn.log] == ["jit", "jit"]


def test_hooks_installed_reads_tritons_hook_chains(monkeypatch):
    """With Triton's own knobs: no hooks by default (3.6+ keeps empty HookChains, which must not count), and a
    hook added by a profiler switches the direct path off."""
    knobs = pytest.importorskip("triton").knobs
    assert L._hooks_installed() is False
    hook = knobs.runtime.launch_enter_hook
    if hasattr(hook, "add"):
        hook.add(print)
        try:
            assert L._hooks_installed() is True
        finally:
            hook.remove(print)
    else:  # pragma: no cover - a Triton that keeps a plain callable
        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", print)
        assert L._hooks_installed() is True
    assert L._hooks_installed() is False
