"""Teacher-cache edge cases a user hits: a teacher capture holding NaN/inf, `cache rm` of a cache a build is writing."""

import threading

import pytest
import torch

from hmscale.teacher.cache import CacheError, CacheReader, build_cache, verify_cache
from hmscale.teacher.cache.catalog import list_caches, remove_cache
from hmscale.teacher.cache.worker import _default_capture


def _poisoned(layer: int, tensor: str, value: float):
    """A capture function that puts `value` into one element of `layer`'s `tensor` in the third batch the worker
    runs (the fixture's plan: 3 rows per shard, batches of 2 within a shard: shard 1's rows 0-1; the element lies in
    row 0)."""
    calls = [0]

    def cap(teacher, ids, layers=None):
        out = _default_capture(teacher, ids, layers)
        calls[0] += 1
        if calls[0] == 3:
            x = getattr(out[layer], tensor)
            x.view(-1)[5] = value
        return out

    return cap


@pytest.mark.parametrize("dtype,value", [("bfloat16", float("nan")), ("fp8_e4m3", float("inf")),
                                         ("fp8_e4m3", float("nan")), ("float32", float("-inf"))])
def test_a_teacher_capture_holding_nan_or_inf_is_refused_not_cached(tmp_path, teacher, data, tools, dtype, value):
    """A NaN or inf in what the teacher computed (a damaged checkpoint, an overflowing teacher) was stored silently:
    in fp8 an inf turned its whole row into NaN, and a NaN set the row's scale to 1 so its other values were clamped
    to +-448; every later run then trained on it. The build stops instead, naming the field and the sample, and
    writes no shard of it."""
    cfg = tools.make_cfg(tmp_path, **{"cache.capture.dtype": dtype})
    with pytest.raises(CacheError, match=r"NaN or inf values in l001_attn_output of sample 000001-0000") as err:
        build_cache(cfg, data, teacher, engine="local", capture_fn=_poisoned(1, "attn_output", value), log=lambda *a: None)
    assert "000001-0000" in str(err.value) and "shard-000001.tar" in str(err.value)
    assert "\n" not in str(err.value)
    path = next(p for p in tmp_path.iterdir() if not p.name.startswith("."))
    assert (path / "shard-000000.tar").exists()  # the shard before is kept
    assert not (path / "shard-000001.tar").exists() and not list(path.glob(".shard-*.tmp"))
    # nothing that was stored holds a non-finite value
    reader = CacheReader(path, allow_incomplete=True)
    for sid in reader.shard_ids:
        for j in range(reader._counts[sid]):
            s = reader.sample(sid, j, layers=[0, 1], dtype=torch.float32)
            assert all(torch.isfinite(t).all() for d in s["layers"].values() for t in d.values())


def test_cache_rm_refuses_a_cache_a_build_is_writing(tmp_path, data, tools):
    """`hmscale cache rm` on a cache while a build writes it deleted the directory under the build: the build failed
    with advice about disk space and permissions, and its manifest save put the directory back holding a manifest
    that listed the shards just deleted. rm now refuses while a build holds the cache's lock, and works after."""
    reached, go = threading.Event(), threading.Event()
    calls = [0]

    def cap(teacher, ids, layers=None):
        calls[0] += 1
        if calls[0] == 3:  # in shard 1 (3 rows per shard, batches of 2): shard 0 is written
            reached.set()
            go.wait(30)
        return _default_capture(teacher, ids, layers)

    out = {}

    def run():
        try:
            out["path"] = build_cache(tools.make_cfg(tmp_path), data, tools.make_teacher(), engine="local", capture_fn=cap,
                                      log=lambda *a: None)
        except BaseException as err:  # noqa: BLE001 - reported below
            out["err"] = err

    t = threading.Thread(target=run)
    t.start()
    try:
        assert reached.wait(30)
        (entry,) = list_caches(tmp_path)
        with pytest.raises(CacheError, match="being built"):
            remove_cache(entry.path)
        with pytest.raises(CacheError, match="being built"):
            remove_cache(entry.path, force=True)
        assert entry.path.is_dir()
    finally:
        go.set()
        t.join(60)
    assert "err" not in out, out.get("err")
    assert verify_cache(out["path"]).ok
    assert remove_cache(out["path"]) == [out["path"]] and not out["path"].exists()


def test_the_staged_buffer_path_refuses_nan_in_the_top_k_and_keeps_a_zero_probability(tmp_path, teacher, data, tools):
    """The check rides with the stored bytes through the pinned-buffer path a GPU worker takes (exercised on the CPU
    here): a NaN log-prob is refused; a -inf one (a token of zero probability) is a value, stored as it is."""
    from hmscale.teacher.cache.format import CaptureSpec
    from hmscale.teacher.cache.worker import ShardWorker

    spec = CaptureSpec(layers=(0,), tensors=("attn_input",), topk=4)
    for value, refused in [(float("nan"), True), (float("-inf"), False)]:
        worker = ShardWorker(teacher, data.plan, spec, tmp_path / str(value), batch_size=2, device="cpu", staged=True)
        forward = worker.forward_batch

        def poisoned(tokens, forward=forward):
            out = forward(tokens)
            out["topk_logprobs"][-1, 3, -1] = value  # the batch's last row, position 3, the 4th largest
            return out

        worker.forward_batch = poisoned
        if refused:
            with pytest.raises(CacheError, match=r"NaN or inf values in topk_logprobs of sample 000000-0001 "
                                                 r"\(shard-000000.tar\)"):
                worker.run_shard(0)
            assert not list((tmp_path / str(value)).iterdir())
        else:
            info = worker.run_shard(0)
            assert info.samples == 3


def test_cache_rm_refuses_while_a_shard_writer_holds_a_temporary(tmp_path, teacher, data, tools):
    """A worker writing a shard without the driver's lock (a Ray actor of a driver on another host, a ShardWorker run
    by hand) holds its temporary locked: rm waits for it too; a dead writer's leftover does not stop rm."""
    from hmscale.teacher.cache.writer import ShardWriter

    path = build_cache(tools.make_cfg(tmp_path), data, teacher, engine="local", log=lambda *a: None)
    (path / ".shard-000009.tar.dead.tmp").write_bytes(b"x")  # a dead writer's leftover: not locked
    writer = ShardWriter(path / "shard-000009.tar", 9)
    try:
        with pytest.raises(CacheError, match="being built"):
            remove_cache(path)
    finally:
        writer.abort()
    assert remove_cache(path) == [path] and not path.exists()


def test_a_loader_with_more_ranks_times_batch_than_rows_says_so(tmp_path, teacher, tools):
    """With world_size x batch_size above the rows the reader holds, every rank's epoch was empty: iterating yielded
    nothing, len() was 0 and the epoch counter ran on, so a loop over epochs never ended and no row was read. The
    loader now refuses in one line; the largest split that fits still deals every rank the same batches."""
    data = tools.make_data(shards=3, per_shard=5)
    path = build_cache(tools.make_cfg(tmp_path, **{"cache.capture.layers": "[0]", "cache.capture.tensors": "[attn_input]"}),
                       data, teacher, engine="local", log=lambda *a: None)
    reader = CacheReader(path)
    for ws, bs in [(16, 1), (8, 2), (2, 8)]:
        with pytest.raises(CacheError, match=r"15 rows.*world_size 16 x batch_size 1|15 rows.*world_size 8 x batch_size 2"
                                             r"|15 rows.*world_size 2 x batch_size 8"):
            reader.stage2_batches(bs, rank=0, world_size=ws)
    keys = [[k for b in reader.stage2_batches(1, rank=r, world_size=15, seed=2) for k in b["keys"]] for r in range(15)]
    assert all(len(k) == 1 for k in keys) and len({k[0] for k in keys}) == 15  # every row once
