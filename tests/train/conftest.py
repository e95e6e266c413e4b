"""Helpers for the train tests: launch a small multi-process gloo job, tiny fixtures."""

import json
import os
import socket
import subprocess
import sys
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
    returns what rank 0 wrote as JSON to `spec["out"]`."""
    spec = dict(spec, out=str(tmp / "losses.json"))
    spec_path = tmp / "spec.json"
    spec_path.write_text(json.dumps(spec))
    port = _port()
    procs = []
    for r in range(world):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
        env.update(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world), LOCAL_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]), HMSCALE_NO_PROGRESS="1")
        procs.append(subprocess.Popen([sys.executable, str(job), str(spec_path)], cwd=str(REPO), env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for p, o in zip(procs, outs):
        assert p.returncode == 0, o[-4000:]
    return json.loads((tmp / "losses.json").read_text())


@pytest.fixture
def launch_job(tmp_path):
    return lambda spec, world, **kw: launch(spec, world, tmp_path, **kw)


_DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")


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
