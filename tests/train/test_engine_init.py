"""`engine.init_distributed` on gloo: DeepSpeed's inference-only shared-memory all-reduce is neither compiled (about a
minute of g++ on a fresh machine) nor mapped into /dev/shm; training's collectives still work."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_GROUP_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "HMSCALE_SINGLE_PROCESS_GROUP_PORT")


def _env(tmp_path) -> dict:
    """The environment of a child `python -c` run from tmp_path: no process-group variables, its own extensions
    folder, and the repository importable (a machine without the editable install, e.g. the GPU hosts)."""
    env = {k: v for k, v in os.environ.items() if k not in _GROUP_VARS}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    return dict(env, TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))


def test_gloo_init_builds_no_shm_op_and_maps_no_buffer(tmp_path):
    code = """
import os
from pathlib import Path
import torch
import deepspeed.comm as dc
from hmscale.train.engine import init_distributed
print(init_distributed(False))
t = torch.arange(4.0)
dc.all_reduce(t)
assert torch.equal(t, torch.arange(4.0)), t
port = os.environ["MASTER_PORT"]
print(sorted(p.name for p in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*")))
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.strip().splitlines()
    assert lines[-2] == "(0, 1)" and lines[-1] == "[]"
    assert "built successfully" not in r.stdout + r.stderr
    assert not (Path(tmp_path) / "ext").exists()  # nothing compiled


def test_a_process_started_after_a_one_process_group_makes_its_own(tmp_path):
    """init_distributed's one-process group put RANK / MASTER_* in the environment, and a process started afterwards
    (a Ray head started from a notebook after a local run, and the jobs it runs) took them for a group to join: it
    bound the parent's port, in use (EADDRINUSE). It makes its own group on a free port."""
    code = """
import os, subprocess, sys
from hmscale.train.engine import init_distributed
print(init_distributed(False), flush=True)
child = "from hmscale.train.engine import init_distributed; print(init_distributed(False))"
sys.exit(subprocess.run([sys.executable, "-c", child], timeout=120).returncode)
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and r.stdout.count("(0, 1)\n") == 2, (r.stdout + r.stderr)[-2000:]


def test_no_test_or_benchmark_starts_deepspeed_comm_around_the_engine():
    """Every process of the suite joins its group through `engine.init_distributed`: a direct
    `deepspeed.init_distributed` builds the shared-memory op above (a fresh CI machine spent ~70 s of g++ in the
    first test that did, with every other DeepSpeed start of the suite waiting on the build lock)."""
    direct = [str(p.relative_to(REPO)) for d in ("tests", "benchmarks", "scaling", "ray_jobs", "hmscale")
              for p in (REPO / d).rglob("*.py")
              if "deepspeed.init_distributed(" in p.read_text() and p.name != "engine.py" and p != Path(__file__)]
    assert direct == [], f"call hmscale.train.engine.init_distributed instead in {direct}"


def test_cpu_engine_on_a_cuda_host_gives_deepspeed_the_cpu_accelerator(tmp_path):
    """parallel.use_gpu=false where CUDA is present (faked here): DeepSpeed's accelerator becomes the CPU one before
    its process group is made, so the engine keeps the model on the CPU; a GPU engine after it gets CUDA's back."""
    code = """
import torch
torch.cuda.is_available = lambda: True
from deepspeed.accelerator import get_accelerator, set_accelerator
from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator
import hmscale.train.engine as engine
set_accelerator(CUDA_Accelerator())
print(engine.init_distributed(False), get_accelerator().device_name())
engine._deepspeed_accelerator(True)  # a GPU engine later in the same process
print(get_accelerator().device_name())
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-2:] == ["(0, 1) cpu", "cuda"], r.stdout
