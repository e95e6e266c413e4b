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


def test_env_inside_a_compile_trace_reads_the_environment_and_records_nothing(monkeypatch):
    """A switch first read inside a torch.compile trace: the traced function sees the environment's value, and the
    switch registry is not mutated by the trace (on torch 2.11 that mutation made Dynamo fail its own guard, "Guard
    failed on the same frame it was created", and stopped the compiled stage-2 benchmark on the H200)."""
    name = "HMSCALE_TEST_SWITCH_FIRST_READ_IN_A_TRACE"
    monkeypatch.setenv(name, "b")

    def f(x):
        return x + 1 if settings.env(name, "a") == "b" else x - 1

    torch._dynamo.reset()
    out = torch.compile(f, backend="eager", fullgraph=True)(torch.ones(2))
    assert torch.equal(out, torch.full((2,), 2.0))
    assert name not in settings._SEEN
    assert settings.env(name, "a") == "b" and name in settings._SEEN  # recorded by the first read outside a trace
