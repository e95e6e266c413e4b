"""Teacher cache on a local Ray cluster: 2 teacher-forward actors, read-back equality, a worker killed mid-shard."""

import pytest
import torch

ray = pytest.importorskip("ray")

from hmscale.teacher.cache import CacheReader, build_cache, verify_cache  # noqa: E402
from hmscale.teacher.cache.worker import FAULT_ENV  # noqa: E402
from hmscale.teacher.capture import capture_layers  # noqa: E402

pytestmark = pytest.mark.ray


def test_two_ray_workers_cache_equals_live_capture(ray_cluster, tmp_path, teacher, data, tools):
    cfg = tools.make_cfg(tmp_path, **{"cache.workers": 2, "cache.capture.topk": 3})
    logs = []
    path = build_cache(cfg, data, teacher, engine="ray", log=logs.append)
    assert any("2 Ray teacher-forward workers" in line for line in logs), logs
    report = verify_cache(path)
    assert report.ok and report.samples == 12, report.summary()

    reader = CacheReader(path)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the actors run one thread each; same kernels, same bits
    try:
        for shard in range(data.plan.num_shards):
            s = data.plan.shard(shard)
            for b0 in range(0, 3, cfg.cache.batch_size):
                ids = torch.from_numpy(s["tokens"][b0 : b0 + cfg.cache.batch_size]).long()
                caps = capture_layers(teacher, ids)
                for j in range(ids.shape[0]):
                    got = reader.sample(shard, b0 + j, layers=[0, 1], topk=True)
                    assert got["key"] == s["keys"][b0 + j]
                    for i in (0, 1):
                        assert torch.equal(got["layers"][i]["attn_input"], caps[i].attn_input[j].to(torch.bfloat16))
                        assert torch.equal(got["layers"][i]["attn_output"], caps[i].attn_output[j].to(torch.bfloat16))
    finally:
        torch.set_num_threads(threads)

    # the same config again: no actor starts, no teacher forward, same bytes
    before = tools.shard_bytes(path)
    logs = []
    assert build_cache(cfg, data, teacher, engine="ray", log=logs.append) == path
    assert any("no teacher forward" in line for line in logs) and not any("Ray teacher-forward" in l for l in logs)
    assert tools.shard_bytes(path) == before


def test_worker_killed_mid_shard_is_redone_elsewhere(ray_cluster, tmp_path, teacher, tools, monkeypatch):
    data = tools.make_data(shards=5, per_shard=4)
    marker = tmp_path / "fault-fired"
    monkeypatch.setenv(FAULT_ENV, f"2:{marker}")  # the worker that takes shard 2 dies (os._exit) half-way, once
    cfg = tools.make_cfg(tmp_path / "cache", **{"cache.workers": 2})
    logs = []
    path = build_cache(cfg, data, teacher, engine="ray", log=logs.append)
    assert marker.exists(), "the injected fault did not fire"
    assert any("died on shard-000002.tar" in line for line in logs), logs

    report = verify_cache(path)
    assert report.ok, report.summary()
    assert report.samples == 20 and len(report.shards_ok) == 5
    names = sorted(p.name for p in path.iterdir())
    assert names == ["manifest.json"] + [f"shard-{i:06d}.tar" for i in range(5)]  # nothing partial or hidden
    keys = [k for s in range(5) for k in CacheReader(path)._shard_index(s)["keys"]]
    assert len(keys) == len(set(keys)) == 20
    assert sorted(keys) == sorted(k for s in range(5) for k in data.plan.shard_keys(s))

    # the redone shard equals what an undisturbed local run writes
    monkeypatch.delenv(FAULT_ENV)
    local = build_cache(tools.make_cfg(tmp_path / "local"), data, teacher, engine="local")
    assert (local / "shard-000002.tar").read_bytes() == (path / "shard-000002.tar").read_bytes()


def test_a_full_disk_on_an_actor_is_not_retried():
    """A shard task that failed on a full (or read-only, forbidden) directory stops the build at once, named as writing
    the shard: every actor writes into the same directory, so a retry elsewhere would fail the same way."""
    import errno

    from ray_jobs.cache_teacher import unretryable

    class TaskError(Exception):  # what ray.get raises for a failed task: the worker's exception as .cause
        def __init__(self, cause):
            super().__init__(f"RayTaskError({type(cause).__name__})")
            self.cause = cause

    full = OSError(errno.ENOSPC, "No space left on device")
    assert unretryable(TaskError(full)) is full
    assert unretryable(TaskError(OSError(errno.EROFS, "Read-only file system"))).errno == errno.EROFS
    assert unretryable(TaskError(OSError(errno.ECONNRESET, "reset"))) is None  # a transient error: retried
    assert unretryable(TaskError(RuntimeError("CUDA error"))) is None
    assert unretryable(RuntimeError("no cause")) is None


def _nan_everywhere(teacher, ids, layers=None):
    from hmscale.teacher.cache.worker import _default_capture

    out = _default_capture(teacher, ids, layers)
    out[0].attn_output.view(-1)[0] = float("nan")
    return out


def test_a_teacher_computing_nan_on_an_actor_is_not_retried(ray_cluster, tmp_path, teacher, data, tools):
    """The teacher's NaN / inf is the same on every actor: the build stops at the first shard holding one, in one
    line naming it, without the cache.max_retries retries elsewhere (each a teacher forward and the same refusal)."""
    from hmscale.teacher.cache import CacheError

    logs = []
    cfg = tools.make_cfg(tmp_path, **{"cache.max_retries": 3})
    with pytest.raises(CacheError, match=r"the teacher computed NaN or inf values in l000_attn_output") as err:
        build_cache(cfg, data, teacher, engine="ray", capture_fn=_nan_everywhere, log=logs.append)
    assert "\n" not in str(err.value)
    assert not any("retry" in line for line in logs), logs
    # the failed build's actors are gone: their CPUs come back while the error (and its traceback) is still held
    import time

    deadline = time.time() + 10
    while ray_cluster.available_resources().get("CPU", 0) < ray_cluster.cluster_resources().get("CPU", 0):
        assert time.time() < deadline, "the failed build left its teacher-forward actors holding the cluster's CPUs"
        time.sleep(0.2)
