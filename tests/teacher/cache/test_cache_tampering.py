"""One teacher cache reused across runs, as its user tampers with it: duplicated members, symlinked shards, stray
files, hand-edited layouts, an unreadable manifest; a capture seed that selects nothing is no reason to rerun."""

import hashlib
import io
import json
import os
import tarfile

import pytest
import torch

from hmscale.teacher.cache import CacheCorruptError, CacheError, CacheReader, build_cache, verify_cache


def _quiet(*_):
    pass


def _resign(path, sid=0):
    """Record shard ``sid``'s current bytes in the manifest, as someone who edits both would."""
    m = json.loads((path / "manifest.json").read_text())
    shard = path / f"shard-{sid:06d}.tar"
    m["shards"][str(sid)].update(sha256=hashlib.sha256(shard.read_bytes()).hexdigest(), bytes=shard.stat().st_size)
    (path / "manifest.json").write_text(json.dumps(m))


def _read_all(path):
    reader = CacheReader(path)
    return [b["keys"] for b in reader.stage1_batches(list(reader.layers), 3, shuffle=False)]


def test_a_shard_holding_a_member_twice_is_refused(tmp_path, teacher, data, tools):
    # a second `tokens.npy` of a sample passed `cache verify`, and the reader silently took the last copy
    path = build_cache(tools.make_cfg(tmp_path), data, teacher, engine="local", log=_quiet)
    shard = path / "shard-000000.tar"
    with tarfile.open(shard) as tf:
        members = [(ti, tf.extractfile(ti).read()) for ti in tf.getmembers()]
    first, data0 = members[0]
    fake = bytearray(data0)
    fake[-4:] = b"\x07\x00\x00\x00"  # the same header and shape, another last token
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as out:
        for ti, blob in members + [(first, bytes(fake))]:
            out.addfile(ti, io.BytesIO(blob))
    shard.write_bytes(buf.getvalue())
    _resign(path)
    report = verify_cache(path)
    assert not report.ok and "appears twice" in report.bad["shard-000000.tar"]
    with pytest.raises(CacheCorruptError, match="appears twice"):
        _read_all(path)


def test_a_shard_that_is_a_symlink_is_not_followed(tmp_path, teacher, data, tools):
    # a shard file linked to a file outside the cache passed `cache verify` and was read through the link
    cfg = tools.make_cfg(tmp_path / "root")
    path = build_cache(cfg, data, teacher, engine="local", log=_quiet)
    outside = tmp_path / "elsewhere.tar"
    os.replace(path / "shard-000001.tar", outside)
    os.symlink(outside, path / "shard-000001.tar")
    report = verify_cache(path)
    assert not report.ok and "symbolic link" in report.bad["shard-000001.tar"]
    with pytest.raises(CacheCorruptError, match="symbolic link"):
        _read_all(path)
    logs = []  # a rebuild redoes it as a regular file of the cache, leaving the link's target alone
    assert build_cache(cfg, data, teacher, engine="local", log=logs.append) == path
    assert any("shard-000001.tar is missing or does not match" in line for line in logs), logs
    assert not (path / "shard-000001.tar").is_symlink() and outside.read_bytes() == (path / "shard-000001.tar").read_bytes()
    assert verify_cache(path).ok


def test_verify_names_files_that_are_not_part_of_the_cache(tmp_path, teacher, data, tools):
    path = build_cache(tools.make_cfg(tmp_path), data, teacher, engine="local", log=_quiet)
    (path / ".shard-000009.tar.x1y2.tmp").write_bytes(b"a writer's temporary")  # hidden: not reported
    assert verify_cache(path).ok
    (path / "evil.pickle").write_bytes(b"\x80\x04N.")
    (path / "notes").mkdir()
    report = verify_cache(path)
    assert not report.ok and not report.bad and len(report.problems) == 2
    assert all("is not part of the cache" in p for p in report.problems)
    assert {p.split()[0] for p in report.problems} == {"evil.pickle", "notes"}


def _edit_layer_storage(m):
    m["layout"]["fields"]["l000_attn_input"]["storage"] = "float16"


EDITS = {
    # the reader decoded by this storage: the bf16 bits came back as a float16 (or integer) tensor
    "layer_storage": _edit_layer_storage,
    # the reader built positions from it: 31 positions for 32 tokens
    "layout_seq_len": lambda m: m["layout"].__setitem__("seq_len", m["layout"]["seq_len"] - 1),
    "capture_dtype": lambda m: m["capture"].__setitem__("dtype", "int8"),
    "topk_dtype": lambda m: m["capture"].__setitem__("topk_dtype", "int8"),
    # the capture says half the positions, the layout stores all of them (no `positions` member)
    "token_fraction": lambda m: m["capture"].__setitem__("token_fraction", 0.5),
    "capture_topk_more_than_stored": lambda m: m["capture"].__setitem__("topk", 5),
    "field_extra": lambda m: m["layout"]["fields"].__setitem__("../x", {"npy_dtype": "<i4", "shape": [1],
                                                                           "storage": "int32"}),
    "shard_key_padded": lambda m: m["shards"].__setitem__("00", m["shards"]["0"]),
    "shard_tokens": lambda m: m["shards"]["1"].__setitem__("tokens", 7),
    "teacher_dims": lambda m: m["teacher"].__setitem__("d_model", "64"),
}


@pytest.mark.parametrize("how", sorted(EDITS))
def test_a_hand_edited_layout_or_capture_is_refused_in_one_line(tmp_path, teacher, data, tools, how):
    path = build_cache(tools.make_cfg(tmp_path, **{"cache.capture.topk": 3}), data, teacher, engine="local", log=_quiet)
    m = json.loads((path / "manifest.json").read_text())
    EDITS[how](m)
    (path / "manifest.json").write_text(json.dumps(m))
    report = verify_cache(path)
    assert not report.ok and len(report.problems) == 1 and "edited by hand" in report.problems[0], report.summary()
    assert "\n" not in report.problems[0]
    with pytest.raises(CacheError, match="manifest.json is damaged or was edited by hand"):
        CacheReader(path)


def test_every_capture_the_writer_makes_passes_the_layout_check(tmp_path, teacher, data, tools):
    for i, over in enumerate([{"cache.capture.dtype": "fp8_e4m3", "cache.capture.token_fraction": 0.25},
                              {"cache.capture.dtype": "float32", "cache.capture.tensors": "[attn_output]",
                               "cache.capture.layers": "[1]", "cache.capture.topk": 2,
                               "cache.capture.topk_dtype": "bfloat16"},
                              {"cache.capture.tensors": "[]", "cache.capture.topk": 4}]):
        path = build_cache(tools.make_cfg(tmp_path / str(i), **over), data, teacher, engine="local", log=_quiet)
        assert verify_cache(path).ok and CacheReader(path).num_samples == 12


def test_an_unreadable_manifest_is_one_line(tmp_path, teacher, data, tools):
    path = build_cache(tools.make_cfg(tmp_path), data, teacher, engine="local", log=_quiet)
    (path / "manifest.json").unlink()
    (path / "manifest.json").mkdir()
    report = verify_cache(path)
    assert not report.ok and "cannot be read" in report.problems[0] and "\n" not in report.problems[0]
    with pytest.raises(CacheError, match="manifest.json cannot be read"):
        CacheReader(path)


def test_another_capture_seed_with_every_position_kept_reuses_the_cache(tmp_path, teacher, data, tools, monkeypatch):
    # the seed only draws the kept positions (token_fraction < 1): at 1.0 two seeds store the same bytes, yet the
    # second one ran the whole teacher pass again
    first = build_cache(tools.make_cfg(tmp_path), data, teacher, engine="local", log=_quiet)
    monkeypatch.setattr("hmscale.teacher.cache.worker.ShardWorker.forward_batch",
                        lambda *a, **k: pytest.fail("the seed selects nothing here: no teacher forward"))
    logs = []
    second = build_cache(tools.make_cfg(tmp_path, **{"cache.capture.seed": 5}), data, teacher, engine="local",
                         log=logs.append)
    assert second != first and any("no teacher forward" in line for line in logs), logs
    assert verify_cache(second).ok
    a, b = CacheReader(first), CacheReader(second)
    for sid in range(4):
        for j in range(3):
            x, y = a.sample(sid, j, layers=[0, 1]), b.sample(sid, j, layers=[0, 1])
            assert torch.equal(x["positions"], y["positions"]) and torch.equal(x["tokens"], y["tokens"])
            assert all(torch.equal(x["layers"][i][t], y["layers"][i][t]) for i in (0, 1) for t in x["layers"][i])


def test_with_kept_positions_drawn_another_seed_is_another_cache(tmp_path, teacher, data, tools):
    over = {"cache.capture.token_fraction": 0.5}
    first = build_cache(tools.make_cfg(tmp_path, **over), data, teacher, engine="local", log=_quiet)
    logs = []
    second = build_cache(tools.make_cfg(tmp_path, **over, **{"cache.capture.seed": 5}), data, teacher, engine="local",
                         log=logs.append)
    assert second != first and not any("no teacher forward" in line for line in logs)
    assert not json.loads((second / "manifest.json").read_text()).get("view_of")


def test_a_shard_of_more_than_ten_thousand_rows_reads_in_plan_order(tmp_path, teacher, tools):
    # the keys' row number has 4 digits: sorted by name, row 10000 came before row 1000, so reader row j was not
    # plan row j once a shard held more than 10,000 rows
    data = tools.make_data(shards=1, per_shard=10_004, seq_len=4)  # (whole 16-token documents)
    cfg = tools.make_cfg(tmp_path, **{"cache.capture.layers": "[0]", "cache.capture.tensors": "[attn_input]",
                                      "data.seq_len": 4, "cache.batch_size": 2048})
    reader = CacheReader(build_cache(cfg, data, teacher, engine="local", log=_quiet))
    rows = data.plan.shard(0)["tokens"]
    for j in (0, 999, 1000, 9999, 10_000, 10_003):
        assert torch.equal(reader.sample(0, j)["tokens"], torch.from_numpy(rows[j]).long()), j
