"""Views of caches reused across many runs: a view replaced by one build while another
had found it broken too; the own shards of a view whose source lost a shard; `cache list` of a partial view."""

import pytest

from hmscale.teacher.cache import build, build_cache, verify_cache
from hmscale.teacher.cache.manifest import Manifest

SHARD = 3 * 32  # tokens of one shard of the fixture's plan (3 rows of 32); the plan has 4


def test_a_view_another_build_already_replaced_is_not_deleted_again(tmp_path, teacher, data, tools, forwarded,
                                                                     monkeypatch):
    """Two runs find their view's source damaged: the first replaces the view (here by a view onto another cache,
    with a shard of its own); the second, which had found the old view broken, deleted that new view under the lock
    too (its own shard with it: computed again, gone from under the first run's readers; with own shards kept since,
    the new view's manifest, so a reader opening it meanwhile found no cache)."""
    root = tmp_path / "root"
    source = build_cache(tools.make_cfg(root, **{"cache.capture.topk": 4, "cache.max_tokens": 2 * SHARD}), data,
                         teacher, engine="local")
    cfg = tools.make_cfg(root, **{"cache.capture.topk": 2, "cache.max_tokens": 3 * SHARD})
    view = build_cache(cfg, data, teacher, engine="local")  # shards 0, 1 read from the source; 2 its own
    other = build_cache(tools.make_cfg(root, **{"cache.capture.topk": 8, "cache.max_tokens": 2 * SHARD}), data,
                        teacher, engine="local")
    assert Manifest.load(view).view_of == source.name
    (source / "shard-000000.tar").write_bytes(b"damaged")
    forwarded.clear()

    real, first = build.existing_shards, []

    def check(*a, **k):  # the second run checks its view: the first run replaces it meanwhile
        if not first:
            first.append(None)
            first[0] = build_cache(cfg, data, teacher, engine="local", log=lambda *_: None)
        return real(*a, **k)

    monkeypatch.setattr(build, "existing_shards", check)
    lines = []
    assert build_cache(cfg, data, teacher, engine="local", log=lines.append) == view
    assert first == [view] and forwarded == []  # (the first run kept shard 2, the view's own)
    assert not any("replacing it" in line for line in lines), lines  # the second found it mended: left as it is
    m = Manifest.load(view)
    assert m.view_of == other.name and sorted(s for s, e in m.shards.items() if e.get("own")) == [2]
    assert verify_cache(view).ok


def test_cache_list_says_a_view_is_partial(tmp_path, teacher, data, tools, monkeypatch, capsys):
    """A view interrupted while its own shards were computed is partial: `cache list` said only "view of <key>" (the
    state column's complete / partial was replaced), so it read as finished."""
    from hmscale.cli import main
    from hmscale.teacher.cache.worker import ShardWorker

    root = tmp_path / "root"
    source = build_cache(tools.make_cfg(root, **{"cache.capture.topk": 4, "cache.max_tokens": 2 * SHARD}), data,
                         teacher, engine="local")
    cfg = tools.make_cfg(root, **{"cache.capture.topk": 2, "cache.max_tokens": 3 * SHARD})

    def interrupted(self, shard_ids, *a, **k):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(ShardWorker, "run_shards", interrupted)
        with pytest.raises(KeyboardInterrupt):
            build_cache(cfg, data, teacher, engine="local", log=lambda *_: None)
    view = next(p for p in root.iterdir() if p.name not in (source.name, ".locks"))
    assert not Manifest.load(view).complete
    capsys.readouterr()
    assert main(["cache", "list", str(root)]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith(view.name))
    assert f"view of {source.name}, partial" in row, row
    build_cache(cfg, data, teacher, engine="local", log=lambda *_: None)
    assert main(["cache", "list", str(root)]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith(view.name))
    assert f"view of {source.name}" in row and "partial" not in row, row


@pytest.mark.parametrize("other", [False, True])
def test_a_view_replaced_after_its_source_lost_a_shard_keeps_the_shards_computed_for_it(
        tmp_path, teacher, data, tools, forwarded, other):
    """A view whose source lost a shard it reads is replaced (by a cache of its own, or a view onto another cache
    holding the shards): its own shards, verified and byte for byte what either holds, were deleted with it and
    computed again (for a view extended far past a small source: nearly the whole teacher pass)."""
    root = tmp_path / "root"
    source = build_cache(tools.make_cfg(root, **{"cache.capture.topk": 4, "cache.max_tokens": 2 * SHARD}), data,
                         teacher, engine="local")
    cfg = tools.make_cfg(root, **{"cache.capture.topk": 2, "cache.max_tokens": 4 * SHARD})
    view = build_cache(cfg, data, teacher, engine="local")  # shards 0, 1 read from the source; 2, 3 its own
    own = {i: (view / f"shard-{i:06d}.tar").read_bytes() for i in (2, 3)}
    if other:  # a cache holding the source's shards too (made after the view, which read the smaller source)
        other = build_cache(tools.make_cfg(root, **{"cache.capture.topk": 8, "cache.max_tokens": 2 * SHARD}), data,
                            teacher, engine="local")
    (source / "shard-000001.tar").unlink()
    forwarded.clear()
    lines = []
    assert build_cache(cfg, data, teacher, engine="local", log=lines.append) == view
    assert any("replacing it with a cache of its own" in line for line in lines), lines
    m = Manifest.load(view)
    assert forwarded == ([] if other else [0, 1]), forwarded  # never 2 or 3 again
    assert m.view_of == (other.name if other else None) and sorted(m.shards) == [0, 1, 2, 3] and m.complete
    assert sorted(s for s, e in m.shards.items() if e.get("own")) == ([2, 3] if other else [])
    assert {i: (view / f"shard-{i:06d}.tar").read_bytes() for i in (2, 3)} == own
    assert sorted(p.name for p in view.glob("shard-*.tar")) == [f"shard-{i:06d}.tar" for i in ([2, 3] if other else
                                                                                                 range(4))]
    assert verify_cache(view).ok
    exact = build_cache(tools.make_cfg(tmp_path / "scratch", **{"cache.capture.topk": 2, "cache.max_tokens": 4 * SHARD}),
                        data, teacher, engine="local")
    for i in [2, 3] if other else range(4):  # (the others: read from the top-8 cache)
        assert (view / f"shard-{i:06d}.tar").read_bytes() == (exact / f"shard-{i:06d}.tar").read_bytes(), i
