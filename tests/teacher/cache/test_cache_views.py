"""Views: a request contained in an existing cache reads it (no teacher forward), bit for bit what its own cache holds."""

import pytest
import torch

from hmscale.teacher.cache import CacheReader, build_cache, verify_cache
from hmscale.teacher.cache.catalog import format_catalog, list_caches
from hmscale.teacher.cache.manifest import Manifest


def _no_forward(monkeypatch):
    monkeypatch.setattr("hmscale.teacher.cache.worker.ShardWorker.forward_batch",
                        lambda *a, **k: pytest.fail("a covered request must not run the teacher"))


def _samples(path, layers):
    r = CacheReader(path)
    return [r.sample(s, j, layers=layers, topk=bool(r.spec.topk)) for s, j in r.order(shuffle=False)]


def test_a_covered_request_is_a_view_equal_to_its_own_cache(tmp_path, teacher, data, tools, monkeypatch):
    full = build_cache(tools.make_cfg(tmp_path / "root", **{"cache.capture.topk": 8}), data, teacher, engine="local")
    want_cfg = {"cache.capture.topk": 4, "cache.capture.layers": "[1]", "cache.capture.tensors": "[attn_input]"}
    exact = build_cache(tools.make_cfg(tmp_path / "elsewhere", **want_cfg), data, teacher, engine="local")

    with monkeypatch.context() as m:
        _no_forward(m)
        logs = []
        view = build_cache(tools.make_cfg(tmp_path / "root", **want_cfg), data, teacher, engine="local", log=logs.append)
        assert view.name == exact.name and view != full  # the request's own key, in the shared root
        assert any(f"reusing {full.name} as a view (layers [1] of 2, tensors attn_input of attn_input+attn_output, "
                   "top-4 of top-8)" in line for line in logs), logs
        assert [p.name for p in view.iterdir()] == ["manifest.json"]  # no shard bytes of its own
        assert Manifest.load(view).view_of == full.name
        again = []
        assert build_cache(tools.make_cfg(tmp_path / "root", **want_cfg), data, teacher, engine="local",
                           log=again.append) == view
        assert any("a view onto" in line and "no teacher forward" in line for line in again), again

    got, ref = _samples(view, [1]), _samples(exact, [1])
    assert len(got) == len(ref) == 12
    for g, r in zip(got, ref):
        assert g["key"] == r["key"] and torch.equal(g["tokens"], r["tokens"]) and torch.equal(g["positions"], r["positions"])
        assert set(g["layers"][1]) == {"attn_input"} and torch.equal(g["layers"][1]["attn_input"], r["layers"][1]["attn_input"])
        assert g["topk_indices"].shape[-1] == 4
        assert torch.equal(g["topk_indices"], r["topk_indices"]) and torch.equal(g["topk_logprobs"], r["topk_logprobs"])
    assert verify_cache(view).ok
    with pytest.raises(Exception, match=r"holds layers \[1\], not \[0\]"):
        CacheReader(view).sample(0, 0, layers=[0])

    # `cache list`: the view counts no bytes of its own
    entries = {e.key: e for e in list_caches(tmp_path / "root")}
    assert entries[view.name].view_of == full.name and entries[view.name].bytes == 0
    assert f"view of {full.name}" in format_catalog(list(entries.values()), tmp_path / "root")


@pytest.mark.parametrize("over", [{"cache.capture.topk": 16}, {"cache.capture.dtype": "float32"},
                                  {"cache.capture.token_fraction": 0.5}])
def test_what_the_cache_does_not_hold_is_built(tmp_path, teacher, data, tools, over):
    full = build_cache(tools.make_cfg(tmp_path, **{"cache.capture.topk": 8}), data, teacher, engine="local")
    logs = []
    other = build_cache(tools.make_cfg(tmp_path, **over), data, teacher, engine="local", log=logs.append)
    assert other != full and Manifest.load(other).view_of is None
    assert not any("as a view" in line for line in logs)


def test_a_view_whose_source_lost_a_shard_is_rebuilt(tmp_path, teacher, data, tools):
    full = build_cache(tools.make_cfg(tmp_path, **{"cache.capture.topk": 8}), data, teacher, engine="local")
    cfg = tools.make_cfg(tmp_path, **{"cache.capture.topk": 0})
    view = build_cache(cfg, data, teacher, engine="local")
    assert Manifest.load(view).view_of == full.name
    (full / "shard-000001.tar").unlink()
    with pytest.raises(Exception, match=rf"shard-000001.tar in {full} \(read through the view {view}\) is corrupted"):
        CacheReader(view).sample(1, 0)
    logs = []
    assert build_cache(cfg, data, teacher, engine="local", log=logs.append) == view
    assert any("replacing it with a cache of its own" in line for line in logs), logs
    assert Manifest.load(view).view_of is None and verify_cache(view).ok and len(list(view.glob("shard-*.tar"))) == 4


def test_a_run_reads_its_own_shards_whatever_others_added(tmp_path, teacher, data, tools):
    from hmscale.teacher.cache import open_for_run

    big = tools.make_cfg(tmp_path, **{"cache.max_tokens": 4 * 96})
    small = tools.make_cfg(tmp_path, **{"cache.max_tokens": 2 * 96})
    path = build_cache(big, data, teacher, engine="local")
    assert build_cache(small, data, teacher, engine="local") == path  # the same capture: the same cache
    assert CacheReader(path).shard_ids == [0, 1, 2, 3]
    from hmscale.teacher.cache.build import plan_meta, run_shard_ids

    mine = run_shard_ids(small, plan_meta(data.plan))  # two of the four (the first of the plan's fixed shard order)
    assert len(mine) == 2 and set(mine) < {0, 1, 2, 3}
    assert open_for_run(small, path).shard_ids == mine and open_for_run(big, path).shard_ids == [0, 1, 2, 3]
    fresh = build_cache(tools.make_cfg(tmp_path / "fresh", **{"cache.max_tokens": 2 * 96}), data, teacher, engine="local")
    assert open_for_run(small, path).order(seed=3) == open_for_run(small, fresh).order(seed=3)
    with pytest.raises(Exception, match="lacks 2 of the run's shards"):
        open_for_run(big, fresh)


def test_cache_rm_keeps_views_from_breaking_silently(tmp_path, teacher, data, tools, capsys, monkeypatch):
    from hmscale.cli import main

    full = build_cache(tools.make_cfg(tmp_path, **{"cache.capture.topk": 8}), data, teacher, engine="local")
    view = build_cache(tools.make_cfg(tmp_path, **{"cache.capture.topk": 0}), data, teacher, engine="local")
    capsys.readouterr()
    assert main(["cache", "rm", str(full)]) == 2  # a view reads it: refused, naming the view
    assert f"read {full.name}'s shards ({view.name})" in capsys.readouterr().err and full.exists() and view.exists()
    (tmp_path / "not-a-cache").mkdir()
    assert main(["cache", "rm", str(tmp_path / "not-a-cache")]) == 2 and (tmp_path / "not-a-cache").exists()
    (tmp_path / "link").symlink_to(full)
    assert main(["cache", "rm", str(tmp_path / "link"), "--force"]) == 2 and full.exists()
    assert "is a link; pass the cache directory itself" in capsys.readouterr().err
    monkeypatch.chdir(full)  # `.` names the cache: its views are still found (and still refused)
    assert main(["cache", "rm", "."]) == 2 and f"({view.name})" in capsys.readouterr().err
    monkeypatch.chdir(tmp_path)
    assert main(["cache", "rm", str(full), "--force"]) == 0
    assert capsys.readouterr().out.split() == ["removed", str(view), "removed", str(full)]
    assert not full.exists() and not view.exists()


def test_two_builds_replacing_one_view_do_not_delete_each_others_shards(tmp_path, teacher, data, tools):
    """Two runs started together whose view onto a damaged source must be replaced: the view was deleted outside the
    build lock, so the second build could delete the shards the first was writing. Now under the lock, re-checked:
    both end with the same verified cache of its own."""
    import threading

    full = build_cache(tools.make_cfg(tmp_path, **{"cache.capture.topk": 8}), data, teacher, engine="local")
    cfg = tools.make_cfg(tmp_path, **{"cache.capture.topk": 0})
    view = build_cache(cfg, data, teacher, engine="local")
    (full / "shard-000002.tar").unlink()
    results, errors = [], []

    def build():
        try:
            results.append(build_cache(cfg, data, teacher, engine="local", log=lambda *_: None))
        except Exception as err:  # noqa: BLE001 (reported below)
            errors.append(err)

    threads = [threading.Thread(target=build) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert results == [view, view]
    assert Manifest.load(view).view_of is None and verify_cache(view).ok and len(list(view.glob("shard-*.tar"))) == 4
