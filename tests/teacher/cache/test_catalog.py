"""`hmscale cache list`: a cache root's caches from their manifests (spec, progress, bytes), junk directories with the
reason, leftover temporary shard files counted."""

import json

from hmscale.teacher.cache import build_cache
from hmscale.teacher.cache.catalog import format_catalog, list_caches
from hmscale.teacher.cache.manifest import Manifest


def test_list_reports_each_cache_its_progress_bytes_and_the_junk(tmp_path, teacher, data, tools):
    full = build_cache(tools.make_cfg(tmp_path), data, teacher, engine="local")
    fp8 = build_cache(tools.make_cfg(tmp_path, **{"cache.capture.layers": "[1]", "cache.capture.dtype": "fp8_e4m3",
                                                  "cache.capture.topk": 4}), data, teacher, engine="local")
    # make the second one partial: a shard forgotten by the manifest, a dead worker's temporary file beside it
    m = Manifest.load(fp8)
    m.drop_shard(1)
    m.update_complete()
    m.save()
    (fp8 / ".shard-000001.tar.abc.tmp").write_bytes(b"x" * 1000)
    (tmp_path / "notes").mkdir()
    entries = {e.path.name: e for e in list_caches(tmp_path)}
    assert set(entries) == {full.name, fp8.name, "notes"}
    a, b, junk = entries[full.name], entries[fp8.name], entries["notes"]
    shards = sorted(full.glob("shard-*.tar"))
    assert a.complete and a.shards_done == a.shards_requested == len(shards) == 4
    assert a.bytes == sum(p.stat().st_size for p in shards) and a.tokens == 4 * 3 * 32
    assert a.layers == "0-1"  # all of the 2-layer teacher
    assert (b.layers, b.dtype, b.topk, b.complete, b.shards_done, b.shards_requested) == ("1", "fp8_e4m3", 4, False,
                                                                                         3, 4)
    assert len(b.temporaries) == 1 and junk.error and "no manifest.json" in junk.error
    table = format_catalog(list(entries.values()), tmp_path)
    assert "complete" in table and "partial" in table and "not a cache" in table
    assert "2 cache(s)" in table and "temporary files" in table


def test_cli_list_and_json(tmp_path, teacher, data, tools, capsys):
    from hmscale.cli import main

    path = build_cache(tools.make_cfg(tmp_path), data, teacher, engine="local")
    assert main(["cache", "list", str(tmp_path)]) == 0
    assert path.name in capsys.readouterr().out
    assert main(["cache", "list", str(tmp_path), "--json"]) == 0
    (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert row["key"] == path.name and row["complete"] and row["shards_done"] == 4
    assert main(["cache", "list", str(path)]) == 0  # a cache directory itself: its own row
    assert path.name in capsys.readouterr().out
    assert main(["cache", "list", str(tmp_path / "missing")]) == 2
    assert "missing does not exist; pass the folder holding the caches" in capsys.readouterr().err
