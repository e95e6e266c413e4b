"""Teacher cache: `cache rm` of a moved cache by its real path, `cache rm` racing a build
that makes a view onto the cache, a read-only shared cache root, Ctrl-C with several worker processes, and a cache
whose manifest was lost while views read its shards."""

import json
import os
import threading
import time

import pytest

from hmscale.teacher.cache import CacheError, CacheReader, build_cache, verify_cache
from hmscale.teacher.cache.manifest import Manifest

SHARD = 3 * 32  # tokens of one shard of the fixture's plan (3 rows of 32); the plan has 4
_quiet = lambda *_: None  # noqa: E731


def _source_and_view(tools, root, data, teacher, view_topk=2):
    source = build_cache(tools.make_cfg(root, **{"cache.capture.topk": 4}), data, teacher, engine="local", log=_quiet)
    view = build_cache(tools.make_cfg(root, **{"cache.capture.topk": view_topk}), data, teacher, engine="local",
                       log=_quiet)
    assert Manifest.load(view).view_of == source.name
    return source, view


# ---------------------------------------------------------------------------------- 1: rm by a moved cache's real path


def test_cache_rm_given_a_moved_caches_real_path_acts_as_given_its_link(tmp_path, teacher, data, tools, capsys):
    """A cache moved to another disk and linked back into the root, removed by its real path: `cache rm` looked for
    views and the build lock beside the real directory, so it removed a cache its views read without --force (they
    then read a deleted source) and ignored a running build's lock. It now finds them through the link in the root
    (and the link goes too, as if it had been given)."""
    from hmscale.atomic import exclusive_lock
    from hmscale.cli import main
    from hmscale.teacher.cache.catalog import list_caches
    from hmscale.teacher.cache.format import lock_path

    root = tmp_path / "root"
    source, view = _source_and_view(tools, root, data, teacher)
    moved = tmp_path / "disk2" / source.name
    moved.parent.mkdir()
    source.rename(moved)
    source.symlink_to(moved, target_is_directory=True)
    capsys.readouterr()
    assert main(["cache", "rm", str(moved)]) == 2 and moved.is_dir()
    err = capsys.readouterr().err
    assert f"({view.name})" in err and "--force" in err and err.count("\n") == 1, err
    with exclusive_lock(lock_path(source)):  # a build of it running (its lock is under the root, by the link's name)
        assert main(["cache", "rm", str(moved), "--force"]) == 2 and moved.is_dir() and view.is_dir()
        assert "is being built" in capsys.readouterr().err
    assert main(["cache", "rm", str(moved), "--force"]) == 0
    assert not moved.exists() and not view.exists() and not source.is_symlink() and not source.exists()
    assert list_caches(root) == []


# ---------------------------------------------------------------------------------- 2: rm racing a view's creation


def test_cache_rm_of_a_source_just_checked_by_a_build_leaves_no_view_onto_it(tmp_path, teacher, data, tools,
                                                                            monkeypatch, forwarded):
    """`cache rm SRC` between a build's check of SRC (the view it is about to write covers all its shards) and the
    view's save: the view was saved onto the deleted SRC, and the run then read missing shards."""
    import hmscale.teacher.cache.build as build_mod
    from hmscale.teacher.cache.catalog import remove_cache

    root = tmp_path / "root"
    source = build_cache(tools.make_cfg(root, **{"cache.capture.topk": 4}), data, teacher, engine="local", log=_quiet)
    real, calls = build_mod.existing_shards, []

    def checked_then_removed(manifest, shard_ids, log=None):
        got = real(manifest, shard_ids, log=log or _quiet)
        if not calls:  # the build has just verified SRC's shards through the view: the removal comes now
            calls.append(remove_cache(source))
        return got

    monkeypatch.setattr(build_mod, "existing_shards", checked_then_removed)
    forwarded.clear()
    path = build_cache(tools.make_cfg(root, **{"cache.capture.topk": 2}), data, teacher, engine="local", log=_quiet)
    assert calls and not source.exists()
    assert Manifest.load(path).view_of is None and sorted(forwarded) == [0, 1, 2, 3]  # a cache of its own instead
    report = verify_cache(path)
    assert report.ok, report.summary()


def test_cache_rm_of_a_source_while_its_view_is_saved_waits_and_sees_the_view(tmp_path, teacher, data, tools,
                                                                            monkeypatch):
    """`cache rm SRC` (another process, here a thread) while a build saves a view onto SRC: it listed SRC's views
    before the save, found none and removed SRC under the new view. It now waits for the save and refuses (the view
    reads SRC; --force would remove both)."""
    from hmscale.teacher.cache.catalog import remove_cache

    root = tmp_path / "root"
    source = build_cache(tools.make_cfg(root, **{"cache.capture.topk": 4}), data, teacher, engine="local", log=_quiet)
    real_save, outcome = Manifest.save, {}

    def rm():
        try:
            outcome["removed"] = remove_cache(source)
        except CacheError as err:
            outcome["error"] = str(err)

    def save(self):
        if self.view_of and not self.path.exists() and "thread" not in outcome:
            outcome["thread"] = threading.Thread(target=rm)
            outcome["thread"].start()
            time.sleep(0.5)  # the removal runs meanwhile (unless it waits for this save)
        real_save(self)

    monkeypatch.setattr(Manifest, "save", save)
    view = build_cache(tools.make_cfg(root, **{"cache.capture.topk": 2}), data, teacher, engine="local", log=_quiet)
    outcome["thread"].join(timeout=60)
    assert Manifest.load(view).view_of == source.name
    assert "removed" not in outcome and f"({view.name})" in outcome.get("error", ""), outcome
    assert source.is_dir()
    report = verify_cache(view)
    assert report.ok, report.summary()


# ---------------------------------------------------------------------------------- 3: a read-only cache root


def _tree(d):
    return sorted((str(p.relative_to(d)), p.stat().st_mtime_ns) for p in d.rglob("*"))


def _read_only(monkeypatch, root):
    """``root`` read-only for this process: mode 0555 (enough for a user other than root), and os.access says so
    (root passes any mode: the check every build makes before writing is what a read-only mount answers)."""
    real = os.access
    top = os.path.abspath(root)

    def access(path, mode, *a, **k):
        if mode & os.W_OK and (os.path.abspath(path) + "/").startswith(top + "/"):
            return False
        return real(path, mode, *a, **k)

    monkeypatch.setattr(os, "access", access)
    for d in [root, *(p for p in root.rglob("*") if p.is_dir() and not p.is_symlink())]:
        d.chmod(0o555)


def test_a_view_onto_a_read_only_shared_cache_is_written_outside_it(tmp_path, teacher, data, tools, monkeypatch,
                                                                    forwarded):
    """A team's cache on a read-only mount holding every shard a request reads (a smaller top-k): the build stopped
    on "cannot create the cache directory" as it had to write the view's manifest into the root. The view is now
    written under data.cache_dir (next to a link to its source), nothing is written into the root, the run reads
    exactly what a cache of its own holds, and the next run reuses the view."""
    root, mine = tmp_path / "team", tmp_path / "mine"
    over = {"data.cache_dir": mine}
    source = build_cache(tools.make_cfg(root, **{"cache.capture.topk": 4}, **over), data, teacher, engine="local",
                         log=_quiet)
    before = _tree(root)
    _read_only(monkeypatch, root)
    try:
        forwarded.clear()
        cfg = tools.make_cfg(root, **{"cache.capture.topk": 2}, **over)
        lines = []
        view = build_cache(cfg, data, teacher, engine="local", log=lines.append)
        assert forwarded == [] and view.is_relative_to(mine) and _tree(root) == before
        assert Manifest.load(view).view_of == source.name
        assert any("read-only" in line and str(view.parent) in line for line in lines), lines
        report = verify_cache(view)
        assert report.ok, report.summary()
        own = build_cache(tools.make_cfg(tmp_path / "scratch", **{"cache.capture.topk": 2}), data, teacher,
                          engine="local", log=_quiet)
        a, b = (next(iter(CacheReader(p).stage2_batches(12, shuffle=False))) for p in (view, own))
        assert (a["topk_logprobs"] == b["topk_logprobs"]).all() and (a["topk_indices"] == b["topk_indices"]).all()
        lines.clear()
        forwarded.clear()
        assert build_cache(cfg, data, teacher, engine="local", log=lines.append) == view and forwarded == []
        assert any("no teacher forward" in line for line in lines), lines
    finally:
        for d in [root, *root.rglob("*")]:
            if d.is_dir() and not d.is_symlink():
                d.chmod(0o755)


def test_a_read_only_root_without_the_shards_asked_is_one_line(tmp_path, teacher, data, tools, monkeypatch):
    """A request the read-only root's caches do not hold whole (more shards than its source): one line naming the
    root and what to set; nothing is written into the root."""
    root, mine = tmp_path / "team", tmp_path / "mine"
    build_cache(tools.make_cfg(root, **{"cache.capture.topk": 4, "cache.max_tokens": 2 * SHARD,
                                        "data.cache_dir": mine}), data, teacher, engine="local", log=_quiet)
    before = _tree(root)
    _read_only(monkeypatch, root)
    try:
        with pytest.raises(CacheError) as err:
            build_cache(tools.make_cfg(root, **{"cache.capture.topk": 2, "data.cache_dir": mine}), data, teacher,
                        engine="local", log=_quiet)
        msg = str(err.value)
        assert "\n" not in msg and f"cache.root {root} is read-only" in msg and "set cache.root to a directory" in msg
        assert _tree(root) == before
    finally:
        for d in [root, *root.rglob("*")]:
            if d.is_dir() and not d.is_symlink():
                d.chmod(0o755)


# ---------------------------------------------------------------------------------- 4: Ctrl-C, several processes


def test_ctrl_c_with_worker_processes_records_the_shards_they_finished(tmp_path, teacher, data, tools, monkeypatch):
    """Ctrl-C of a build with several worker processes: the shards the workers had finished (renamed into place) but
    whose report had not been read yet were left out of the manifest: `cache verify` called them strays and the next
    build computed them again."""
    import hmscale.teacher.cache.build as build_mod

    cfg = tools.make_cfg(tmp_path / "root")
    real = build_mod.Progress.shard_done

    def interrupted(self, info):  # Ctrl-C in the driver, once it has read one worker's report
        real(self, info)
        if self.shards_now > 1:
            return
        cache = next(p for p in (tmp_path / "root").iterdir() if not p.name.startswith("."))
        deadline = time.monotonic() + 120
        while len(list(cache.glob("shard-*.tar"))) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)  # every worker finishes its shards: their reports wait in the queue
        raise KeyboardInterrupt

    monkeypatch.setattr(build_mod.Progress, "shard_done", interrupted)
    with pytest.raises(KeyboardInterrupt):
        build_cache(cfg, data, teacher, engine="local", devices=["cpu", "cpu"], log=_quiet)
    path = next(p for p in (tmp_path / "root").iterdir() if not p.name.startswith("."))
    assert len(list(path.glob("shard-*.tar"))) == 4
    assert sorted(Manifest.load(path).shards) == [0, 1, 2, 3]
    report = verify_cache(path)
    assert report.ok, report.summary()


def test_finished_shards_missing_from_the_manifest_are_adopted_not_redone(tmp_path, teacher, data, tools, forwarded):
    """Shards finished on disk but not in the manifest (a driver stopped between a worker's rename and its report;
    killed, or a Ctrl-C whose reports never came): the next build computed them again. It now checks them against
    the plan (its sample keys, every field's dtype and shape) and records them; a damaged one is still redone."""
    cfg = tools.make_cfg(tmp_path / "root")
    path = build_cache(cfg, data, teacher, engine="local", log=_quiet)
    good = tools.shard_bytes(path)
    m = json.loads((path / "manifest.json").read_text())
    for s in ("1", "2", "3"):
        del m["shards"][s]
    m["complete"] = False
    (path / "manifest.json").write_text(json.dumps(m))
    assert any("stray shard" in p for p in verify_cache(path).problems)
    damaged = path / "shard-000003.tar"
    raw = bytearray(damaged.read_bytes())
    raw[600:640] = b"\xff" * 40  # inside the first member's npy header: no longer a shard of this layout
    damaged.write_bytes(bytes(raw))
    forwarded.clear()
    lines = []
    assert build_cache(cfg, data, teacher, engine="local", log=lines.append) == path
    assert forwarded == [3], forwarded  # shards 1 and 2 adopted, 3 redone
    assert any("not in its manifest" in line and "recorded" in line for line in lines), lines
    report = verify_cache(path)
    assert report.ok and len(report.shards_ok) == 4, report.summary()
    assert {k: v for k, v in tools.shard_bytes(path).items() if k.endswith(".tar")} == {
        k: v for k, v in good.items() if k.endswith(".tar")}


# ---------------------------------------------------------------------------------- 5: a lost manifest under views


def test_a_cache_whose_manifest_was_lost_keeps_the_shards_its_views_read(tmp_path, teacher, data, tools, forwarded):
    """A cache (top-4) read by a view (top-2) loses its manifest; another cache (top-8) covers it. Its rebuild became
    a view onto the top-8 cache and deleted its own shard files: the top-2 view then read missing shards. It is now
    rebuilt as a cache of its own from the shards it holds (checked against the view's sha256), without a teacher
    forward, and both stay valid."""
    root = tmp_path / "root"
    source, view = _source_and_view(tools, root, data, teacher)
    build_cache(tools.make_cfg(root, **{"cache.capture.topk": 8}), data, teacher, engine="local", log=_quiet)
    (source / "manifest.json").unlink()
    forwarded.clear()
    again = build_cache(tools.make_cfg(root, **{"cache.capture.topk": 4}), data, teacher, engine="local", log=_quiet)
    assert again == source and forwarded == []
    for d in (source, view):
        report = verify_cache(d)
        assert report.ok and len(report.shards_ok) == 4, report.summary()
    assert Manifest.load(source).view_of is None and Manifest.load(view).view_of == source.name


def test_a_views_unrecorded_files_are_kept_when_another_view_reads_them(tmp_path, teacher, data, tools):
    """The removal of a view's unrecorded shard files (``_remove_unrecorded_shards``) never takes a file another
    view's manifest reads from that directory."""
    from hmscale.teacher.cache.build import _remove_unrecorded_shards

    root = tmp_path / "root"
    source, view = _source_and_view(tools, root, data, teacher)
    other = build_cache(tools.make_cfg(root, **{"cache.capture.topk": 8}), data, teacher, engine="local", log=_quiet)
    m = Manifest.load(source)  # the source made to look like a view onto `other` (what a lost manifest became)
    m.data["view_of"] = other.name
    _remove_unrecorded_shards(m)
    report = verify_cache(view)
    assert report.ok, report.summary()


# ------------------------------------------------------------------- cache list before any cache (README walk)
def test_cache_list_of_a_root_not_made_yet(tmp_path, monkeypatch, capsys):
    """`hmscale cache list` in a fresh clone said ".cache/hmscale/teacher is not a directory; pass a cache root such as
    .cache/hmscale/teacher": the very path it refused. The configured root before any build has no caches; a folder
    passed by hand that is missing or a file is one line saying what to pass."""
    from hmscale.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["cache", "list"]) == 0
    assert "no caches (build one with `hmscale cache CONFIG`)" in capsys.readouterr().out
    assert main(["cache", "list", str(tmp_path / "typo")]) == 2
    err = capsys.readouterr().err
    assert "typo does not exist; pass the folder holding the caches" in err and err.count("\n") == 1, err
    (tmp_path / "file").write_text("x")
    assert main(["cache", "list", str(tmp_path / "file")]) == 2
    assert "file is not a directory" in capsys.readouterr().err
