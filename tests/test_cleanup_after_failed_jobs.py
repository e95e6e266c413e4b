"""What a failed or interrupted job left behind: the local cache engine's worker processes running on (holding their
devices) after their driver was killed, the hidden shard temporaries of a failed multi-process cache build, Ray Train's
SIGINT handler (and the controller actor it holds) after the training, a stopped sweep's Ray tasks."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]


def _teacher():
    import torch
    from transformers import GPTNeoXForCausalLM

    from hmscale.teacher.flavors import neox_config

    torch.manual_seed(0)
    cfg = neox_config("pythia-nano", vocab_size=300)
    cfg._attn_implementation = "eager"
    return GPTNeoXForCausalLM(cfg).eval()


def _data(shards: int = 4, per_shard: int = 3, seq_len: int = 32):
    from hmscale.data.plan import ShardPlan

    rng = np.random.default_rng(0)
    n = shards * per_shard * seq_len
    tokens = rng.integers(1, 300, size=n).astype(np.int32)
    plan = ShardPlan(tokens, np.full(n // 16, 16, dtype=np.int64), seq_len, per_shard, source="random-0")
    return SimpleNamespace(plan=plan, vocab_size=300, eos_id=0)


def _cfg(root):
    from hmscale.config import build_config

    return build_config({}, [f"cache.root={root}", "cache.batch_size=2", "teacher.flavor=pythia-nano"])


# ---------------------------------------------------------------- 1. the local cache engine's worker processes


def test_a_failed_multi_process_cache_build_leaves_no_shard_temporaries(tmp_path, monkeypatch):
    """A worker process that dies mid-shard (or one stopped because another failed) leaves its hidden
    `.shard-*.tmp`; the build removed such leftovers only after a success, so a build that stopped kept them (a
    shard's worth of disk each, also after a full disk stopped it) until some later build of that cache succeeded."""
    from hmscale.teacher.cache import CacheError, build_cache
    from hmscale.teacher.cache.worker import FAULT_ENV

    monkeypatch.setenv(FAULT_ENV, f"1:{tmp_path / 'killed.txt'}")  # the worker dies mid-way through shard 1
    with pytest.raises(CacheError, match="died"):
        build_cache(_cfg(tmp_path / "c"), _data(), _teacher(), engine="local", devices=["cpu"], processes=True,
                    log=lambda *_: None)
    assert (tmp_path / "killed.txt").exists()
    assert sorted(p.name for p in (tmp_path / "c").rglob(".shard-*.tmp")) == []


DRIVER = """
import sys
sys.path[:0] = [{repo!r}, {tests!r}]
import test_cleanup_after_failed_jobs as t
from hmscale.teacher.cache import build_cache

build_cache(t._cfg({root!r}), t._data(), t._teacher(), engine="local", devices=["cpu"], processes=True,
            capture_fn=t.slow_capture, log=lambda *_: None)
"""


def slow_capture(teacher, ids, layers=None):
    """The teacher's capture, slowed down, telling the test which process runs it."""
    from hmscale.teacher.capture import capture_layers

    Path(os.environ["LEAK_PID_FILE"]).write_text(str(os.getpid()))
    time.sleep(3.0)  # 8 captures: the worker's shards take ~24 s
    return capture_layers(teacher, ids, layers=layers)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")  # (an orphan's zombie waits for a reaper that may never come)


@pytest.mark.parametrize("sigint_ignored", [False, True])
def test_cache_worker_processes_stop_when_their_driver_is_killed(tmp_path, sigint_ignored):
    """The driver killed (SIGKILL, or SIGTERM: Python runs no cleanup either way), its spawned cache workers trained
    on, orphaned, through every shard dealt to them: holding their GPUs, and writing into the cache beside the
    rerun's workers. They stop with it, as the training engine's local workers do (torch's spawn)."""
    pid_file = tmp_path / "worker.pid"
    script = DRIVER.format(repo=str(REPO), tests=str(REPO / "tests"), root=str(tmp_path / "c"))
    # sigint_ignored: a driver started with SIGINT ignored (a script's background job, `hmscale cache CFG &`; also
    # what this test's own process may have been left with): its workers inherited that, ignored the death signal
    # (SIGINT) and outlived it (sixteenth session)
    sig = signal.SIG_IGN if sigint_ignored else signal.SIG_DFL
    driver = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, "LEAK_PID_FILE": str(pid_file)},
                              stdout=subprocess.DEVNULL, stderr=open(tmp_path / "driver.err", "w"),
                              preexec_fn=lambda: signal.signal(signal.SIGINT, sig))
    try:
        deadline = time.time() + 60
        while not pid_file.exists() and driver.poll() is None and time.time() < deadline:
            time.sleep(0.1)
        assert pid_file.exists(), (tmp_path / "driver.err").read_text()[-2000:]
        worker = int(pid_file.read_text())
        driver.kill()
        driver.wait()
        deadline = time.time() + 20  # (SIGINT lands once the worker's current torch op returns: slow on a loaded machine)
        while _alive(worker) and time.time() < deadline:
            time.sleep(0.1)
        left = _alive(worker)
        if left:
            where = ""
            try:  # (what it was doing: its threads' kernel wait channels)
                where = " ".join(sorted({Path(t, "wchan").read_text() for t in Path(f"/proc/{worker}/task").iterdir()}))
                where += " | " + Path(f"/proc/{worker}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                pass
            os.kill(worker, signal.SIGKILL)
        assert not left, (f"the cache worker process outlived its killed driver ({where}); driver stderr: "
                          f"{(tmp_path / 'driver.err').read_text()[-1500:]}")
    finally:
        if driver.poll() is None:
            driver.kill()
        driver.wait()


# ---------------------------------------------------------------- 2. Ray Train's SIGINT handler


@pytest.mark.ray
def test_ray_training_gives_back_ctrl_c_and_its_controller(ray_cluster, tmp_path, monkeypatch):
    """Ray Train's fit() makes its own SIGINT handler (Ctrl-C: abort the run) and never puts Python's back: after the
    training (here failed) a Ctrl-C in the driver (the recipe's evaluation, export) asked the finished run's controller
    to abort, and did not stop the process (the third one exited with status 0); and the handler's closure kept the
    TrainController actor alive for as long as the driver lived."""
    from ray.util.state import list_actors

    from hmscale.config import build_config
    from hmscale.train.engine import TrainingError
    from ray_jobs import distill

    def failing_train_func(config):  # (a closure: Ray sends it by value)
        raise RuntimeError("worker failed")

    monkeypatch.setattr(distill, "train_func", failing_train_func)
    cfg = build_config({}, ["parallel.engine=ray", "parallel.num_workers=1", "parallel.max_failures=0",
                            f"output_dir={tmp_path / 'run'}"])
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(TrainingError, match="max_failures=0"):
        distill._run_ray(cfg, {"stages": ["stage1"]}, tmp_path / "run", storage_path=str(tmp_path / "ray"),
                         log=lambda *_: None)
    assert signal.getsignal(signal.SIGINT) is before
    import gc

    gc.collect()
    deadline = time.time() + 15
    # (this cluster's address: with none, the state API looks for every Ray on the host and refuses when a test
    # beside this one runs another)
    address = ray_cluster.get_runtime_context().gcs_address
    while (alive := [a for a in list_actors(address=address, filters=[("class_name", "=", "TrainController")])
                     if a.state == "ALIVE"]) and time.time() < deadline:
        time.sleep(0.5)
    assert not alive, "the training's controller actor outlived it"


# ---------------------------------------------------------------- 3. a sweep's Ray tasks


def sleepy_recipe(cfg, log=print):
    """A stand-in recipe: the nano size ends at once, the micro size trains for minutes."""
    if cfg.teacher.flavor == "pythia-micro":
        time.sleep(300)
    Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
    return {"teacher_ppl": 10.0, "hedgemamba_ppl": 11.0}


@pytest.mark.ray
def test_an_interrupted_ray_sweep_stops_the_sizes_still_running(ray_cluster, tmp_path):
    """A sweep stopped part-way (Ctrl-C, a table it could not write) left its sizes' Ray tasks running: training on,
    holding their CPUs (GPUs) for as long as the driver lived (a notebook, a long-lived script)."""
    from scaling.sweep import run_sweep

    ray = ray_cluster

    def log(*args):
        if "pythia-nano: done" in " ".join(map(str, args)):
            raise KeyboardInterrupt  # Ctrl-C while the micro size trains

    with pytest.raises(KeyboardInterrupt):
        run_sweep(["pythia-nano", "pythia-micro"], tmp_path / "scale", recipe=sleepy_recipe, warm_data=False,
                  plots=False, log=log)
    total, deadline = ray.cluster_resources().get("CPU", 0), time.time() + 10
    while ray.available_resources().get("CPU", 0) < total and time.time() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) == total, "a size's task still holds its CPU"


SPAWNER = """
import signal, sys
sys.path[:0] = [{repo!r}, {tests!r}]
import test_cleanup_after_failed_jobs as t
from hmscale.train.launch import spawn_workers
spawn_workers(t.report_sigint, 1, {out!r})
"""


def report_sigint(rank, out):
    import signal

    Path(out).write_text(str(signal.getsignal(signal.SIGINT) is signal.default_int_handler))


def test_training_workers_answer_their_death_signal_when_the_driver_ignores_sigint(tmp_path):
    """torch's spawn makes SIGINT each training worker's death signal; a driver started with SIGINT ignored (a script's
    background job) handed that on, so its local workers would outlive it (sixteenth session, as the cache workers)."""
    out = tmp_path / "handler.txt"
    script = SPAWNER.format(repo=str(REPO), tests=str(REPO / "tests"), out=str(out))
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120,
                   preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert out.read_text() == "True"
