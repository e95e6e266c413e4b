"""More Ray workers than the cluster can hold: Ray Train's worker group (one CPU, or one GPU, per worker) and the teacher
cache's actors (one CPU each) used to wait for them without end: `hmscale run -s parallel.num_workers=3` on a 2-CPU
cluster retried the group's start every 60 s forever, and `hmscale cache -s cache.workers=3` stopped at 15/16 shards
with no message (the shard dealt to the actor that never started)."""

import threading
import types

import pytest


@pytest.fixture
def two_cpu_cluster(monkeypatch):
    """What `connect` would leave: an initialised Ray with 2 CPUs in all (nothing started)."""
    import ray

    import hmscale.ray_cluster

    monkeypatch.setattr(hmscale.ray_cluster, "connect", lambda *a, **k: False)
    monkeypatch.setattr(hmscale.ray_cluster, "_warned", set())
    monkeypatch.setattr(hmscale.ray_cluster, "_started_embedded", True)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0, "memory": 1e9})
    monkeypatch.delenv("RAY_ADDRESS", raising=False)

    import hmscale.data

    def no_data(*a, **k):
        raise AssertionError("the data was prepared before the worker group was checked")
    monkeypatch.setattr(hmscale.data, "prepare_data", no_data)


@pytest.mark.parametrize("command", ["run", "stage1", "stage2"])
def test_more_workers_than_the_embedded_cluster_has_is_one_line(two_cpu_cluster, capsys, tmp_path, command):
    from hmscale.cli import main

    rc = main([command, "-s", "parallel.engine=ray", "-s", "parallel.num_workers=3", "-s", f"output_dir={tmp_path}/run",
               "-s", f"data.cache_dir={tmp_path}/d", "-s", f"cache.root={tmp_path}/c"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and "Traceback" not in err, err
    assert err == ("hmscale: error: parallel.num_workers=3: each Ray Train worker takes one CPU and the embedded Ray "
                   "cluster has 2 in all (this machine's); lower parallel.num_workers to 2, or join a larger cluster "
                   "with parallel.ray_address=HEAD:6379")


def test_gpu_workers_on_a_cluster_without_gpus(two_cpu_cluster):
    from hmscale.config import ConfigError
    from hmscale.ray_cluster import check_workers_fit

    with pytest.raises(ConfigError, match=r"takes one GPU \(parallel.use_gpu\) and the embedded Ray cluster has 0 in "
                                          r"all \(this machine's\); drop parallel.use_gpu"):
        check_workers_fit(1, True)
    check_workers_fit(2, False)  # fits: nothing said


def test_a_joined_cluster_may_grow_so_the_run_says_once_that_it_waits(two_cpu_cluster, monkeypatch):
    import hmscale.ray_cluster
    from hmscale.ray_cluster import check_workers_fit

    # joined (parallel.ray_address, a submitted job's driver) or a Ray task's: a cluster someone else started
    monkeypatch.setattr(hmscale.ray_cluster, "_started_embedded", False)
    lines = []
    for _ in range(2):  # (checked before the data and again before the trainer)
        check_workers_fit(3, False, log=lines.append)
    assert len(lines) == 1 and lines[0].startswith("[ray] warning: parallel.num_workers=3: each Ray Train worker takes "
                                                   "one CPU and the Ray cluster has 2 in all now: training waits")
    assert "lower parallel.num_workers to 2" in lines[0]


@pytest.mark.ray
def test_more_cache_workers_than_cpus_do_not_hang(ray_cluster, monkeypatch):
    import torch

    from hmscale.config import build_config
    from ray_jobs import cache_teacher

    ray = ray_cluster

    @ray.remote
    class Standin:  # CacheWorkerActor's surface: a shard id in, its info out
        def __init__(self, *a):
            pass

        def run_shard(self, sid):
            return sid

    monkeypatch.setattr(cache_teacher, "CacheWorkerActor", Standin)
    cfg = build_config({}, ["cache.workers=3", "parallel.engine=ray"])  # the suite's cluster has 2 CPUs
    done, logs, errors = [], [], []
    cp = types.SimpleNamespace(spec=None, cache_dir="/nonexistent")

    def run():
        try:
            cache_teacher.run_ray(cfg, None, torch.nn.Linear(1, 1), cp, list(range(6)), done.append, log=logs.append)
        except BaseException as err:  # noqa: BLE001
            errors.append(err)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), f"run_ray hung with {sorted(done)} of 6 shards done: {logs}"
    assert not errors, errors
    assert sorted(done) == list(range(6))
    assert "cache: cache.workers=3, but the Ray cluster has 2 CPUs in all: 2 workers" in logs
