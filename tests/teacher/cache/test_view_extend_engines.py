"""A view's own shards (computed for it when its source lacks them) where tests/teacher/cache/test_cache_view_extend.py
does not go: the other engines (several local processes, Ray actors) and their workers killed mid-shard; two builds at
once (the same view; the source and a view onto it); readers split by rank, resumed, in DataLoader workers;
`hmscale cache list / rm / verify`; fp8 and token-fraction sources; a top-k-only view."""

import json
import tarfile
import textwrap
from pathlib import Path

import pytest
import torch

from hmscale.teacher.cache import CacheError, CacheReader, build_cache, open_for_run, verify_cache
from hmscale.teacher.cache.manifest import Manifest
from hmscale.teacher.cache.worker import FAULT_ENV

SHARD = 3 * 32  # tokens of one shard of the fixture's plan (3 rows of 32); the plan has 4
SOURCE = {"cache.capture.topk": 8, "cache.max_tokens": 2 * SHARD}  # shards 0, 1
WANT = {"cache.capture.topk": 4, "cache.capture.layers": "[1]", "cache.capture.tensors": "[attn_input]"}
ALL = {"cache.max_tokens": 4 * SHARD}


def _members(shard):
    with tarfile.open(shard) as tf:
        return [ti.name for ti in tf]


def _fields(shard):
    return {n.split(".", 1)[1] for n in _members(shard)}


def _own(view):
    return sorted(s for s, e in Manifest.load(view).shards.items() if e.get("own"))


def _samples(path, shards=None, layers=(1,)):
    r = CacheReader(path, shards=shards)
    return [r.sample(s, j, layers=list(layers) if r.spec.tensors else None, topk=bool(r.spec.topk))
            for s, j in r.order(shuffle=False)]


def _same(a, b):
    assert len(a) == len(b) and a
    for x, y in zip(a, b):
        assert x.keys() == y.keys() and x["key"] == y["key"]
        for k in x:
            if k == "layers":
                assert x[k].keys() == y[k].keys()
                for i in x[k]:
                    assert x[k][i].keys() == y[k][i].keys()
                    for t in x[k][i]:
                        assert torch.equal(x[k][i][t], y[k][i][t]), (x["key"], i, t)
            elif k != "key":
                assert torch.equal(x[k], y[k]), (x["key"], k)


def _source_and_view(tools, root, data, teacher, want=WANT, source=SOURCE):
    src = build_cache(tools.make_cfg(root, **source), data, teacher, engine="local")
    view = build_cache(tools.make_cfg(root, **want, **{"cache.max_tokens": source["cache.max_tokens"]}), data, teacher,
                       engine="local")
    assert Manifest.load(view).view_of == src.name
    return src, view


def _check_own(view, source, exact, own_ids):
    """``view``'s shards ``own_ids`` are its own: recorded so, in its directory, the bytes of a cache built for the
    request (``exact``); the others are read from ``source``; nothing else lies in the view."""
    m = Manifest.load(view)
    assert m.view_of == source.name and m.complete and _own(view) == sorted(own_ids)
    names = sorted(p.name for p in view.iterdir())
    assert names == ["manifest.json"] + [f"shard-{i:06d}.tar" for i in sorted(own_ids)], names  # nothing partial
    for i in own_ids:
        assert (view / f"shard-{i:06d}.tar").read_bytes() == (exact / f"shard-{i:06d}.tar").read_bytes(), i
    report = verify_cache(view)
    assert report.ok, report.summary()
    _same(_samples(view), _samples(exact, shards=sorted(m.shards)))


# ---------------------------------------------------------------------------------- several local processes


def test_a_view_extended_by_two_processes_holds_the_local_engines_bytes(tmp_path, teacher, data, tools):
    root = tmp_path / "root"
    source, view = _source_and_view(tools, root, data, teacher)
    assert build_cache(tools.make_cfg(root, **WANT, **ALL), data, teacher, engine="local",
                       devices=["cpu", "cpu"]) == view
    exact = build_cache(tools.make_cfg(tmp_path / "scratch", **WANT, **ALL), data, teacher, engine="local", device="cpu")
    _check_own(view, source, exact, [2, 3])
    assert _fields(view / "shard-000002.tar") == {"tokens.npy", "seq_idx.npy", "l001_attn_input.npy",
                                                  "topk_logprobs.npy", "topk_indices.npy"}
    assert sorted(Manifest.load(source).shards) == [0, 1]


def test_a_process_killed_extending_a_view_leaves_no_partial_shard(tmp_path, teacher, tools, monkeypatch):
    data = tools.make_data(shards=5, per_shard=3)
    root = tmp_path / "root"
    source, view = _source_and_view(tools, root, data, teacher)
    cfg = tools.make_cfg(root, **WANT, **{"cache.max_tokens": 5 * SHARD})
    monkeypatch.setenv(FAULT_ENV, f"3:{tmp_path / 'killed.txt'}")  # the process holding shard 3 dies mid-way
    with pytest.raises(CacheError, match=r"died .*rerun to finish"):
        build_cache(cfg, data, teacher, engine="local", devices=["cpu", "cpu"])
    assert (tmp_path / "killed.txt").exists()
    m = Manifest.load(view)
    assert m.view_of == source.name and not m.complete and 3 not in m.shards
    assert all(e.get("own") for s, e in m.shards.items() if s >= 2)
    assert not (view / "shard-000003.tar").exists() and not (source / "shard-000003.tar").exists()
    assert build_cache(cfg, data, teacher, engine="local", devices=["cpu", "cpu"]) == view  # (marker: no second fault)
    monkeypatch.delenv(FAULT_ENV)
    exact = build_cache(tools.make_cfg(tmp_path / "scratch", **WANT, **{"cache.max_tokens": 5 * SHARD}), data, teacher,
                        engine="local")
    _check_own(view, source, exact, [2, 3, 4])
    keys = [k for s in range(5) for k in CacheReader(view)._shard_index(s)["keys"]]
    assert len(keys) == len(set(keys)) == 15


# ---------------------------------------------------------------------------------- Ray


@pytest.mark.ray
def test_a_view_extended_by_ray_workers_holds_the_local_engines_bytes(ray_cluster, tmp_path, teacher, data, tools):
    root = tmp_path / "root"
    source, view = _source_and_view(tools, root, data, teacher)
    logs = []
    assert build_cache(tools.make_cfg(root, **WANT, **ALL, **{"cache.workers": 2}), data, teacher, engine="ray",
                       log=logs.append) == view
    assert any("2 Ray teacher-forward workers" in line and "2 shards to do" in line for line in logs), logs
    exact = build_cache(tools.make_cfg(tmp_path / "scratch", **WANT, **ALL), data, teacher, engine="local")
    _check_own(view, source, exact, [2, 3])


# ---------------------------------------------------------------------------------- two builds at once

_BUILDER = textwrap.dedent("""
    import json, os, sys, time
    from pathlib import Path
    sys.path.insert(0, {conftest_dir!r})
    from conftest import make_cfg, make_data, make_teacher
    from hmscale.teacher.cache import build_cache
    from hmscale.teacher.cache.worker import _default_capture

    def slow(teacher, ids, layers=None):  # long enough for the other build to start meanwhile
        time.sleep(0.4)
        return _default_capture(teacher, ids, layers)

    name, root, over, go = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), Path(sys.argv[4])
    teacher, data = make_teacher(), make_data()
    (go / ("ready-" + name)).touch()
    while len(list(go.glob("ready-*"))) < int(sys.argv[5]):
        time.sleep(0.02)
    logs = []
    path = build_cache(make_cfg(root, **over), data, teacher, engine="local", device="cpu", capture_fn=slow,
                       log=logs.append)
    print(json.dumps({{"path": str(path), "logs": logs}}))
""")


def _at_once(tmp_path, root, *requests):
    """Each request (a dict of overrides) built by a process of its own, all started together; their results."""
    script = tmp_path / "builder.py"
    script.write_text(_BUILDER.format(conftest_dir=str(Path(__file__).parent)))
    go = tmp_path / "go"
    go.mkdir()
    from tests.forked_python import start_python  # (processes from the suite's preloaded fork server)

    procs = [start_python([script, i, root, json.dumps(over), go, len(requests)], out=tmp_path / f"out{i}",
                          err=tmp_path / f"err{i}") for i, over in enumerate(requests)]
    outs = []
    for i, p in enumerate(procs):
        p.join(300)
        if p.exitcode is None:
            p.kill()
            p.join()
        assert p.exitcode == 0, (tmp_path / f"err{i}").read_text()[-3000:]
        outs.append(json.loads((tmp_path / f"out{i}").read_text().strip().splitlines()[-1]))
    return outs


@pytest.mark.slow
def test_two_processes_extending_one_view_at_once(tmp_path, teacher, data, tools):
    root = tmp_path / "root"
    source, view = _source_and_view(tools, root, data, teacher)
    a, b = _at_once(tmp_path, root, {**WANT, **ALL}, {**WANT, **ALL})
    assert a["path"] == b["path"] == str(view)
    logs = a["logs"] + b["logs"]
    assert sum("computing the other 2 shards" in line for line in logs) == 1, logs  # one computes, the other waits
    assert any("another process is building" in line for line in logs), logs
    exact = build_cache(tools.make_cfg(tmp_path / "scratch", **WANT, **ALL), data, teacher, engine="local")
    _check_own(view, source, exact, [2, 3])
    assert verify_cache(source).ok


@pytest.mark.slow
def test_the_source_extended_while_a_view_onto_it_is_extended(tmp_path, teacher, data, tools):
    root = tmp_path / "root"
    source, view = _source_and_view(tools, root, data, teacher)
    reader = CacheReader(view)  # a reader of the view as it was, open across both builds
    before = _samples(view)
    a, b = _at_once(tmp_path, root, {**SOURCE, **ALL}, {**WANT, **ALL})
    assert a["path"] == str(source) and b["path"] == str(view)
    assert verify_cache(source).ok and sorted(Manifest.load(source).shards) == [0, 1, 2, 3]
    m = Manifest.load(view)
    assert m.view_of == source.name and m.complete and sorted(m.shards) == [0, 1, 2, 3]
    report = verify_cache(view)
    assert report.ok, report.summary()
    # the view's shards 2, 3 are its own or its source's (whichever the race gave): the same samples either way
    exact = build_cache(tools.make_cfg(tmp_path / "scratch", **WANT, **ALL), data, teacher, engine="local")
    _same(_samples(view), _samples(exact))
    own = _own(view)
    assert sorted(p.name for p in view.glob("shard-*.tar")) == [f"shard-{i:06d}.tar" for i in own]
    _same([reader.sample(s, j, layers=[1], topk=True) for s, j in reader.order(shuffle=False)], before)
    exact_source = build_cache(tools.make_cfg(tmp_path / "scratch2", **{**SOURCE, **ALL}), data, teacher, engine="local")
    for i in range(4):
        assert (source / f"shard-{i:06d}.tar").read_bytes() == (exact_source / f"shard-{i:06d}.tar").read_bytes()


# ---------------------------------------------------------------------------------- a view's shards, found bad


def test_an_own_shard_found_bad_after_the_source_gained_it_leaves_no_stray_file(tmp_path, teacher, data, tools):
    """The view's own shard 3 is damaged; meanwhile the source was extended to hold shard 3. The next build reads
    shard 3 from the source, and the damaged file must not stay behind in the view (where verify calls it a stray
    shard, for ever)."""
    root = tmp_path / "root"
    source, view = _source_and_view(tools, root, data, teacher)
    cfg = tools.make_cfg(root, **WANT, **ALL)
    build_cache(cfg, data, teacher, engine="local")
    assert _own(view) == [2, 3]
    build_cache(tools.make_cfg(root, **{**SOURCE, **ALL}), data, teacher, engine="local")  # the source gets 2, 3 too
    (view / "shard-000003.tar").write_bytes(b"x" * 10)
    assert build_cache(cfg, data, teacher, engine="local") == view
    report = verify_cache(view)
    assert report.ok, report.summary()
    assert _own(view) == [2] and sorted(p.name for p in view.glob("shard-*.tar")) == ["shard-000002.tar"]


def test_an_unrecorded_own_shard_is_not_left_stray_when_the_source_holds_it(tmp_path, teacher, data, tools):
    """A build killed between a shard's rename and the manifest's save leaves the shard on disk, unrecorded; a later
    build that reads that shard from the source (now holding it) must not leave it there as a stray shard."""
    root = tmp_path / "root"
    source, view = _source_and_view(tools, root, data, teacher)
    cfg = tools.make_cfg(root, **WANT, **ALL)
    build_cache(cfg, data, teacher, engine="local")
    m = json.loads((view / "manifest.json").read_text())
    del m["shards"]["3"]  # as if the build died before recording it
    m["complete"] = False
    (view / "manifest.json").write_text(json.dumps(m))
    build_cache(tools.make_cfg(root, **{**SOURCE, **ALL}), data, teacher, engine="local")
    assert build_cache(cfg, data, teacher, engine="local") == view
    report = verify_cache(view)
    assert report.ok, report.summary()


def test_a_view_whose_manifest_was_lost_leaves_no_stray_own_shards(tmp_path, teacher, data, tools):
    """A view with own shards whose manifest is damaged, its source since extended: the next build writes a new view
    reading every shard from the source; the old own shards, named by no manifest, are removed (else verify calls
    them strays for ever)."""
    root = tmp_path / "root"
    source, view = _source_and_view(tools, root, data, teacher)
    cfg = tools.make_cfg(root, **WANT, **ALL)
    build_cache(cfg, data, teacher, engine="local")
    build_cache(tools.make_cfg(root, **{**SOURCE, **ALL}), data, teacher, engine="local")
    (view / "manifest.json").write_text("{broken")
    assert build_cache(cfg, data, teacher, engine="local") == view
    m = Manifest.load(view)
    assert m.view_of == source.name and m.complete and _own(view) == [] and not list(view.glob("shard-*.tar"))
    report = verify_cache(view)
    assert report.ok, report.summary()


# ---------------------------------------------------------------------------------- readers


def _batches(ld):
    return [(b["keys"], b["tokens"], b["layers"][1]["attn_input"] if "layers" in b else None,
             b.get("topk_logprobs"), b.get("topk_indices")) for b in ld]


def _eq_batches(x, y):
    assert len(x) == len(y) and x
    for a, b in zip(x, y):
        assert a[0] == b[0]
        for u, v in zip(a[1:], b[1:]):
            assert (u is None and v is None) or torch.equal(u, v)


def test_readers_of_an_extended_view_see_a_cache_built_for_the_request(tmp_path, teacher, data, tools):
    root = tmp_path / "root"
    source, view = _source_and_view(tools, root, data, teacher)
    cfg = tools.make_cfg(root, **WANT, **ALL)
    build_cache(cfg, data, teacher, engine="local")
    assert _own(view) == [2, 3]
    exact = build_cache(tools.make_cfg(tmp_path / "scratch", **WANT, **ALL), data, teacher, engine="local")
    for stage in (None, "stage1", "stage2"):
        got, ref = open_for_run(cfg, view, stage), open_for_run(cfg, exact, stage)
        assert got.shard_ids == ref.shard_ids
        for world in (1, 2):
            for rank in range(world):
                kw = dict(rank=rank, world_size=world, seed=5)
                _eq_batches(_batches(got.stage1_batches([1], 2, **kw)), _batches(ref.stage1_batches([1], 2, **kw)))
                _eq_batches(_batches(got.stage2_batches(2, **kw)), _batches(ref.stage2_batches(2, **kw)))
                # resumed from a position, in the next epoch
                g, r = got.stage2_batches(2, epoch=1, start=1, **kw), ref.stage2_batches(2, epoch=1, start=1, **kw)
                _eq_batches(_batches(g), _batches(r))
                assert g.state_dict() == r.state_dict()
    # DataLoader workers
    got, ref = open_for_run(cfg, view), open_for_run(cfg, exact)
    for ld_of in (lambda r: r.stage1_batches([1], 2, seed=1, world_size=2, rank=1), lambda r: r.stage2_batches(3, seed=2)):
        g, r = ld_of(got), ld_of(ref)
        g.set_epoch(1, 1)
        r.set_epoch(1, 1)
        dg = torch.utils.data.DataLoader(g, batch_size=None, num_workers=2)
        dr = torch.utils.data.DataLoader(r, batch_size=None, num_workers=2)
        _eq_batches(_batches(dg), _batches(dr))


# ---------------------------------------------------------------------------------- cache list / rm / verify


def test_cache_list_rm_verify_with_own_shards(tmp_path, teacher, data, tools, capsys):
    from hmscale.cli import main

    root = tmp_path / "root"
    source, view = _source_and_view(tools, root, data, teacher)
    build_cache(tools.make_cfg(root, **WANT, **ALL), data, teacher, engine="local")
    capsys.readouterr()
    assert main(["cache", "list", str(root), "--json"]) == 0
    rows = {r["key"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    own_bytes = sum((view / f"shard-{i:06d}.tar").stat().st_size for i in (2, 3))
    assert rows[view.name]["view_of"] == source.name and rows[view.name]["bytes"] == own_bytes
    assert rows[view.name]["shards_done"] == 4
    assert main(["cache", "list", str(root)]) == 0
    assert f"view of {source.name}" in capsys.readouterr().out

    assert main(["cache", "verify", str(view)]) == 0
    assert "4 shards" in capsys.readouterr().out
    # a bad own shard is named in the view's directory; a bad source shard in the source's
    good = (view / "shard-000003.tar").read_bytes()
    (view / "shard-000003.tar").write_bytes(good[:-512])
    assert main(["cache", "verify", str(view)]) == 1
    err = capsys.readouterr().err
    assert f"bad shard shard-000003.tar (in {view}, the view's own)" in err and str(source) not in err, err
    (view / "shard-000003.tar").write_bytes(good)
    good = (source / "shard-000001.tar").read_bytes()
    (source / "shard-000001.tar").write_bytes(good[:-512])
    assert main(["cache", "verify", str(view)]) == 1
    err = capsys.readouterr().err
    assert f"bad shard shard-000001.tar (in {source}, read through this view)" in err, err
    assert main(["cache", "verify", str(source)]) == 1
    assert "bad shard shard-000001.tar: " in capsys.readouterr().err  # (a cache's own directory: named above)
    (source / "shard-000001.tar").write_bytes(good)

    assert main(["cache", "rm", str(source)]) == 2  # the view reads it: refused
    assert f"({view.name})" in capsys.readouterr().err and source.exists() and (view / "shard-000002.tar").exists()
    assert main(["cache", "rm", str(source), "--force"]) == 0
    assert capsys.readouterr().out.split() == ["removed", str(view), "removed", str(source)]
    assert not source.exists() and not view.exists()


def test_cache_rm_of_a_view_with_own_shards_keeps_its_source(tmp_path, teacher, data, tools, capsys):
    from hmscale.cli import main

    root = tmp_path / "root"
    source, view = _source_and_view(tools, root, data, teacher)
    build_cache(tools.make_cfg(root, **WANT, **ALL), data, teacher, engine="local")
    capsys.readouterr()
    assert main(["cache", "rm", str(view)]) == 0 and not view.exists()
    assert verify_cache(source).ok and sorted(Manifest.load(source).shards) == [0, 1]


# ---------------------------------------------------------------------------------- fp8, token fraction, top-k only


@pytest.mark.parametrize("stored", [
    {"cache.capture.dtype": "fp8_e4m3"},
    {"cache.capture.token_fraction": 0.25, "cache.capture.seed": 3},
    {"cache.capture.dtype": "fp8_e4m3", "cache.capture.token_fraction": 0.5},
])
def test_a_view_over_an_fp8_or_thinned_source_extended(tmp_path, teacher, data, tools, stored):
    root = tmp_path / "root"
    src = {**SOURCE, **stored}
    want = {**WANT, "cache.capture.tensors": "[attn_input,attn_output]", **stored}
    source, view = _source_and_view(tools, root, data, teacher, want=want, source=src)
    build_cache(tools.make_cfg(root, **want, **ALL), data, teacher, engine="local")
    exact = build_cache(tools.make_cfg(tmp_path / "scratch", **want, **ALL), data, teacher, engine="local")
    _check_own(view, source, exact, [2, 3])
    fields = _fields(view / "shard-000002.tar")
    assert ("positions.npy" in fields) == ("cache.capture.token_fraction" in stored)
    assert ("l001_attn_output_scale.npy" in fields) == (stored.get("cache.capture.dtype") == "fp8_e4m3")
    assert not any(f.startswith("l000") for f in fields)


@pytest.mark.parametrize("stored", [{}, {"cache.capture.dtype": "fp8_e4m3"},
                                    {"cache.capture.token_fraction": 0.5}])
def test_a_topk_only_view_extended_holds_only_the_topk(tmp_path, teacher, data, tools, stored):
    root = tmp_path / "root"
    want = {"cache.capture.topk": 3, "cache.capture.tensors": "[]", **{k: v for k, v in stored.items()
                                                                       if k == "cache.capture.token_fraction"}}
    source, view = _source_and_view(tools, root, data, teacher, want=want, source={**SOURCE, **stored})
    cfg = tools.make_cfg(root, **want, **ALL)
    build_cache(cfg, data, teacher, engine="local")
    exact = build_cache(tools.make_cfg(tmp_path / "scratch", **want, **ALL), data, teacher, engine="local")
    _check_own(view, source, exact, [2, 3])
    want_fields = {"tokens.npy", "seq_idx.npy", "topk_logprobs.npy", "topk_indices.npy"}
    if stored.get("cache.capture.token_fraction"):
        want_fields.add("positions.npy")
    assert _fields(view / "shard-000003.tar") == want_fields
    _eq_batches(_batches(open_for_run(cfg, view, "stage2").stage2_batches(2, seed=4)),
                _batches(open_for_run(cfg, exact, "stage2").stage2_batches(2, seed=4)))
