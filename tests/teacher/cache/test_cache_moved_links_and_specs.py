"""Teacher cache edge cases: unusual but legitimate capture specs, interrupted and
resumed builds, odd directories for verify / list / rm, reader edge cases."""

import shutil

import pytest
import torch

from hmscale.teacher.cache import CacheReader, build_cache, verify_cache
from hmscale.teacher.cache.manifest import Manifest

SHARD = 3 * 32  # tokens of one shard of the fixture's plan (3 rows of 32); the plan has 4


def test_a_top_k_only_cache_asked_with_no_layers_reads_back_and_is_reused(tmp_path, teacher, data, tools, forwarded):
    """`cache.capture.layers=[]` with a top-k (a stage-2 KD cache, layer tensors left at their default): the build
    wrote a manifest that every reader refused as "damaged or edited by hand" (no layer field, while the capture
    names tensors), and each rerun started a new manifest, running the teacher over every shard again."""
    cfg = tools.make_cfg(tmp_path / "root", **{"cache.capture.layers": "[]", "cache.capture.topk": 4})
    path = build_cache(cfg, data, teacher, engine="local", log=lambda *_: None)
    assert verify_cache(path).ok, verify_cache(path).summary()
    batch = next(iter(CacheReader(path).stage2_batches(2)))
    assert batch["topk_logprobs"].shape == (2, 32, 4)
    forwarded.clear()
    lines = []
    assert build_cache(cfg, data, teacher, engine="local", log=lines.append) == path
    assert forwarded == [] and any("no teacher forward needed" in line for line in lines), lines
    assert "0 layers (no layer tensors, bfloat16, top-4)" in lines[0], lines[0]  # (it named attn_input,attn_output)


def test_a_request_with_no_layers_is_a_view_onto_a_cache_stored_in_another_dtype(tmp_path, teacher, data, tools,
                                                                                  forwarded):
    """A top-k request without layers reads no layer tensor, so the storage dtype of the source's tensors does not
    matter: it was asked to match, and the teacher ran again for a top-k the fp8 cache held."""
    root = tmp_path / "root"
    source = build_cache(tools.make_cfg(root, **{"cache.capture.dtype": "fp8_e4m3", "cache.capture.topk": 4}), data,
                         teacher, engine="local", log=lambda *_: None)
    forwarded.clear()
    cfg = tools.make_cfg(root, **{"cache.capture.layers": "[]", "cache.capture.topk": 2})
    view = build_cache(cfg, data, teacher, engine="local", log=lambda *_: None)
    assert forwarded == [] and Manifest.load(view).view_of == source.name
    own = build_cache(tools.make_cfg(tmp_path / "other", **{"cache.capture.layers": "[]", "cache.capture.topk": 2}),
                      data, teacher, engine="local", log=lambda *_: None)
    a, b = (next(iter(CacheReader(p).stage2_batches(3, shuffle=False))) for p in (view, own))
    assert torch.equal(a["topk_logprobs"], b["topk_logprobs"]) and torch.equal(a["topk_indices"], b["topk_indices"])
    assert verify_cache(view).ok


def test_a_writers_setting_that_is_not_a_number_is_named_before_any_work(tmp_path, teacher, data, tools, monkeypatch):
    """`HMSCALE_CACHE_WRITERS=four` stopped the build with int()'s "invalid literal for int() with base 10: 'four'"
    (nothing named the variable), after a manifest was written into a new cache directory."""
    from hmscale.teacher.cache import CacheError
    from ray_jobs.cache_teacher import actor_writers

    monkeypatch.setenv("HMSCALE_CACHE_WRITERS", "four")
    root = tmp_path / "root"
    with pytest.raises(CacheError, match="HMSCALE_CACHE_WRITERS='four'.*positive integer"):
        build_cache(tools.make_cfg(root), data, teacher, engine="local", log=lambda *_: None)
    assert not root.exists()
    with pytest.raises(CacheError, match="HMSCALE_CACHE_WRITERS"):
        actor_writers(1, 16)
    monkeypatch.setenv("HMSCALE_CACHE_WRITERS", "3")
    assert actor_writers(1, 16) == 3


def test_an_option_the_cache_command_form_does_not_use_is_refused(tmp_path, teacher, data, tools, capsys):
    """Each `hmscale cache` form ignored the options of the others without a word: `hmscale cache CONFIG --force`
    built (or reused) as without it, `cache list ROOT -s cache.root=OTHER` listed ROOT, `cache verify DIR --json`
    printed text."""
    from hmscale.cli import main

    root = tmp_path / "root"
    path = build_cache(tools.make_cfg(root), data, teacher, engine="local", log=lambda *_: None)
    # (the build form is refused before its config is read: this one does not exist)
    for argv, flag in ((["cache", str(tmp_path / "none.yaml"), "--force"], "--force"),
                       (["cache", str(tmp_path / "none.yaml"), "--json"], "--json"),
                       (["cache", "verify", str(path), "--json"], "--json"),
                       (["cache", "verify", str(path), "--force"], "--force"),
                       (["cache", "rm", str(path), "--engine", "local"], "--engine"),
                       (["cache", "rm", str(path), "-s", "cache.workers=1"], "--set"),
                       (["cache", "list", str(root), "-s", f"cache.root={tmp_path}"], "--set"),
                       (["cache", "list", str(root), "--force"], "--force")):
        capsys.readouterr()
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith("hmscale: error: cache") and f": {flag} applies to" in err and "\n" not in err, err
    assert path.exists()
    assert main(["cache", "list", "-s", f"cache.root={root}", "--json"]) == 0  # (-s picks the root listed)
    assert path.name in capsys.readouterr().out
    assert main(["cache", "verify", str(path)]) == 0 and main(["cache", "rm", str(path), "--force"]) == 0


def test_a_view_moved_to_another_disk_and_linked_back_reads_its_source(tmp_path, teacher, data, tools, forwarded,
                                                                       capsys):
    """A view directory (with a shard computed for it) moved to another disk and linked back into the cache root read
    its source beside the link's target: readers and verify called the source's shards missing, `cache list` the
    source gone, and the next build "replaced" the view, running the teacher over the shards the source holds."""
    from hmscale.cli import main

    root = tmp_path / "root"
    source = build_cache(tools.make_cfg(root, **{"cache.capture.topk": 4, "cache.max_tokens": 2 * SHARD}), data,
                         teacher, engine="local", log=lambda *_: None)
    cfg = tools.make_cfg(root, **{"cache.capture.topk": 2, "cache.max_tokens": 3 * SHARD})
    view = build_cache(cfg, data, teacher, engine="local", log=lambda *_: None)
    assert Manifest.load(view).view_of == source.name
    moved = tmp_path / "disk2" / view.name
    moved.parent.mkdir()
    view.rename(moved)
    view.symlink_to(moved, target_is_directory=True)
    assert len(list(CacheReader(view).stage2_batches(1))) == 9
    assert verify_cache(view).ok, verify_cache(view).summary()
    capsys.readouterr()
    assert main(["cache", "list", str(root)]) == 0
    assert "source missing" not in capsys.readouterr().out
    forwarded.clear()
    assert build_cache(cfg, data, teacher, engine="local", log=lambda *_: None) == view
    assert forwarded == [] and Manifest.load(view).view_of == source.name


def test_cache_rm_counts_a_view_linked_into_the_root(tmp_path, teacher, data, tools, capsys):
    """`cache rm SOURCE` skipped the views that are links in the root (a view moved to another disk): the source was
    removed without --force, and the view's next run rebuilt it with a teacher pass."""
    from hmscale.cli import main

    root = tmp_path / "root"
    source = build_cache(tools.make_cfg(root, **{"cache.capture.topk": 4}), data, teacher, engine="local",
                         log=lambda *_: None)
    view = build_cache(tools.make_cfg(root, **{"cache.capture.topk": 2}), data, teacher, engine="local",
                       log=lambda *_: None)
    moved = tmp_path / "disk2" / view.name
    moved.parent.mkdir()
    view.rename(moved)
    view.symlink_to(moved, target_is_directory=True)
    capsys.readouterr()
    assert main(["cache", "rm", str(source)]) == 2 and source.exists()
    assert f"({view.name})" in capsys.readouterr().err
    assert main(["cache", "rm", str(source), "--force"]) == 0
    assert not source.exists() and not moved.exists() and not view.is_symlink()


def test_a_rerun_with_nothing_to_compute_removes_a_dead_writers_temporary(tmp_path, teacher, data, tools, forwarded):
    """The temporary of a writer killed mid-shard, whose shard got done since (a view's own shard the source gained
    meanwhile; a Ray actor given up for dead), stayed for ever: only a build that computed shards removed such
    files, while `cache list` said the next build of the cache would. A live writer's (locked) temporary stays."""
    import fcntl

    cfg = tools.make_cfg(tmp_path / "root")
    path = build_cache(cfg, data, teacher, engine="local", log=lambda *_: None)
    dead = path / ".shard-000001.tar.k1ll3d00.tmp"
    dead.write_bytes(b"\0" * 1000)
    live = path / ".shard-000002.tar.l1ve0000.tmp"
    live.write_bytes(b"")
    forwarded.clear()
    with open(live, "rb") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        assert build_cache(cfg, data, teacher, engine="local", log=lambda *_: None) == path
        assert forwarded == [] and not dead.exists() and live.exists()


def test_a_cache_linked_into_the_root_whose_directory_is_gone_is_named(tmp_path, teacher, data, tools, capsys):
    """A cache moved to another disk, linked back into the root, then removed there (`cache rm` of the directory
    itself): the next build said "cannot create it (File exists); set cache.root to a directory you can write", and
    `cache list` showed nothing of the link."""
    from hmscale.cli import main
    from hmscale.teacher.cache import CacheError

    root = tmp_path / "root"
    cfg = tools.make_cfg(root)
    path = build_cache(cfg, data, teacher, engine="local", log=lambda *_: None)
    moved = tmp_path / "disk2" / path.name
    moved.parent.mkdir()
    path.rename(moved)
    path.symlink_to(moved, target_is_directory=True)
    shutil.rmtree(moved)  # removed behind hmscale's back (`cache rm` of it removes the link too)
    assert path.is_symlink() and not path.exists()
    capsys.readouterr()
    assert main(["cache", "list", str(root)]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith(path.name))
    assert f"a link to {moved}, which does not exist" in row, row
    with pytest.raises(CacheError, match=f"{path} is a link to {moved}, which does not exist.*remove the link"):
        build_cache(cfg, data, teacher, engine="local", log=lambda *_: None)
    path.unlink()
    assert build_cache(cfg, data, teacher, engine="local", log=lambda *_: None) == path and verify_cache(path).ok


@pytest.mark.parametrize("view", [False, True])
def test_a_build_finished_by_another_run_meanwhile_is_not_computed_again(tmp_path, teacher, data, tools, forwarded,
                                                                         monkeypatch, view):
    """Two runs of one cache started together: the second looked for a covering cache (verifying its shards: minutes
    on a large one) while the first computed and recorded every shard and let go of the lock. The second, which had
    not waited for the lock, went on with the manifest it had read before (none, or its unsaved view) and ran the
    teacher over every shard again."""
    from hmscale.teacher.cache import build

    root = tmp_path / "root"
    if view:  # a source holding shards 0, 1 of the 4 asked: each run computes 2, 3 into its view
        build_cache(tools.make_cfg(root, **{"cache.capture.topk": 4, "cache.max_tokens": 2 * SHARD}), data, teacher,
                    engine="local", log=lambda *_: None)
    cfg = tools.make_cfg(root, **{"cache.capture.topk": 2 if view else 0, "cache.max_tokens": 4 * SHARD})
    real, first = build.covering_caches, []

    def meanwhile(*a, **k):  # the other run starts and finishes while this one looks for a covering cache
        if not first:
            first.append(None)
            first[0] = build_cache(cfg, data, teacher, engine="local", log=lambda *_: None)
        return real(*a, **k)

    monkeypatch.setattr(build, "covering_caches", meanwhile)
    forwarded.clear()
    assert build_cache(cfg, data, teacher, engine="local", log=lambda *_: None) == first[0]
    assert sorted(forwarded) == ([2, 3] if view else [0, 1, 2, 3])  # the other run's forwards only
    assert verify_cache(first[0]).ok


def test_cache_rm_of_a_cache_moved_to_another_disk_and_linked_back(tmp_path, teacher, data, tools, capsys):
    """`cache rm ROOT/KEY` of a cache moved to another disk and linked back into the root was refused ("is a link;
    pass the cache directory itself"); given the moved directory, it looked for views and for the build lock beside
    it, not in the root: it removed the cache under the views reading it, without --force, and under a running
    build."""
    import fcntl

    from hmscale.cli import main
    from hmscale.teacher.cache.format import lock_path

    root = tmp_path / "root"
    source = build_cache(tools.make_cfg(root, **{"cache.capture.topk": 4}), data, teacher, engine="local",
                         log=lambda *_: None)
    view = build_cache(tools.make_cfg(root, **{"cache.capture.topk": 2}), data, teacher, engine="local",
                       log=lambda *_: None)
    moved = tmp_path / "disk2" / source.name
    moved.parent.mkdir()
    source.rename(moved)
    source.symlink_to(moved, target_is_directory=True)
    capsys.readouterr()
    assert main(["cache", "rm", str(source)]) == 2 and moved.exists()
    assert f"({view.name})" in capsys.readouterr().err
    with open(lock_path(source), "a") as lock:  # a build of the cache holds its lock under the root
        fcntl.flock(lock, fcntl.LOCK_EX)
        assert main(["cache", "rm", str(source), "--force"]) == 2 and moved.exists() and view.exists()
        assert "is being built" in capsys.readouterr().err
    assert main(["cache", "rm", str(source), "--force"]) == 0
    assert not moved.exists() and not source.is_symlink() and not view.exists()
    (tmp_path / "alias").symlink_to(tmp_path / "disk2", target_is_directory=True)  # (another name: still refused)
    assert main(["cache", "rm", str(tmp_path / "alias")]) == 2 and (tmp_path / "disk2").exists()


def test_a_cache_root_under_the_home_directory_is_the_one_hmscale_run_reads(tmp_path, teacher, data, tools,
                                                                             forwarded, monkeypatch, capsys):
    """`cache.root: ~/caches/teacher` (a config, or `-s cache.root=~/...`, which the shell leaves as it is): `hmscale
    cache` built into a folder named `~` in the working directory, while `hmscale run` (its paths made absolute, `~`
    expanded) looked under the home directory: it found no cache and ran the teacher again."""
    from hmscale.cli import main

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    cfg = tools.make_cfg("~/caches")
    path = build_cache(cfg, data, teacher, engine="local", log=lambda *_: None)
    assert path.parent == tmp_path / "home" / "caches" and list((tmp_path / "cwd").iterdir()) == []
    forwarded.clear()
    assert build_cache(cfg.with_absolute_paths(), data, teacher, engine="local", log=lambda *_: None) == path
    assert forwarded == []
    capsys.readouterr()
    assert main(["cache", "list", "-s", "cache.root=~/caches"]) == 0 and path.name in capsys.readouterr().out


@pytest.fixture
def cluster_started_elsewhere(tmp_path, monkeypatch):
    """The working directory of a Ray cluster this test starts (the shared one may run already: started elsewhere)."""
    (tmp_path / "cluster").mkdir()
    monkeypatch.chdir(tmp_path / "cluster")


@pytest.mark.ray
def test_ray_workers_write_a_relative_cache_root_where_the_driver_reads_it(tmp_path, monkeypatch,
                                                                            cluster_started_elsewhere, ray_cluster,
                                                                            teacher, data, tools):
    """With a relative cache.root (the default `.cache/hmscale/teacher`) and a Ray cluster started in another directory
    (`ray start` elsewhere, then `hmscale cache --engine ray`), the actors wrote the shards under the cluster's working
    directory and the driver recorded them in a manifest of its own: every rerun found them missing and redid them."""
    (tmp_path / "project").mkdir()
    monkeypatch.chdir(tmp_path / "project")
    cfg = tools.make_cfg("root", **{"cache.workers": 1})
    path = build_cache(cfg, data, teacher, engine="ray", log=lambda *_: None)
    assert verify_cache(path).ok, verify_cache(path).summary()
    assert not (tmp_path / "cluster" / "root").exists()
    lines = []
    build_cache(cfg, data, teacher, engine="ray", log=lines.append)
    assert any("no teacher forward needed" in line for line in lines), lines


def test_fp8_storage_of_a_row_too_small_for_its_scale_is_not_nan():
    """A row whose largest magnitude is a float32 subnormal (below 448 x 1.4e-45): its scale `amax / 448` underflowed
    to 0, and the row's zeros were stored as 0/0, NaN (the finite check runs on the teacher's values, which were
    finite), handing NaN to every stage reading the cache. Other rows keep their bytes."""
    from hmscale.teacher.cache.format import FP8_MAX, decode, encode

    x = torch.randn(4, 16) * 3
    x[1] = 0
    x[2] = 0
    x[2, 0], x[3] = 1e-44, 0
    x[3, :2] = torch.tensor([3e-43, -1e-43])
    q, scale = encode(x, "fp8_e4m3")
    back = decode(q, "fp8_e4m3", scale)
    assert torch.isfinite(back).all(), back
    assert torch.equal(back[1:], torch.zeros(3, 16)) and scale[1:].tolist() == [1.0, 1.0, 1.0]
    want = x[0].abs().amax() / FP8_MAX  # a row of ordinary values: scaled as before
    assert scale[0] == want.item()
    assert torch.equal(back[0], (x[0] / want).to(torch.float8_e4m3fn).float() * want)


def test_a_friendly_name_linked_to_a_cache_is_never_a_views_source(tmp_path, teacher, data, tools, forwarded, capsys):
    """A link in the root giving a cache a friendly name ("pythia-kd" -> v1-...) was taken as a view's source when its
    name sorted first: the view named the link, so `cache rm` of the cache found no view reading it and removed it
    without --force; the view's next run ran the teacher again."""
    from hmscale.cli import main

    root = tmp_path / "root"
    source = build_cache(tools.make_cfg(root, **{"cache.capture.topk": 4}), data, teacher, engine="local",
                         log=lambda *_: None)
    (root / "a-friendly-name").symlink_to(source, target_is_directory=True)
    forwarded.clear()
    view = build_cache(tools.make_cfg(root, **{"cache.capture.topk": 2}), data, teacher, engine="local",
                       log=lambda *_: None)
    assert forwarded == [] and Manifest.load(view).view_of == source.name
    capsys.readouterr()
    assert main(["cache", "rm", str(source)]) == 2 and source.exists()
    assert f"({view.name})" in capsys.readouterr().err
