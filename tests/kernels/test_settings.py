"""kernels.settings: switches read once inside env_frozen (per SSD call), straight from os.environ outside it."""

import os

import pytest
import torch

from kernels import settings
from kernels.settings import env, env_frozen


def test_env_reads_live_outside_and_once_inside_a_frozen_block(monkeypatch):
    monkeypatch.setenv("HMSCALE_SSD_TEST_SWITCH", "a")
    assert env("HMSCALE_SSD_TEST_SWITCH", "d") == "a"
    monkeypatch.setenv("HMSCALE_SSD_TEST_SWITCH", "b")
    assert env("HMSCALE_SSD_TEST_SWITCH", "d") == "b"  # outside a block: every read is live
    with env_frozen():
        assert env("HMSCALE_SSD_TEST_SWITCH", "d") == "b"
        monkeypatch.setenv("HMSCALE_SSD_TEST_SWITCH", "c")
        assert env("HMSCALE_SSD_TEST_SWITCH", "d") == "b"  # remembered for the rest of the call
        with env_frozen():  # nested: the same memo
            assert env("HMSCALE_SSD_TEST_SWITCH", "d") == "b"
        monkeypatch.delenv("HMSCALE_SSD_TEST_ABSENT", raising=False)
        assert env("HMSCALE_SSD_TEST_ABSENT", "dflt") == "dflt"
        monkeypatch.setenv("HMSCALE_SSD_TEST_ABSENT", "now")
        assert env("HMSCALE_SSD_TEST_ABSENT", "dflt") == "dflt"  # absence is remembered too
    assert env("HMSCALE_SSD_TEST_SWITCH", "d") == "c"  # the next call sees the change
    assert env("HMSCALE_SSD_TEST_ABSENT", "dflt") == "now"


def test_switch_cached_recomputes_when_a_switch_it_read_changes(monkeypatch):
    from kernels.settings import switch_cached

    calls = []

    @switch_cached
    def plan(k):
        calls.append(k)
        return (k, env("HMSCALE_SSD_TEST_PLAN", "dflt"))

    monkeypatch.delenv("HMSCALE_SSD_TEST_PLAN", raising=False)
    # the first call reads the switch for the first time: its entry's fingerprint is shorter than any later one
    assert plan(1) == (1, "dflt")
    assert plan(1) == (1, "dflt") and plan(1) == (1, "dflt")
    assert len(calls) == 2  # computed again once the switch is known, then served
    monkeypatch.setenv("HMSCALE_SSD_TEST_PLAN", "x")
    assert plan(1) == (1, "x") and plan(1) == (1, "x")
    monkeypatch.setenv("HMSCALE_SSD_TEST_PLAN", "y")
    assert plan(1) == (1, "y")
    assert plan(2) == (2, "y")
    monkeypatch.delenv("HMSCALE_SSD_TEST_PLAN")
    assert plan(1) == (1, "dflt")  # the unset switch's entry again
    assert calls == [1, 1, 1, 1, 2]


def test_switch_cached_does_not_keep_a_result_whose_switches_changed_during_the_call(monkeypatch):
    """Another thread setting a switch while a plan is computed: that plan answers its own call but is not stored
    under the key taken before the change (it may hold the new value, the key the old one)."""
    from kernels.settings import switch_cached

    calls = []

    @switch_cached
    def plan(k):
        calls.append(k)
        v = env("HMSCALE_SSD_TEST_RACE", "a")
        if len(calls) == 2:
            os.environ["HMSCALE_SSD_TEST_RACE"] = "b"  # (as another thread would, between the key and this read)
        return v

    monkeypatch.setenv("HMSCALE_SSD_TEST_RACE", "a")
    plan(0)  # the switch's first read: known from now on
    assert plan(0) == "a" and calls == [0, 0]  # the switch changed during this call: not stored under "a"
    monkeypatch.setenv("HMSCALE_SSD_TEST_RACE", "a")
    assert plan(0) == "a" and plan(0) == "a" and calls == [0, 0, 0]  # computed again, then served


def test_switch_cached_does_not_keep_errors(monkeypatch):
    from kernels.settings import switch_cached

    @switch_cached
    def parse():
        v = env("HMSCALE_SSD_TEST_PARSE", "1")
        if not v.isdigit():
            raise ValueError(f"HMSCALE_SSD_TEST_PARSE must be an integer, got {v!r}")
        return int(v)

    monkeypatch.setenv("HMSCALE_SSD_TEST_PARSE", "x")
    for _ in range(2):
        with pytest.raises(ValueError, match="must be an integer"):
            parse()
    monkeypatch.setenv("HMSCALE_SSD_TEST_PARSE", "7")
    assert parse() == 7


def test_a_switch_read_in_a_trace_and_by_an_op_while_tracing_compiles(monkeypatch):
    """A switch (bwd_variant's) read inside a torch.compile trace and, during the same trace, eagerly by an op's fake
    (shape) function, as the SSD's launch plans read theirs: the compiled function runs. When the traced read recorded
    the switch's name (until f6c68ca) Dynamo guarded on the registry not holding it, the eager read added it, and
    Dynamo raised "Guard failed on the same frame it was created" (torch 2.11 on the H200, 2026-12-07; 2.13 here)."""
    from kernels.ssd_triton_fwd import bwd_variant

    monkeypatch.delenv("HMSCALE_SSD_BWD", raising=False)
    monkeypatch.delitem(settings._SEEN, "HMSCALE_SSD_BWD", raising=False)  # (put back after the test)

    @torch.library.custom_op("hmscale_test::switch_reading_op", mutates_args=())
    def op(x: torch.Tensor) -> torch.Tensor:
        bwd_variant()
        return x * 2

    @op.register_fake
    def _(x):
        bwd_variant()  # eager, while Dynamo traces f
        return torch.empty_like(x)

    def f(x):
        return op(x) + 1 if bwd_variant() == "v2" else x - 1

    torch._dynamo.reset()
    out = torch.compile(f, backend="eager", fullgraph=True)(torch.ones(2))
    assert torch.equal(out, torch.full((2,), 3.0))
    assert "HMSCALE_SSD_BWD" in settings._SEEN  # recorded by the reads outside the trace
