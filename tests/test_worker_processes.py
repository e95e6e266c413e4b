"""Local worker processes: CPU workers come from a fork server that imported the heavy modules once, yet each runs
with its caller's environment and directory as of its start; GPU workers are spawned."""

import json
import os
import sys

import pytest

from hmscale.train.launch import spawn_workers
from hmscale.worker_processes import PRELOAD, start_method


def _report(rank, out_dir):
    seen = {
        "preloaded_before_use": [m for m in PRELOAD if m in sys.modules],
        "ppid": os.getppid(),
        "var": os.environ.get("HMSCALE_TEST_WORKER_VAR"),
        "gone": "HMSCALE_TEST_WORKER_GONE" in os.environ,
        "cwd": os.getcwd(),
        "rank_env": os.environ["RANK"],
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(seen, f)


def _launch(tmp_path, name):
    out = tmp_path / name
    out.mkdir()
    spawn_workers(_report, 2, str(out))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_cpu_workers_fork_from_the_preloaded_server_with_the_callers_current_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("HMSCALE_TEST_WORKER_VAR", "first")
    monkeypatch.setenv("HMSCALE_TEST_WORKER_GONE", "1")
    first = _launch(tmp_path, "a")
    # what changes in the caller after the server started reaches the next workers (the server keeps its own)
    monkeypatch.setenv("HMSCALE_TEST_WORKER_VAR", "second")
    monkeypatch.delenv("HMSCALE_TEST_WORKER_GONE")
    monkeypatch.chdir(tmp_path)
    second = _launch(tmp_path, "b")
    for rows, var, gone in ((first, "first", True), (second, "second", False)):
        assert [r["rank_env"] for r in rows] == ["0", "1"]
        for r in rows:
            assert r["var"] == var and r["gone"] is gone
            assert r["preloaded_before_use"] == PRELOAD  # imported by the server, not by the worker
            assert r["ppid"] != os.getpid()  # the server's child, not this process's
    assert {r["ppid"] for r in first + second} == {first[0]["ppid"]}  # one server for both launches
    assert second[0]["cwd"] == str(tmp_path) != first[0]["cwd"]


@pytest.mark.parametrize("use_gpu, method", [(False, "forkserver"), (True, "spawn")])
def test_gpu_workers_are_spawned_and_cpu_workers_forked_from_the_server(use_gpu, method):
    assert start_method(use_gpu) == method
