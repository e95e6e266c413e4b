"""Teacher cache, concurrent write path: shards written by several threads are byte-identical to a
single-threaded run whatever the thread timing; the tar emitter equals Python's tarfile; errors name
the shard and leave nothing partial."""

import hashlib
import io
import json
import random
import tarfile
import time

import numpy as np
import pytest

from hmscale.teacher.cache import CacheError, build_cache, verify_cache
from hmscale.teacher.cache.format import npy_bytes
from hmscale.teacher.cache.worker import WRITERS_ENV, ShardWorker
from hmscale.teacher.cache.writer import ShardWriter, _HashingSink, sha256_file

SPEC = {"cache.capture.token_fraction": 0.25, "cache.capture.dtype": "fp8_e4m3", "cache.capture.topk": 3,
        "cache.batch_size": 2}  # 2 does not divide the 3 rows of a shard: a short last batch too


def _jitter(monkeypatch, seed):
    """Random sleeps in the file writes and the batch launches: the threads interleave differently each run."""
    rng = random.Random(seed)
    out, launch = _HashingSink._out, ShardWorker.launch

    def slow_out(self, mv):
        time.sleep(rng.random() * 2e-3)
        return out(self, mv)

    def slow_launch(self, *a, **k):
        time.sleep(rng.random() * 5e-3)
        return launch(self, *a, **k)

    monkeypatch.setattr(_HashingSink, "_out", slow_out)
    monkeypatch.setattr(ShardWorker, "launch", slow_launch)


def _shards(path):
    return {p.name: p.read_bytes() for p in sorted(path.glob("shard-*.tar"))}


def test_concurrent_writers_byte_identical_to_single_thread(tmp_path, teacher, tools, monkeypatch):
    data = tools.make_data(shards=6, per_shard=3)
    monkeypatch.setenv(WRITERS_ENV, "1")
    one = build_cache(tools.make_cfg(tmp_path / "one", **SPEC), data, teacher, engine="local")
    want = _shards(one)
    assert len(want) == 6
    for writers, seed in ((3, 0), (6, 1)):
        monkeypatch.setenv(WRITERS_ENV, str(writers))
        with monkeypatch.context() as m:
            _jitter(m, seed)
            path = build_cache(tools.make_cfg(tmp_path / f"w{writers}", **SPEC), data, teacher, engine="local")
        assert _shards(path) == want, f"{writers} writers changed the bytes"
        m_one = json.loads((one / "manifest.json").read_text())["shards"]
        m_par = json.loads((path / "manifest.json").read_text())["shards"]
        assert m_par == m_one  # same sha256, bytes, counts
        assert verify_cache(path).ok
        assert sorted(p.name for p in path.iterdir()) == ["manifest.json"] + sorted(want)  # no temporaries


def test_run_shards_reports_every_shard_once(tmp_path, teacher, tools):
    data = tools.make_data(shards=5, per_shard=2)
    cfg = tools.make_cfg(tmp_path)
    from hmscale.teacher.cache import plan_cache

    cp = plan_cache(cfg, data.plan, teacher)
    worker = ShardWorker(teacher, data.plan, cp.spec, cp.cache_dir, batch_size=2, device="cpu", writer_threads=3)
    seen = []
    infos = worker.run_shards(range(5), seen.append)
    assert sorted(i.shard for i in seen) == list(range(5)) and len(infos) == 5
    for i in infos:
        assert sha256_file(cp.cache_dir / i.file) == i.sha256
        assert (cp.cache_dir / i.file).stat().st_size == i.bytes
        assert {"write_s", "fsync_s"} <= set(i.stats)
    assert worker.forwards == 5


def test_failed_shard_is_named_nothing_partial_and_rerun_completes(tmp_path, teacher, tools, monkeypatch):
    data = tools.make_data(shards=6, per_shard=3)
    cfg = tools.make_cfg(tmp_path)
    shard3 = {tuple(r) for r in data.plan.shard(3)["tokens"][:2].tolist()}
    forward = ShardWorker.forward_batch

    def failing(self, tokens):
        if {tuple(r) for r in np.asarray(tokens).tolist()} == shard3:
            raise RuntimeError("boom")
        return forward(self, tokens)

    monkeypatch.setenv(WRITERS_ENV, "3")
    with monkeypatch.context() as m:
        m.setattr(ShardWorker, "forward_batch", failing)
        with pytest.raises(CacheError, match="shard-000003.tar.*boom"):
            build_cache(cfg, data, teacher, engine="local")
    path = next(tmp_path.glob("v1-*"))
    names = sorted(p.name for p in path.iterdir())
    assert "shard-000003.tar" not in names and not any(n.endswith(".tmp") for n in names)
    done = json.loads((path / "manifest.json").read_text())["shards"]
    assert "3" not in done and all(f"shard-{int(s):06d}.tar" in names for s in done)  # finished ones recorded
    logs = []
    build_cache(cfg, data, teacher, engine="local", log=logs.append)
    assert verify_cache(path).ok and len(list(path.glob("shard-*.tar"))) == 6
    monkeypatch.setenv(WRITERS_ENV, "1")
    ref = build_cache(tools.make_cfg(tmp_path / "ref"), data, teacher, engine="local")
    assert _shards(ref) == _shards(path)


def test_tar_emitter_equals_tarfile(tmp_path):
    """The direct emitter writes exactly what Python's tarfile writes for the same members (pax, fixed metadata),
    with small members coalesced and large ones written by reference, and the sha256 of what is on disk."""
    rng = np.random.default_rng(0)
    samples = []
    for j in range(3):
        samples.append((f"000000-{j:04d}", {
            "tokens": rng.integers(0, 1000, 37).astype(np.int32),
            "big": rng.integers(0, 65535, (300, 129)).astype(np.uint16),  # > 64 KiB: written by reference
            "empty": np.zeros((0, 4), np.float32),
            "f": rng.standard_normal((5, 3)).astype(np.float32),
        }))
    w = ShardWriter(tmp_path / "shard-000000.tar", 0)
    hashed_before = []
    for key, arrays in samples:
        w.add_sample(key, arrays)
        n = w._sink.n
        w.after(lambda n=n: hashed_before.append(n))
    info = w.commit()
    got = (tmp_path / "shard-000000.tar").read_bytes()

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for key, arrays in samples:
            for field, arr in arrays.items():
                blob = npy_bytes(arr)
                ti = tarfile.TarInfo(f"{key}.{field}.npy")
                ti.size, ti.mtime, ti.mode, ti.uid, ti.gid, ti.uname, ti.gname = len(blob), 0, 0o644, 0, 0, "", ""
                tf.addfile(ti, io.BytesIO(blob))
    assert got == buf.getvalue()
    assert info.sha256 == hashlib.sha256(got).hexdigest() and info.bytes == len(got) and info.samples == 3
    assert len(hashed_before) == 3 and hashed_before == sorted(hashed_before)


def test_writer_abort_leaves_nothing(tmp_path):
    w = ShardWriter(tmp_path / "shard-000001.tar", 1)
    w.add_sample("000001-0000", {"tokens": np.arange(100000, dtype=np.int32)})
    w.abort()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.ray
def test_ray_actor_with_several_shards_in_flight_dies(ray_cluster, tmp_path, teacher, tools, monkeypatch):
    from hmscale.teacher.cache.worker import FAULT_ENV

    data = tools.make_data(shards=5, per_shard=4)
    marker = tmp_path / "fault-fired"
    monkeypatch.setenv(FAULT_ENV, f"2:{marker}")
    monkeypatch.setenv(WRITERS_ENV, "2")  # each actor writes 2 shards at once: its death loses both
    logs = []  # (both variables reach the actors through their runtime_env, set by the driver)
    path = build_cache(tools.make_cfg(tmp_path / "cache", **{"cache.workers": 2}), data, teacher, engine="ray",
                       log=logs.append)
    assert marker.exists()
    assert any("up to 2 shards in flight" in line for line in logs), logs
    assert any("died on shard-000002.tar" in line for line in logs), logs
    report = verify_cache(path)
    assert report.ok and report.samples == 20, report.summary()
    assert sorted(p.name for p in path.iterdir()) == ["manifest.json"] + [f"shard-{i:06d}.tar" for i in range(5)]
    monkeypatch.delenv(FAULT_ENV)
    monkeypatch.setenv(WRITERS_ENV, "1")
    local = build_cache(tools.make_cfg(tmp_path / "local"), data, teacher, engine="local")
    assert _shards(local) == _shards(path)


BF16_SPEC = {"cache.capture.topk": 2, "cache.capture.topk_dtype": "bfloat16", "cache.batch_size": 2}


@pytest.mark.parametrize("writers,max_buffers,spec", [(1, 1, SPEC), (3, 2, SPEC), (3, None, SPEC), (2, None, BF16_SPEC)])
def test_staged_buffer_path_byte_identical(tmp_path, teacher, tools, monkeypatch, writers, max_buffers, spec):
    """The GPU path's buffer pool (batch-sized host buffers, reused once written and hashed; a short last
    batch uses a prefix) run on the CPU: the same bytes as the direct path, the pool never exceeds its limit."""
    from hmscale.teacher.cache import plan_cache

    data = tools.make_data(shards=5, per_shard=3)
    cfg = tools.make_cfg(tmp_path, **spec)
    cp = plan_cache(cfg, data.plan, teacher)
    direct = ShardWorker(teacher, data.plan, cp.spec, tmp_path / "direct", batch_size=2, device="cpu", writer_threads=1)
    want = {i.file: i.sha256 for i in direct.run_shards(range(5))}
    with monkeypatch.context() as m:
        _jitter(m, writers)
        staged = ShardWorker(teacher, data.plan, cp.spec, tmp_path / "staged", batch_size=2, device="cpu",
                             writer_threads=writers, max_buffers=max_buffers, staged=True)
        got = {i.file: i.sha256 for i in staged.run_shards(range(5))}
    assert got == want
    assert _shards(tmp_path / "staged") == _shards(tmp_path / "direct")
    pool = staged._pool
    assert pool._made <= pool.limit and len(pool._free) == pool._made  # every buffer set came back


def test_two_builds_of_one_cache_at_once_compute_its_shards_once(tmp_path, teacher, data, tools, monkeypatch):
    """Two runs asking for the same cache together (ablations started at once, a sweep's sizes): the second waits for
    the first and reuses its shards (both computed every shard before, with the same bytes)."""
    import threading

    import hmscale.teacher.cache.build as build

    real, calls = build.run_local, []

    def slow_run_local(*a, **k):
        calls.append(1)
        time.sleep(1.0)  # the second build starts while the first holds the cache
        return real(*a, **k)

    monkeypatch.setattr(build, "run_local", slow_run_local)
    cfg = tools.make_cfg(tmp_path)
    logs = {"first": [], "second": []}
    out, errors = {}, []

    def run(name):
        try:
            out[name] = build_cache(cfg, data, teacher, engine="local", log=logs[name].append)
        except Exception as err:  # noqa: BLE001 (reported below)
            errors.append(err)

    first = threading.Thread(target=run, args=("first",))
    first.start()
    deadline = time.time() + 30
    while not calls and time.time() < deadline:
        time.sleep(0.02)
    second = threading.Thread(target=run, args=("second",))
    second.start()
    first.join(60)
    second.join(60)
    assert not errors, errors
    assert len(calls) == 1  # the teacher ran over the shards once
    assert any("another process is building" in line and "waiting for it" in line for line in logs["second"])
    assert any("no teacher forward needed" in line for line in logs["second"]), logs["second"]
    assert out["first"] == out["second"] and verify_cache(out["first"]).ok
    assert sorted(p.name for p in out["first"].iterdir() if not p.name.startswith("shard-")) == ["manifest.json"]


def test_every_forward_runs_on_one_persistent_thread(tmp_path, teacher, tools):
    # the teacher's forwards run on the worker's one launcher thread, whatever thread writes the shard and across
    # run_shards calls: what the libraries set up per thread on a GPU (torch's SDPA took 80-190 ms in a new thread's
    # first calls on an H100) is then paid once per worker, not by each writer thread of every call
    import threading

    data = tools.make_data(shards=6, per_shard=2)
    cfg = tools.make_cfg(tmp_path)
    from hmscale.teacher.cache import plan_cache
    from hmscale.teacher.cache.worker import _default_capture

    cp = plan_cache(cfg, data.plan, teacher)
    ran_on = []

    def capture(t, ids, layers=None):
        ran_on.append(threading.current_thread())
        return _default_capture(t, ids, layers=layers)

    worker = ShardWorker(teacher, data.plan, cp.spec, cp.cache_dir, batch_size=2, device="cpu", writer_threads=3,
                         capture_fn=capture)
    worker.warm_up()
    assert len(ran_on) == 1 and ran_on[0] is not threading.current_thread()
    worker.run_shards(range(3))
    worker.run_shards(range(3, 6), threads=2)
    assert len(ran_on) == 7 and len(set(ran_on)) == 1, {t.name for t in ran_on}
    assert worker.forwards == 7


def test_launcher_thread_remade_after_fork(tmp_path, teacher, tools, monkeypatch):
    # a worker used before a fork: the child has no launcher thread (only its copied executor), so submitting there
    # would wait forever; the worker makes a new one when its process id changed
    import os
    import threading

    data = tools.make_data(shards=1, per_shard=2)
    from hmscale.teacher.cache import plan_cache
    from hmscale.teacher.cache.worker import _default_capture

    cp = plan_cache(tools.make_cfg(tmp_path), data.plan, teacher)
    ran_on = []

    def capture(t, ids, layers=None):
        ran_on.append(threading.current_thread())
        return _default_capture(t, ids, layers=layers)

    worker = ShardWorker(teacher, data.plan, cp.spec, cp.cache_dir, batch_size=2, device="cpu", capture_fn=capture)
    worker.warm_up()
    worker.warm_up()
    assert len(set(ran_on)) == 1
    pid = os.getpid()
    monkeypatch.setattr(os, "getpid", lambda: pid + 1)  # as in a forked child
    worker.warm_up()
    assert len(ran_on) == 3 and ran_on[2] is not ran_on[0]
