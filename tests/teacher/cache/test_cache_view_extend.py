"""A view asked for more shards than its source holds: only the missing shards get a teacher forward, at the view's
own capture spec, into the view's own directory; the shards the source holds are still read from it. Readers return
bit for bit what a cache built from scratch for the request returns, and `verify` checks every shard wherever it
lies. (Before: the whole request was rebuilt, every shard through the teacher.)"""

import json
import tarfile

import pytest
import torch

from hmscale.teacher.cache import CacheReader, build_cache, verify_cache
from hmscale.teacher.cache.catalog import list_caches
from hmscale.teacher.cache.manifest import Manifest

SHARD = 3 * 32  # tokens of one shard of the fixture's plan (3 rows of 32)
SOURCE = {"cache.capture.topk": 8, "cache.max_tokens": 2 * SHARD}  # shards 0, 1 of the plan's 4
WANT = {"cache.capture.topk": 4, "cache.capture.layers": "[1]", "cache.capture.tensors": "[attn_input]"}


def _equal_reads(got_dir, ref_dir, layers=(1,)):
    got, ref = CacheReader(got_dir), CacheReader(ref_dir)
    assert got.shard_ids == ref.shard_ids
    order = ref.order(shuffle=False)
    assert got.order(shuffle=False) == order and len(order) == 3 * len(ref.shard_ids)
    for s, j in order:
        g, r = got.sample(s, j, layers=list(layers), topk=True), ref.sample(s, j, layers=list(layers), topk=True)
        assert g["key"] == r["key"] and torch.equal(g["tokens"], r["tokens"]) and torch.equal(g["seq_idx"], r["seq_idx"])
        assert torch.equal(g["positions"], r["positions"])
        for i in layers:
            assert g["layers"][i].keys() == r["layers"][i].keys()
            for t in r["layers"][i]:
                assert torch.equal(g["layers"][i][t], r["layers"][i][t]), (s, j, i, t)
        assert torch.equal(g["topk_indices"], r["topk_indices"]) and torch.equal(g["topk_logprobs"], r["topk_logprobs"])


def _members(shard):
    with tarfile.open(shard) as tf:
        return {ti.name.split(".", 1)[1] for ti in tf}


def test_a_view_asked_for_more_shards_computes_only_the_missing_ones(tmp_path, teacher, data, tools, forwarded):
    root = tmp_path / "root"
    source = build_cache(tools.make_cfg(root, **SOURCE), data, teacher, engine="local")
    view = build_cache(tools.make_cfg(root, **WANT, **{"cache.max_tokens": 2 * SHARD}), data, teacher, engine="local")
    assert Manifest.load(view).view_of == source.name
    forwarded.clear()

    logs = []
    bigger = tools.make_cfg(root, **WANT, **{"cache.max_tokens": 4 * SHARD})
    assert build_cache(bigger, data, teacher, engine="local", log=logs.append) == view
    assert sorted(forwarded) == [2, 3], "only the shards the source lacks get a teacher forward"
    m = Manifest.load(view)
    assert m.view_of == source.name and m.complete and sorted(m.shards) == [0, 1, 2, 3]
    assert any("2 shards read from " + source.name in line and "2 computed" in line for line in logs), logs
    # the new shards are the view's own, at the request's spec (layer 1's attn_input, top-4), never the source's
    assert sorted(p.name for p in view.glob("shard-*.tar")) == ["shard-000002.tar", "shard-000003.tar"]
    assert _members(view / "shard-000002.tar") == {"tokens.npy", "seq_idx.npy", "l001_attn_input.npy",
                                                  "topk_logprobs.npy", "topk_indices.npy"}
    assert sorted(Manifest.load(source).shards) == [0, 1]  # the source is left as it was

    exact = build_cache(tools.make_cfg(tmp_path / "scratch", **WANT, **{"cache.max_tokens": 4 * SHARD}), data, teacher,
                        engine="local")
    for name in ("shard-000002.tar", "shard-000003.tar"):  # the same bytes a cache built for the request holds
        assert (view / name).read_bytes() == (exact / name).read_bytes()
    _equal_reads(view, exact)

    report = verify_cache(view)
    assert report.ok and len(report.shards_ok) == 4 and report.samples == 12, report.summary()
    entry = {e.key: e for e in list_caches(root)}[view.name]
    assert entry.view_of == source.name and entry.shards_done == 4
    assert entry.bytes == sum((view / n).stat().st_size for n in ("shard-000002.tar", "shard-000003.tar"))

    forwarded.clear()
    again = []  # a rerun finds everything and runs no teacher forward
    assert build_cache(bigger, data, teacher, engine="local", log=again.append) == view and not forwarded
    assert any("2 shards read from " + source.name in line and "2 computed" in line and "no teacher forward" in line
               for line in again), again


def test_a_first_request_bigger_than_its_source_reads_what_the_source_holds(tmp_path, teacher, data, tools, forwarded):
    root = tmp_path / "root"
    source = build_cache(tools.make_cfg(root, **SOURCE), data, teacher, engine="local")
    forwarded.clear()
    logs = []
    view = build_cache(tools.make_cfg(root, **WANT, **{"cache.max_tokens": 3 * SHARD}), data, teacher, engine="local",
                       log=logs.append)
    assert sorted(forwarded) == [2]
    assert Manifest.load(view).view_of == source.name
    assert any(f"reusing {source.name} as a view" in line and "2 shards read from it" in line for line in logs), logs
    exact = build_cache(tools.make_cfg(tmp_path / "scratch", **WANT, **{"cache.max_tokens": 3 * SHARD}), data, teacher,
                        engine="local")
    _equal_reads(view, exact)
    assert verify_cache(view).ok


def test_a_view_extended_after_its_source_grew_reads_the_new_shards_from_it(tmp_path, teacher, data, tools, forwarded):
    root = tmp_path / "root"
    source = build_cache(tools.make_cfg(root, **SOURCE), data, teacher, engine="local")
    view = build_cache(tools.make_cfg(root, **WANT, **{"cache.max_tokens": 2 * SHARD}), data, teacher, engine="local")
    assert build_cache(tools.make_cfg(root, **{**SOURCE, "cache.max_tokens": 4 * SHARD}), data, teacher,
                       engine="local") == source  # the source itself extended to all four shards
    forwarded.clear()
    assert build_cache(tools.make_cfg(root, **WANT, **{"cache.max_tokens": 4 * SHARD}), data, teacher,
                       engine="local") == view
    assert not forwarded and not list(view.glob("shard-*.tar")) and sorted(Manifest.load(view).shards) == [0, 1, 2, 3]


def test_a_lost_shard_is_still_found_wherever_it_lies(tmp_path, teacher, data, tools):
    root = tmp_path / "root"
    source = build_cache(tools.make_cfg(root, **SOURCE), data, teacher, engine="local")
    cfg = tools.make_cfg(root, **WANT, **{"cache.max_tokens": 4 * SHARD})
    view = build_cache(cfg, data, teacher, engine="local")

    # an own shard damaged: named in the view, reported by verify and the reader, redone alone by the next build
    (view / "shard-000003.tar").write_bytes(b"x" * 10)
    report = verify_cache(view)
    assert not report.ok and list(report.bad) == ["shard-000003.tar"]
    with pytest.raises(Exception, match=rf"shard-000003.tar in {view} is corrupted"):
        CacheReader(view).sample(3, 0)
    logs = []
    assert build_cache(cfg, data, teacher, engine="local", log=logs.append) == view
    assert Manifest.load(view).view_of == source.name and verify_cache(view).ok

    # a source shard lost: as for any view, detected, and the view replaced by a cache of its own
    (source / "shard-000001.tar").unlink()
    report = verify_cache(view)
    assert not report.ok and list(report.bad) == ["shard-000001.tar"]
    with pytest.raises(Exception, match=rf"shard-000001.tar in {source} \(read through the view {view}\) is corrupted"):
        CacheReader(view).sample(1, 0)
    logs = []
    assert build_cache(cfg, data, teacher, engine="local", log=logs.append) == view
    assert any("replacing it with a cache of its own" in line for line in logs), logs
    assert Manifest.load(view).view_of is None and verify_cache(view).ok and len(list(view.glob("shard-*.tar"))) == 4


def test_a_view_manifest_of_the_earlier_kind_still_loads(tmp_path, teacher, data, tools, forwarded):
    """Views written before views held shards of their own have no `own_layout`: they load, read and verify as
    before, and one asked for more shards is extended like any view; a shard marked as the view's own in such a
    manifest is refused in one line."""
    root = tmp_path / "root"
    build_cache(tools.make_cfg(root, **SOURCE), data, teacher, engine="local")
    view = build_cache(tools.make_cfg(root, **WANT, **{"cache.max_tokens": 2 * SHARD}), data, teacher, engine="local")
    path = view / "manifest.json"
    old = json.loads(path.read_text())
    del old["own_layout"]
    path.write_text(json.dumps(old))
    exact = build_cache(tools.make_cfg(tmp_path / "scratch", **WANT, **{"cache.max_tokens": 4 * SHARD}), data, teacher,
                        engine="local")
    assert verify_cache(view).ok
    got, ref = CacheReader(view), CacheReader(exact, shards=[0, 1])
    for s, j in ref.order(shuffle=False):
        assert torch.equal(got.sample(s, j, layers=[1], topk=True)["topk_logprobs"],
                           ref.sample(s, j, layers=[1], topk=True)["topk_logprobs"])

    marked = json.loads(json.dumps(old))
    marked["shards"]["0"]["own"] = True
    path.write_text(json.dumps(marked))
    with pytest.raises(Exception, match="has no own_layout"):
        Manifest.load(view)
    path.write_text(json.dumps(old))

    forwarded.clear()
    assert build_cache(tools.make_cfg(root, **WANT, **{"cache.max_tokens": 4 * SHARD}), data, teacher,
                       engine="local") == view
    assert sorted(forwarded) == [2, 3] and "own_layout" in json.loads(path.read_text())
    _equal_reads(view, exact)
    assert verify_cache(view).ok
