"""Helpers for the train tests: launch a small multi-process gloo job, tiny fixtures."""

import json
import os
import socket
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
JOB = Path(__file__).with_name("dist_job.py")


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(spec: dict, world: int, tmp: Path, timeout: int = 110, job: Path = JOB):
    """Run `job` (default tests/train/dist_job.py: rank 0's per-run losses) on `world` processes with `spec`;
    returns what rank 0 wrote as JSON to `spec["out"]`. A rank that fails ends the launch at once with its log (its
    peers would wait for it in a collective until the timeout); a port another process took between `_port()` and
    rank 0's bind (the suite runs launches side by side) gets one retry on a fresh port."""
    spec = dict(spec, out=str(tmp / "losses.json"))
    spec_path = tmp / "spec.json"
    spec_path.write_text(json.dumps(spec))
    for attempt in (1, 2):
        codes, logs = _run_ranks(spec_path, world, tmp, timeout, job)
        busy = any(c and ("EADDRINUSE" in log or "address already in use" in log.lower()) for c, log in zip(codes, logs))
        if not (busy and attempt == 1):
            break
    # the rank that failed on its own first (a negative code: stopped by us, or killed)
    for c, r in sorted(((c, r) for r, c in enumerate(codes) if c != 0), key=lambda cr: (cr[0] < 0, cr[1])):
        raise AssertionError(f"rank {r} of {world} exited {c}:\n{logs[r][-4000:]}")
    return json.loads((tmp / "losses.json").read_text())


def _run_ranks(spec_path: Path, world: int, tmp: Path, timeout: float, job: Path):
    """(exit codes, logs) of one launch; output to files (a pipe nobody reads while polling could fill and block)."""
    from tests.forked_python import start_python  # (the ranks fork from the suite's preloaded server: seconds faster)

    port = _port()
    procs = []
    for r in range(world):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
        env.update(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world), LOCAL_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]), HMSCALE_NO_PROGRESS="1")
        log = tmp / f"rank{r}.log"
        log.write_text("")
        procs.append(start_python([job, spec_path], out=log, cwd=REPO, env=env))
    deadline, failed_at = time.time() + timeout, None
    try:
        while any(p.exitcode is None for p in procs):
            now = time.time()
            if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
                failed_at = now  # the others get a moment to report their own error, then are stopped
            if now > deadline or (failed_at is not None and now > failed_at + 10):
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.exitcode is None:
                p.kill()
            p.join()
    logs = [(tmp / f"rank{r}.log").read_text(errors="replace") for r in range(world)]
    if failed_at is None and any(c != 0 for c in (p.exitcode for p in procs)) and time.time() > deadline:
        raise AssertionError(f"the {world}-rank launch did not finish in {timeout} s; rank logs:\n"
                             + "\n".join(f"--- rank {r}\n{log[-2000:]}" for r, log in enumerate(logs)))
    return [p.exitcode for p in procs], logs


@pytest.fixture
def launch_job(tmp_path):
    return lambda spec, world, **kw: launch(spec, world, tmp_path, **kw)


_DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT",
             "HMSCALE_SINGLE_PROCESS_GROUP_PORT")


@pytest.fixture(autouse=True, scope="module")
def _restore_dist_env():
    """In-process stages set the env vars of a one-process gloo group: restore them after each module
    (subprocesses started by other tests must not inherit RANK / WORLD_SIZE / MASTER_PORT)."""
    saved = {k: os.environ.get(k) for k in _DIST_ENV}
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(autouse=True, scope="session")
def _leave_no_process_group():
    """The one-process group (kept across modules: DeepSpeed caches its groups) ends with the session."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
