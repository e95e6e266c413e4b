"""Teacher cache as a user drives it: hand-edited manifests, shared roots, bad roots, full disks, interruptions."""

import errno
import json
import os
import random

import numpy as np
import pytest

from hmscale.teacher.cache import CacheError, CacheReader, build_cache, verify_cache
from hmscale.teacher.cache import build as build_mod
from hmscale.teacher.cache.catalog import format_catalog, list_caches, remove_cache
from hmscale.teacher.cache.manifest import Manifest
from hmscale.teacher.cache.worker import ShardWorker
from hmscale.teacher.cache.writer import ShardWriter, _HashingSink

SHARD_TOKENS = 3 * 32  # the conftest plan: 3 rows of 32 tokens per shard


def _edit(m: dict, rng: random.Random, how: str) -> None:
    """One hand edit of a manifest, at a random shard where it touches one."""
    sid = rng.choice(sorted(m["shards"]))
    entry = m["shards"][sid]
    if how == "shards_list":
        m["shards"] = list(m["shards"].values())
    elif how == "entry_no_bytes":
        del entry["bytes"]
    elif how == "bytes_as_text":
        entry["bytes"] = str(entry["bytes"])
    elif how == "shard_key_not_a_number":
        m["shards"]["x" + sid] = m["shards"].pop(sid)
    elif how == "file_elsewhere":
        entry["file"] = "../" + entry["file"]
    elif how == "view_path":
        m["view_of"] = "../elsewhere/" + m["key"]
    elif how == "capture_unknown_field":
        m["capture"]["stride"] = rng.randint(2, 9)
    elif how == "teacher_null":
        m["teacher"] = None
    elif how == "layout_missing":
        del m["layout"]
    elif how == "layer_field_missing":
        m["layout"]["fields"].pop(f"l{rng.choice(m['capture']['layers']):03d}_attn_output")
    elif how == "requested_text":
        m["requested_shards"] = "all"


EDITS = ["shards_list", "entry_no_bytes", "bytes_as_text", "shard_key_not_a_number", "file_elsewhere", "view_path",
         "capture_unknown_field", "teacher_null", "layout_missing", "layer_field_missing", "requested_text"]


@pytest.mark.parametrize("how", EDITS)
def test_a_hand_edited_manifest_is_one_line_for_verify_list_reader_and_build(tmp_path, teacher, data, tools, how):
    cfg = tools.make_cfg(tmp_path, **{"cache.capture.topk": 3})
    path = build_cache(cfg, data, teacher, engine="local", log=lambda *_: None)
    good = tools.shard_bytes(path)
    m = json.loads((path / "manifest.json").read_text())
    _edit(m, random.Random(hash(how) % 1000), how)
    (path / "manifest.json").write_text(json.dumps(m))

    report = verify_cache(path)  # no traceback: a problem naming the manifest
    assert not report.ok and len(report.problems) == 1 and "manifest.json" in report.problems[0]
    assert "edited by hand" in report.problems[0] and "\n" not in report.summary().split("\n", 1)[1]
    (entry,) = list_caches(tmp_path)  # the root still lists, the cache as not readable
    assert entry.error and "manifest.json" in entry.error
    assert "not a cache" in format_catalog([entry], tmp_path)
    with pytest.raises(CacheError, match="manifest.json is damaged or was edited by hand"):
        CacheReader(path)

    logs = []  # a build says so and starts over; the shards come out the same
    assert build_cache(cfg, data, teacher, engine="local", log=logs.append) == path
    assert any("edited by hand" in line and "new manifest" in line for line in logs)
    assert verify_cache(path).ok and tools.shard_bytes(path).keys() == good.keys()
    assert all(tools.shard_bytes(path)[k] == v for k, v in good.items() if k.endswith(".tar"))


def test_a_damaged_cache_can_still_be_removed(tmp_path, teacher, data, tools):
    path = build_cache(tools.make_cfg(tmp_path), data, teacher, engine="local", log=lambda *_: None)
    (path / "manifest.json").write_text('{"format": "hmscale-teacher-cache", "format_version": 1, "shards": []}')
    assert remove_cache(path) == [path] and not path.exists()
    (tmp_path / "plain").mkdir()
    with pytest.raises(CacheError, match="no manifest.json"):
        remove_cache(tmp_path / "plain")  # never anything that is not a cache


def _random_sample(rng: np.random.Generator) -> dict:
    return {"tokens": rng.integers(0, 300, size=32).astype(np.int32),
            "l000_attn_input": rng.standard_normal((32, 16)).astype(np.float32)}


def test_a_finishing_build_leaves_another_builds_temporary_alone(tmp_path):
    """Two builds share a cache directory: the one that finishes removes dead writers' temporaries only, not the
    shard another is writing (whose rename would otherwise fail)."""
    rng = np.random.default_rng(7)
    samples = [_random_sample(rng) for _ in range(3)]
    live = ShardWriter(tmp_path / "shard-000004.tar", 4)
    live.add_sample("000004-0000", samples[0])
    dead = tmp_path / ".shard-000001.tar.dead1234.tmp"  # a killed writer's: nobody holds it
    dead.write_bytes(rng.bytes(1000))
    build_mod._clean_temporaries(tmp_path)
    assert not dead.exists() and live.tmp.exists()
    for j, s in enumerate(samples[1:], 1):
        live.add_sample(f"000004-{j:04d}", s)
    info = live.commit()
    assert info.samples == 3 and (tmp_path / "shard-000004.tar").stat().st_size == info.bytes
    assert not list(tmp_path.glob(".shard-*.tmp"))


def test_a_run_inside_a_larger_interrupted_request_succeeds(tmp_path, teacher, tools):
    """An interrupted 6-shard build leaves requested_shards = 0..5; a later run asking for 3 of them finishes its own
    shards and succeeds (the manifest stays partial for the larger request)."""
    data = tools.make_data(shards=6, per_shard=3, seed=3)
    big = tools.make_cfg(tmp_path, **{"cache.max_tokens": 6 * SHARD_TOKENS})
    path = build_cache(big, data, teacher, engine="local", log=lambda *_: None)
    m = Manifest.load(path)
    small = tools.make_cfg(tmp_path, **{"cache.max_tokens": 3 * SHARD_TOKENS})
    mine = build_mod.run_shard_ids(small, build_mod.plan_meta(data.plan))
    keep = 1 + random.Random(5).randrange(2)  # 1 or 2 of the small run's shards survive the "interruption"
    for sid in sorted(set(range(6)) - set(mine[:keep])):
        m.drop_shard(sid)
        (path / f"shard-{sid:06d}.tar").unlink()
    m.update_complete()
    m.save()
    assert build_cache(small, data, teacher, engine="local", log=lambda *_: None) == path
    m = Manifest.load(path)
    assert sorted(m.shards) == mine and m.data["requested_shards"] == list(range(6)) and not m.complete
    assert CacheReader(path, shards=mine).num_samples == 9


@pytest.mark.parametrize("layout", ["file", "under_a_file"])
def test_a_cache_root_that_is_a_file_is_refused_before_teacher_work(tmp_path, teacher, data, tools, layout):
    f = tmp_path / "root"
    f.write_text("not a directory\n")
    root = f if layout == "file" else f / "sub" / "deeper"
    with pytest.raises(CacheError, match=r"cache.root .*root is a file, not a directory"):
        build_cache(tools.make_cfg(root), data, None, engine="local")  # teacher=None: refused before loading it


def test_an_unwritable_cache_root_is_one_line(tmp_path, teacher, data, tools, monkeypatch):
    real = os.access
    monkeypatch.setattr(build_mod.os, "access", lambda p, mode: False if str(p).startswith(str(tmp_path)) else real(p, mode))
    with pytest.raises(CacheError, match="not writable by this user; set cache.root"):
        build_cache(tools.make_cfg(tmp_path / "ro"), data, teacher, engine="local", log=lambda *_: None)
    monkeypatch.setattr(build_mod.os, "access", real)

    def denied(self, *a, **k):
        raise PermissionError(errno.EACCES, "Permission denied", str(self))

    monkeypatch.setattr(build_mod.Path, "mkdir", denied)
    with pytest.raises(CacheError, match=r"the cache directory .*: cannot create it \(Permission denied\)"):
        build_cache(tools.make_cfg(tmp_path / "ro2"), data, teacher, engine="local", log=lambda *_: None)


def test_a_full_disk_is_named_as_writing_and_the_rerun_finishes(tmp_path, teacher, tools, monkeypatch):
    data = tools.make_data(shards=5, per_shard=3, seed=11)
    cfg = tools.make_cfg(tmp_path)
    budget = [random.Random(2).randrange(80_000, 280_000)]  # bytes until the "disk" is full: in shard 2 to 4 (70 KB each)
    out = _HashingSink._out

    def filling(self, mv):
        budget[0] -= len(mv)
        if budget[0] < 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        return out(self, mv)

    with monkeypatch.context() as m:
        m.setattr(_HashingSink, "_out", filling)
        with pytest.raises(CacheError) as err:
            build_cache(cfg, data, teacher, engine="local", log=lambda *_: None)
    msg = str(err.value)
    assert msg.startswith("writing shard-0000") and "No space left on device" in msg and "teacher forward" not in msg
    path = next(tmp_path.glob("v1-*"))
    assert not list(path.glob(".shard-*.tmp"))
    assert set(p.name for p in path.glob("shard-*.tar")) == {e["file"] for e in Manifest.load(path).shards.values()}
    build_cache(cfg, data, teacher, engine="local", log=lambda *_: None)
    assert verify_cache(path).ok and len(list(path.glob("shard-*.tar"))) == 5


def test_an_interrupted_build_says_how_to_resume(tmp_path, teacher, tools, monkeypatch):
    data = tools.make_data(shards=4, per_shard=3, seed=4)
    cfg = tools.make_cfg(tmp_path)
    calls = [0]
    stop_at = random.Random(9).randrange(3, 7)  # a forward inside shard 1, 2 or 3 (2 forwards a shard)
    forward = ShardWorker.forward_batch

    def ctrl_c(self, tokens):
        calls[0] += 1
        if calls[0] == stop_at:
            raise KeyboardInterrupt
        return forward(self, tokens)

    logs = []
    with monkeypatch.context() as m:
        m.setattr(ShardWorker, "forward_batch", ctrl_c)
        with pytest.raises(KeyboardInterrupt):
            build_cache(cfg, data, teacher, engine="local", log=logs.append)
    done = (stop_at - 1) // 2
    assert any(f"interrupted: {done}/4 shards done" in line and "rerun `hmscale cache`" in line for line in logs)
    path = next(tmp_path.glob("v1-*"))
    assert len(Manifest.load(path).shards) == done and len(list(path.glob("shard-*.tar"))) == done
    assert not list(path.glob(".shard-*.tmp"))
    build_cache(cfg, data, teacher, engine="local", log=lambda *_: None)
    assert verify_cache(path).ok


def test_list_shows_empty_temporaries_and_views_whose_source_is_gone(tmp_path, teacher, data, tools):
    src = build_cache(tools.make_cfg(tmp_path, **{"cache.capture.topk": 4}), data, teacher, engine="local",
                      log=lambda *_: None)
    view = build_cache(tools.make_cfg(tmp_path, **{"cache.capture.layers": "[1]"}), data, teacher, engine="local",
                       log=lambda *_: None)
    assert Manifest.load(view).view_of == src.name
    (src / f".shard-000002.tar.{random.Random(1).randrange(10**6)}.tmp").write_bytes(b"")  # a worker killed at once
    text = format_catalog(list_caches(tmp_path), tmp_path)
    assert "(1 temporary files, 0 B)" in text and "source missing" not in text
    for p in src.iterdir():
        p.unlink()
    src.rmdir()
    assert "source missing" in format_catalog(list_caches(tmp_path), tmp_path)


def test_two_builds_saving_one_manifest_keep_each_others_shards(tmp_path, teacher, tools):
    """Builds of one cache from two runs (say 2 and 6 shards of the same capture) each hold the manifest in memory;
    whichever saves last keeps what the other recorded, except shards it found bad itself."""
    data = tools.make_data(shards=6, per_shard=3, seed=8)
    path = build_cache(tools.make_cfg(tmp_path, **{"cache.max_tokens": 6 * SHARD_TOKENS}), data, teacher,
                       engine="local", log=lambda *_: None)
    full = Manifest.load(path)
    rng = random.Random(6)
    mine = sorted(rng.sample(range(6), 3))
    theirs = sorted(set(range(6)) - set(mine))
    first = Manifest(json.loads(json.dumps(full.data)), full.path)  # both read the file before the other saved
    second = Manifest(json.loads(json.dumps(full.data)), full.path)
    for m, unseen in ((first, theirs), (second, mine)):  # each read the file before the other's shards were in it
        for sid in unseen:
            del m.data["shards"][str(sid)]
    second.save()  # `theirs` recorded
    first.save()  # saves last: must keep `theirs`
    assert sorted(Manifest.load(path).shards) == list(range(6)) and Manifest.load(path).complete
    bad = rng.choice(mine)
    first = Manifest.load(path)
    first.drop_shard(bad)  # found bad by this build: not taken back from the file
    first.save()
    assert sorted(Manifest.load(path).shards) == sorted(set(range(6)) - {bad})
