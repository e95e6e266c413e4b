"""`build_cache`: plan the cache (key, bytes, disk), skip finished shards, run an engine, keep the manifest.

Engines: "local" runs the shards in this process; "ray" hands them to teacher-forward actors
(`ray_jobs.cache_teacher.run_ray`, imported lazily: the Ray wrapper sits in the top layer).
Either way only this driver writes the manifest.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from hmscale.atomic import exclusive_lock, writable_dir_problem
from hmscale.teacher.cache.format import (
    BUILDERS,
    MANIFEST,
    SHARD_FILE,
    CacheError,
    CaptureSpec,
    ShardInfo,
    TeacherShape,
    bytes_per_sample,
    cache_key,
    failure_message,
    human_bytes,
    layout,
    layout_json,
    lock_path,
    shard_name,
)
from hmscale.teacher.cache.catalog import source_held
from hmscale.teacher.cache.manifest import Manifest
from hmscale.teacher.cache.reuse import borrow, covering_caches, describe_view, shards_line, view_manifest
from hmscale.teacher.cache.writer import remove_stale_temporary, sha256_file
from hmscale.teacher.fingerprint import teacher_fingerprint


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass
class CachePlan:
    """Everything decided before any teacher work."""

    cache_dir: Path
    key: str
    spec: CaptureSpec
    shape: TeacherShape
    fingerprint: str
    plan_hash: str
    shard_ids: list[int]
    seq_len: int
    tokens: int  # tokens of the requested shards
    bytes_per_token: float
    total_bytes: int
    fields: dict = field(default_factory=dict)

    def manifest_layout(self) -> dict:
        """The manifest's ``layout`` of the shards computed for this request (a view's ``own_layout``)."""
        return {"fields": layout_json(self.fields), "kept_positions": self.spec.kept_positions(self.seq_len),
                "seq_len": self.seq_len, "bytes_per_token": self.bytes_per_token}

    def describe(self) -> str:
        return (
            f"cache {self.key}: {len(self.shard_ids)} shards, {self.tokens:,} tokens x {len(self.spec.layers)} layers "
            f"({','.join(self.spec.tensors) if self.spec.stores_layers else 'no layer tensors'}, {self.spec.dtype}"
            f"{', top-%d' % self.spec.topk if self.spec.topk else ''}"
            f"{', %.0f%% of positions' % (100 * self.spec.token_fraction) if self.spec.token_fraction < 1 else ''}): "
            f"{self.bytes_per_token:,.0f} bytes/token, {human_bytes(self.total_bytes)} in total"
        )


def requested_tokens(cfg, spec: CaptureSpec) -> int:
    """cache.max_tokens, else what the recipe reads: stage-1 tokens (all budget tokens when top-k is cached for stage 2)."""
    if cfg.cache.max_tokens:
        return int(cfg.cache.max_tokens)
    return int(cfg.budget.total_tokens if spec.topk else cfg.budget.stage1_tokens)


def run_shard_ids(cfg, plan_meta: dict) -> list[int]:
    """The plan's shards a run caches: those holding its requested tokens (``requested_tokens``;
    ``hmscale.data.plan.shards_for_tokens``). ``plan_meta``: the plan's num_shards, sequences_per_shard, seq_len."""
    return _shards(plan_meta, requested_tokens(cfg, cfg.cache.capture))


def stage_tokens(cfg, stage: str) -> int:
    """The tokens whose shards a stage draws its rows from: stage 1 its own share; stage 2 the whole budget (its share
    is drawn from every row the run covers, as a top-k cache for it holds them)."""
    if stage not in ("stage1", "stage2"):
        raise ValueError(f"stage {stage!r}: choose 'stage1' or 'stage2'")
    return int(cfg.budget.stage1_tokens if stage == "stage1" else cfg.budget.total_tokens)


def stage_shard_ids(cfg, plan_meta: dict, stage: str) -> list[int]:
    """The plan's shards a stage reads its rows from, whatever the source (live teacher or cache)."""
    return _shards(plan_meta, stage_tokens(cfg, stage))


def _shards(plan_meta: dict, tokens: int) -> list[int]:
    from hmscale.data.plan import shards_for_tokens

    return shards_for_tokens(plan_meta["num_shards"], plan_meta["sequences_per_shard"], plan_meta["seq_len"], tokens)


def plan_meta(plan) -> dict:
    return {"num_shards": plan.num_shards, "sequences_per_shard": plan.sequences_per_shard, "seq_len": plan.seq_len}


def open_for_run(cfg, cache_dir, stage: str | None = None) -> "CacheReader":
    """A reader of ``cache_dir`` over this run's shards only (with ``stage``: those of them the stage reads rows
    from): the rows, and so the training, do not depend on how many shards other runs with the same capture added
    to the cache, nor on whether the cache also holds another stage's rows."""
    from hmscale.teacher.cache.reader import CacheReader

    p = Manifest.load(cache_dir).data["plan"]
    ids = run_shard_ids(cfg, p)
    if stage is not None:
        ids = sorted(set(ids) & set(stage_shard_ids(cfg, p, stage)))
    return CacheReader(cache_dir, shards=ids)


def plan_cache(cfg, plan, teacher, fingerprint: str | None = None) -> CachePlan:
    shape = TeacherShape.of(teacher)
    spec = CaptureSpec.from_config(cfg.cache.capture, shape.n_layers)
    fp = fingerprint or teacher_fingerprint(teacher)
    key = cache_key(fp, plan.hash, spec)
    ids = run_shard_ids(cfg, plan_meta(plan))
    n = len(ids)
    sequences = sum(plan.shard_size(i) for i in ids) if hasattr(plan, "shard_size") else n * plan.sequences_per_shard
    tokens = sequences * plan.seq_len
    fields = layout(spec, shape, plan.seq_len)
    per_sample = bytes_per_sample(fields)
    total = per_sample * sequences + 10240 * n  # + end-of-archive record per shard
    return CachePlan(
        cache_dir=cache_root(cfg) / key, key=key, spec=spec, shape=shape, fingerprint=fp, plan_hash=plan.hash,
        shard_ids=ids, seq_len=plan.seq_len, tokens=tokens, bytes_per_token=per_sample / plan.seq_len,
        total_bytes=total, fields=fields,
    )


def check_disk(cp: CachePlan, missing_bytes: int, allow_exceed: bool, log=_log) -> None:
    probe = cp.cache_dir
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if missing_bytes > free:
        msg = (
            f"cache needs {human_bytes(missing_bytes)} more ({cp.bytes_per_token:,.0f} bytes/token x {cp.tokens:,} tokens, "
            f"{len(cp.spec.layers)} layers) but only {human_bytes(free)} is free under {probe}; capture fewer layers/tokens "
            f"(cache.capture.layers, cache.capture.token_fraction, cache.max_tokens) or set cache.allow_exceed_disk=true"
        )
        if not allow_exceed:
            raise CacheError(msg)
        log(f"cache: warning: {msg} (going ahead: cache.allow_exceed_disk=true)")


class Progress:
    def __init__(self, total_shards: int, done_before: int, log=_log, every_s: float = 5.0):
        self.total, self.done, self.log, self.every = total_shards, done_before, log, every_s
        self.t0 = time.perf_counter()
        self.tokens = 0
        self.bytes = 0
        self.shards_now = 0
        self._last = 0.0

    def shard_done(self, info: ShardInfo) -> None:
        self.done += 1
        self.shards_now += 1
        self.tokens += info.tokens
        self.bytes += info.bytes
        now = time.perf_counter()
        if now - self._last >= self.every or self.done == self.total:
            self._last = now
            self.log(self.line())

    def rate(self) -> float:
        return self.tokens / max(time.perf_counter() - self.t0, 1e-9)

    def line(self) -> str:
        return (
            f"cache: {self.done}/{self.total} shards done | {self.rate():,.0f} tokens/s | "
            f"{human_bytes(self.bytes)} written | {time.perf_counter() - self.t0:.1f} s"
        )


def existing_shards(manifest: Manifest, shard_ids, log=_log) -> set[int]:
    """Shards recorded in the manifest whose file is present with the recorded size and sha256."""
    good = set()
    recorded = manifest.shards
    todo = [sid for sid in shard_ids if sid in recorded]

    def ok(sid) -> bool:
        entry = recorded[sid]
        path = manifest.shard_path(sid)
        if path.is_symlink():  # never a shard the writer made (it renames regular files): redone in place
            return False
        try:
            return path.stat().st_size == entry["bytes"] and sha256_file(path) == entry["sha256"]
        except OSError:  # missing (or unreadable): redo it
            return False

    # checked concurrently (sha256 and reads release the GIL); decided and logged in shard order
    with ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1, len(todo) or 1))) as ex:
        results = list(ex.map(ok, todo))
    for sid, fine in zip(todo, results):
        entry = recorded[sid]
        if fine:
            good.add(sid)
        else:
            log(f"cache: {entry['file']} is missing or does not match the manifest; redoing it")
            manifest.drop_shard(sid)
    return good


def cache_root(cfg) -> Path:
    """cache.root, with a leading ``~`` expanded as `hmscale run` does (``RunConfig.with_absolute_paths``): left as it
    was, `hmscale cache` built into a folder named ``~`` in the working directory, where no run ever looked."""
    return Path(cfg.cache.root).expanduser()


def check_root(root) -> None:
    """Refuse a cache.root that can never hold a cache (it, or a folder above it, is a file), before any teacher work."""
    probe = Path(root)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise CacheError(f"cache.root {root}: {probe} is a file, not a directory; set cache.root to a directory")


def make_cache_dir(cache_dir: Path) -> None:
    """Create the cache directory, or stop with one line naming it and why (a file in the way, no permission, ...)."""
    if cache_dir.is_symlink() and not cache_dir.exists():  # (mkdir said "File exists", and to set cache.root elsewhere)
        raise CacheError(f"the cache directory {cache_dir} is a link to {os.readlink(cache_dir)}, which does not exist "
                         "(moved or removed); remove the link, or put back the directory it names")
    problem = writable_dir_problem(cache_dir)
    if problem:
        raise CacheError(f"the cache directory {cache_dir}: {problem}; set cache.root to a directory you can write")


def _view_onto_covering_cache(cfg, cp: CachePlan, config_hash: str, log=_log, kept=None,
                              whole_only: bool = False) -> Manifest | None:
    """A view onto the cache under cache.root that covers the request's capture and holds the most of its shards, all
    of them intact (``reuse``): saved when it holds every shard (no teacher forward); else returned for the shards
    it lacks to be computed into it. None when no cache holds any. ``kept``: shards already in the directory (the own
    shards of a view being replaced, verified), recorded as the view's own where the source lacks them.
    ``whole_only``: only a source holding every requested shard (a view written outside cache.root, see
    ``_view_outside_root``: it never computes shards). A view whose directory lies outside cache.root reads its source
    through a link of the source's name beside it (``source_dir``)."""
    if any((cp.cache_dir / f).is_file() for f in _read_by_other_views(cp.cache_dir)):
        # a cache whose manifest was lost while views read its shards: rebuilt as a cache of its own, adopting its
        # shards (``_adopt_unrecorded``), never a view (that would remove the files those views read)
        log(f"cache: {cp.cache_dir.name} has no manifest but other views read its shards; rebuilding it as a cache of "
            "its own from the shards it holds (checked)")
        return None
    root = cache_root(cfg)
    elsewhere = Path(os.path.abspath(cp.cache_dir.parent)) != Path(os.path.abspath(root))
    for source in covering_caches(root, cp.fingerprint, cp.plan_hash, cp.spec, cp.shard_ids):
        if whole_only and not set(cp.shard_ids) <= set(source.shards):
            continue
        if elsewhere and not _link_source(cp.cache_dir.parent, source.cache_dir):
            continue
        view = view_manifest(cp.cache_dir, source, key=cp.key, spec=cp.spec, shard_ids=cp.shard_ids,
                             own_layout=cp.manifest_layout(), config_hash=config_hash)
        held = sorted(view.shards)
        if len(existing_shards(view, held, log=lambda *_: None)) < len(held):
            continue  # a source shard missing or altered: not this one
        mine = {s: {**e, "own": True} for s, e in (kept or {}).items() if s not in view.shards}
        view.data["shards"].update({str(s): e for s, e in sorted(mine.items())})
        mine = existing_shards(view, sorted(mine), log=lambda *_: None)  # (another build may have removed one since)
        view.update_complete()
        what = (f"cache: reusing {source.cache_dir.name} as a view ({describe_view(cp.spec, source)}): "
                f"{len(held)} shards read from it, verified" + (f", {len(mine)} kept of its own" if mine else ""))
        if view.complete:
            make_cache_dir(cp.cache_dir)
            # under the build lock: the directory may hold shards of an earlier cache or view of this key whose manifest
            # was lost (removed, under another build writing there: the save takes in what it recorded meanwhile)
            with _build_lock(cp.cache_dir, log):
                try:  # a cache of its own that another build wrote meanwhile is kept, never made a view
                    theirs = Manifest.load(cp.cache_dir)
                except CacheError:
                    theirs = None
                if theirs is not None and theirs.data.get("key") == cp.key and not theirs.view_of:
                    return theirs
                # the source's lock held shared: `cache rm` of it either lists this view or has removed the source
                with source_held(source.cache_dir) as intact:
                    if not (intact and _source_still_holds(view)):
                        log(f"cache: {source.cache_dir.name} was removed (or changed) while this build checked it; "
                            "not a view onto it")
                        continue
                    view.save()
                _remove_unrecorded_shards(view)
            log(f"{what}; no teacher forward needed" + (f" (the view is written in {cp.cache_dir.parent}: cache.root "
                                                        f"{root} is read-only)" if elsewhere else ""))
        else:
            log(f"{what}; the other {len(cp.shard_ids) - len(view.shards)} are computed for this view, at its own "
                "capture")
        return view
    return None


def _unwritable(cache_dir: Path) -> str | None:
    """Why this user cannot create or write ``cache_dir`` (checked on it, or the nearest folder above it that exists;
    nothing is created), or None."""
    probe = cache_dir
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir() or os.access(probe, os.W_OK | os.X_OK):
        return None  # (a file in the way: make_cache_dir names it)
    return f"{probe} is read-only for this user"


def views_outside_root(cfg) -> Path:
    """Where the views onto caches of a read-only cache.root are written: under data.cache_dir (which every run
    writes), one folder per cache.root (named by a hash of its absolute path)."""
    import hashlib

    root = os.path.abspath(cache_root(cfg))
    return Path(cfg.data.cache_dir).expanduser() / "teacher-views" / hashlib.sha256(root.encode()).hexdigest()[:12]


def _view_outside_root(cfg, cp: CachePlan, config_hash: str, log=_log) -> Path:
    """The request's cache when cache.root cannot be written: a view onto a cache there that holds every requested
    shard (verified), written under ``views_outside_root`` beside a link to its source (reused by the next run); else
    one line saying what to set."""
    import dataclasses

    root = cache_root(cfg)
    vp = dataclasses.replace(cp, cache_dir=views_outside_root(cfg) / cp.key)
    try:
        m = Manifest.load(vp.cache_dir)
    except CacheError:
        m = None
    if (m is not None and m.data.get("key") == cp.key and m.view_of
            and len(existing_shards(m, cp.shard_ids, log=lambda *_: None)) == len(cp.shard_ids)):
        log(f"cache: reusing {vp.cache_dir} (a view onto {m.view_of} of the read-only cache.root {root}): all "
            f"{len(cp.shard_ids)} shards verified; no teacher forward needed")
        return vp.cache_dir
    some = covering_caches(root, cp.fingerprint, cp.plan_hash, cp.spec, cp.shard_ids)
    if not some:  # nothing there to read: the one line of an unwritable cache.root
        make_cache_dir(cp.cache_dir)
    try:
        view = _view_onto_covering_cache(cfg, vp, config_hash, log, whole_only=True)
    except CacheError as err:  # (data.cache_dir not writable either)
        raise CacheError(f"cache.root {root} is read-only here and the view onto a cache there cannot be written "
                         f"either ({err}); set cache.root to a directory you can write") from None
    if view is not None and view.complete:
        return vp.cache_dir
    best = f"{some[0].cache_dir.name} holds {len(set(cp.shard_ids) & set(some[0].shards))}" if some else "none holds"
    raise CacheError(f"cache.root {root} is read-only here ({_unwritable(cp.cache_dir) or 'not writable'}) and this run "
                     f"needs shards computed: of the {len(cp.shard_ids)} it asks of cache {cp.key}, {best}; set "
                     "cache.root to a directory you can write (a link there to a cache of the read-only root, under its "
                     "own name, is read as a view's source)")


def _link_source(view_root: Path, source: Path) -> bool:
    """A link ``view_root/<source name>`` to ``source`` (the way a view outside cache.root reads it), made if missing;
    False when that name is taken by something else."""
    link = view_root / source.name
    problem = writable_dir_problem(view_root)
    if problem:
        raise CacheError(f"the folder {view_root}: {problem}")
    try:
        if link.is_symlink() or link.exists():
            return link.resolve() == source.resolve()
        link.symlink_to(Path(os.path.abspath(source)), target_is_directory=True)
        return True
    except OSError:
        return False


def _source_still_holds(view: Manifest) -> bool:
    """Whether the files a view reads from its source are all still there at their recorded size (checked under the
    source's lock, after the sha256 check done before it: cheap, but enough to see a removal meanwhile)."""
    for s, e in view.shards.items():
        if e.get("own"):
            continue
        try:
            if view.shard_path(s).stat().st_size != e["bytes"]:
                return False
        except OSError:
            return False
    return True


def _read_by_other_views(cache_dir: Path) -> dict[str, dict]:
    """The shard files of ``cache_dir`` that other views under its root read (file -> the entry they record: bytes,
    sha256): never removed, and a directory holding such files is rebuilt as a cache of its own, never a view."""
    root = Path(os.path.abspath(cache_dir)).parent
    found: dict[str, dict] = {}
    if not root.is_dir():
        return found
    for d in sorted(root.iterdir()):
        if d.name.startswith(".") or d.name == cache_dir.name or not d.is_dir():
            continue
        try:
            m = Manifest.load(d)
        except CacheError:
            continue
        if m.view_of == cache_dir.name:
            found.update({e["file"]: e for e in m.shards.values() if not e.get("own")})
    return found


def _build_lock(cache_dir: Path, log=_log):
    """One build of a cache at a time (``exclusive_lock`` on ``lock_path``), saying so while it waits."""
    return exclusive_lock(lock_path(cache_dir), lambda: log(f"cache: another process is building {cache_dir.name}; "
                                                            "waiting for it"))


def _remove_unrecorded_shards(view: Manifest) -> None:
    """Remove the shard files in a view's directory that its manifest does not record as its own (an own shard found
    bad and now read from the source; one a killed build renamed into place but never recorded; the shards of an
    earlier cache of this key whose manifest was lost): no entry names them, so nothing reads them, and verify would
    call them strays for ever. Called under the view's build lock (no build of it is writing meanwhile)."""
    if view.files_dir.resolve() == view.cache_dir.resolve():  # (a manifest naming itself as its source: leave it)
        return
    own = {e["file"] for e in view.shards.values() if e.get("own")}
    own |= set(_read_by_other_views(view.cache_dir))  # (files other views read: never removed under them)
    for p in view.cache_dir.glob("shard-*.tar"):
        if p.name not in own and SHARD_FILE.match(p.name):
            p.unlink(missing_ok=True)


def _clean_temporaries(cache_dir: Path) -> None:
    """Remove the temporaries of dead writers; those of another build still writing into this cache are kept."""
    for p in cache_dir.glob(".shard-*.tmp"):
        remove_stale_temporary(p)


def build_cache(cfg, data=None, teacher=None, engine=None, *, log=_log, capture_fn=None, device=None,
                devices=None, processes: bool = False) -> Path:
    """Cache the teacher's per-layer tensors (and top-k) over the data plan; returns the cache directory.

    Local engine: `device` (one, in this process), `devices` (one spawned process each; default every
    GPU up to cache.workers); `processes=True` uses a spawned process even for one device (benchmarks).
    Reuses a finished cache with the same (teacher fingerprint, plan hash, capture spec) without any
    teacher forward; a partial one is completed (finished shards are verified and skipped).
    """
    check_root(cache_root(cfg))
    from hmscale.teacher.cache.worker import writers_from_env

    writers_from_env()  # (a bad $HMSCALE_CACHE_WRITERS: refused before the data, the teacher and the manifest)
    if data is None:
        from hmscale.data import prepare_data

        data = prepare_data(cfg)
    if teacher is None:
        from hmscale.teacher import get_teacher

        teacher = get_teacher(cfg, data)
    plan = data.plan
    engine = engine or cfg.cache.engine or cfg.parallel.engine
    if engine not in ("local", "ray"):
        raise CacheError(f"cache engine {engine!r}: choose 'local' or 'ray'")

    cp = plan_cache(cfg, plan, teacher)
    cache_dir = cp.cache_dir
    log(f"cache: {cp.describe()}")
    config_hash = cfg.hash("teacher", "tokenizer", "data", "cache")
    try:
        manifest = Manifest.load(cache_dir)
    except CacheError as err:
        manifest = None
        if (cache_dir / MANIFEST).exists():
            log(f"cache: {err}: starting a new manifest (its shards are redone, to the same bytes)")
    if manifest is not None and manifest.data.get("key") != cp.key:
        raise CacheError(f"{cache_dir}/manifest.json belongs to cache {manifest.data.get('key')}, not {cp.key}; remove the directory")
    kept: dict[int, dict] = {}  # the own shards of a view replaced below (entries of a cache of its own)
    if manifest is not None and manifest.view_of:
        theirs = {s for s, e in manifest.shards.items() if not e.get("own")}  # (recorded: read from the source)
        checked = (manifest.view_of, dict(manifest.data["shards"]))  # (what was found broken, before any drop)
        present = existing_shards(manifest, cp.shard_ids, log=lambda *_: None)
        if len(present) == len(cp.shard_ids):
            log(f"cache: reusing {cache_dir} (a view onto {manifest.view_of}: {shards_line(manifest, cp.shard_ids)}): "
                f"all {len(cp.shard_ids)} shards verified; no teacher forward needed")
            return cache_dir
        lost = sorted(s for s in cp.shard_ids if s in theirs and s not in present)
        if lost:  # the source lost shards the view reads: replaced (shards it merely lacks are added to it, below)
            # under the build lock: another build may be replacing it too (it then holds, or is writing, its own shards,
            # or is a view again: onto another cache, or with shards of its own for those lost): only the view found
            # broken above is deleted, never what another build made of it meanwhile
            with _build_lock(cache_dir, log):
                try:
                    now = Manifest.load(cache_dir)
                    still_view = (now.view_of, now.data["shards"]) == checked
                except CacheError:
                    still_view = False
                if still_view:
                    # its own shards (verified above) are what a cache of its own holds, byte for byte: kept for
                    # what replaces it, never computed again
                    kept = {s: {k: v for k, v in e.items() if k != "own"} for s, e in now.shards.items()
                            if e.get("own") and s in present}
                    log(f"cache: the view {cp.key} onto {manifest.view_of} finds {len(lost)} of the shards it reads "
                        f"there missing or altered (e.g. {shard_name(lost[0])}); replacing it with a cache of its own "
                        f"(keeping the {len(kept)} shards computed for it; its teacher forward runs on the others, "
                        "unless another cache under cache.root holds them)")
                    (cache_dir / MANIFEST).unlink()
                    files = {e["file"] for e in kept.values()}
                    for p in cache_dir.glob("shard-*.tar"):
                        if p.name not in files:
                            p.unlink(missing_ok=True)
        try:  # (what another build wrote meanwhile, else none; a view's own shards found bad are named, redone below)
            manifest = Manifest.load(cache_dir)
        except CacheError:
            manifest = None
    if manifest is None and not kept and _unwritable(cache_dir):
        # a read-only cache.root (a team's cache on a read-only mount): a request that another cache there covers, all
        # of its shards, is a view written outside it; anything else stops with one line (nothing is written there)
        return _view_outside_root(cfg, cp, config_hash, log)
    if manifest is None:
        manifest = _view_onto_covering_cache(cfg, cp, config_hash, log, kept=kept)
        if manifest is not None and manifest.complete:
            return cache_dir
    if manifest is None:
        manifest = Manifest.new(
            cache_dir,
            key=cp.key,
            teacher={"fingerprint": cp.fingerprint, "n_layers": cp.shape.n_layers, "d_model": cp.shape.d_model,
                     "n_heads": cp.shape.n_heads, "head_dim": cp.shape.head_dim, "vocab_size": cp.shape.vocab_size,
                     "name_or_path": cfg.teacher.name_or_path, "flavor": cfg.teacher.flavor},
            plan={"hash": plan.hash, "num_shards": plan.num_shards, "seq_len": plan.seq_len,
                  "sequences_per_shard": plan.sequences_per_shard},
            capture=cp.spec.to_json(),
            layout=cp.manifest_layout(),
            config_hash=config_hash,
        )
        manifest.data["shards"].update({str(s): e for s, e in sorted(kept.items())})  # (verified again below)

    # one build of a cache at a time: concurrent runs asking for it (ablations started together, a sweep's sizes) wait
    # for the first and find its shards, instead of computing every one again; the lock under the root's .locks/ (the
    # cache holds shards and its manifest only); without file locks the builds run side by side (the manifest merge
    # keeps both's shards)
    if manifest is not None and writable_dir_problem(cache_dir):
        # a finished cache this user may only read (another user's shared cache, a read-only mount): read it as it is;
        # only a cache that lacks shards needs writing (then the one line below)
        if len(existing_shards(manifest, cp.shard_ids, log=lambda *_: None)) == len(cp.shard_ids):
            log(f"cache: reusing {cache_dir} (read-only here): all {len(cp.shard_ids)} shards present and verified; "
                "no teacher forward needed")
            return cache_dir
    make_cache_dir(cache_dir)  # (one line for an unwritable root, before its lock file is made)
    with _build_lock(cache_dir, log):
        manifest = _latest(manifest)  # (what another build recorded since: waited for, or finished meanwhile)
        return _complete(cfg, plan, teacher, cp, manifest, engine, log=log, capture_fn=capture_fn, device=device,
                         devices=devices, processes=processes)


def _latest(manifest: Manifest) -> Manifest:
    """The cache's manifest as saved now, when another build of it saved one since ``manifest`` was read (one this
    build waited for, or one that finished meanwhile: its shards are not computed again), else ``manifest``."""
    try:
        saved = Manifest.load(manifest.cache_dir)
    except CacheError:  # none, or damaged (this build's new one replaces it)
        return manifest
    return saved if saved.data.get("key") == manifest.data.get("key") else manifest


def _complete(cfg, plan, teacher, cp: CachePlan, manifest: Manifest, engine: str, *, log=_log, capture_fn=None,
              device=None, devices=None, processes=False) -> Path:
    """Compute the shards of ``cp`` that ``manifest`` lacks (or holds damaged), recording each as it lands."""
    cache_dir = cp.cache_dir
    recorded = dict(manifest.data["shards"])
    done = existing_shards(manifest, cp.shard_ids, log=log)
    if manifest.view_of:  # shards its source holds by now are read from it; only the others are computed, for the view
        done |= existing_shards(manifest, borrow(manifest, [s for s in cp.shard_ids if s not in done]), log=log)
        manifest.data.setdefault("own_layout", cp.manifest_layout())  # (a view written before views had own shards)
    # shards finished on disk but never recorded (a build stopped between a shard's rename and its record; a lost
    # manifest): checked and recorded, not computed again (before the removal of a view's unrecorded files below)
    # (a recorded shard found damaged above is redone: its file no longer has the bytes recorded)
    done |= _adopt_unrecorded(manifest, cp, plan, [s for s in cp.shard_ids if s not in done and str(s) not in recorded],
                              log)
    if manifest.view_of:
        _remove_unrecorded_shards(manifest)
    pending = [s for s in cp.shard_ids if s not in done]
    if not pending:
        # (also when a bad shard was dropped, or a source's taken in its place: the manifest must say so)
        if manifest.data["shards"] != recorded or not (manifest.complete and set(manifest.data["requested_shards"])
                                                       >= set(cp.shard_ids)):
            manifest.set_requested(cp.shard_ids)
            manifest.update_complete()
            _save_first(manifest)
        _clean_temporaries(cache_dir)  # (of a writer killed mid-shard whose shard got done since: else kept for ever)
        view = f" (a view onto {manifest.view_of}: {shards_line(manifest, cp.shard_ids)})" if manifest.view_of else ""
        log(f"cache: reusing {cache_dir}{view}: all {len(cp.shard_ids)} shards present and verified; no teacher "
            "forward needed")
        return cache_dir

    missing = int(cp.total_bytes * len(pending) / max(len(cp.shard_ids), 1))
    check_disk(cp, missing, cfg.cache.allow_exceed_disk, log=log)
    manifest.set_requested(cp.shard_ids)
    manifest.update_complete()
    _save_first(manifest)
    if manifest.view_of:
        log(f"cache: a view onto {manifest.view_of} ({shards_line(manifest, done)}): computing the other "
            f"{len(pending)} shards for it, at its own capture, into {cache_dir}")
    elif done:
        log(f"cache: {len(done)} shards already done in {cache_dir}; computing the other {len(pending)}")

    progress = Progress(len(cp.shard_ids), len(done), log=log)
    seen_keys: dict[str, int] = {}
    last_save = [time.perf_counter()]

    def on_done(info: ShardInfo) -> None:
        for k in info.keys:
            if seen_keys.setdefault(k, info.shard) != info.shard:
                raise CacheError(f"sample key {k} appears in shards {seen_keys[k]} and {info.shard}; the data plan is not deterministic")
        manifest.add_shard(info)
        progress.shard_done(info)
        if time.perf_counter() - last_save[0] > 2.0:
            manifest.save()
            last_save[0] = time.perf_counter()

    ran = False
    try:
        if engine == "local":
            run_local(cfg, plan, teacher, cp, pending, on_done, device=device, devices=devices, capture_fn=capture_fn,
                      log=log, processes=processes)
        else:
            from ray_jobs.cache_teacher import run_ray

            run_ray(cfg, plan, teacher, cp, pending, on_done, log=log, capture_fn=capture_fn)
        ran = True
    except KeyboardInterrupt:
        log(f"cache: interrupted: {progress.done}/{progress.total} shards done and kept in {cache_dir}; "
            f"rerun {BUILDERS}, whichever was building it (same config), to finish the others")
        raise
    finally:
        try:  # the shards done so far recorded, after a failure too (the rerun skips them)
            manifest.update_complete()
            manifest.save()
        except Exception as err:
            if ran:
                raise
            # a shard failed (or the run was interrupted): that error, on its way up, is the one to see; the manifest's
            # own (often the same full disk) would replace it. The rerun redoes the shards the manifest lacks
            log(f"cache: the manifest could not be saved after the failure either ({type(err).__name__}: {err})")
        # after a failure too: the temporaries of workers that died or were stopped (a live writer's stay locked)
        _clean_temporaries(cache_dir)
    left = [s for s in cp.shard_ids if s not in manifest.shards]  # this run's shards (others may ask for more)
    if left:
        raise CacheError(f"cache {cache_dir} lacks {len(left)} of this run's shards after the run (e.g. "
                         f"{shard_name(left[0])}); rerun {BUILDERS}, whichever was building it (same config), "
                         "to finish it")
    log(f"cache: done: {progress.line().removeprefix('cache: ')} -> {cache_dir}"
        + (f" (a view: {shards_line(manifest, cp.shard_ids)})" if manifest.view_of else ""))
    return cache_dir


def _save_first(manifest: Manifest) -> None:
    """Save the manifest; a view's first save (no manifest in its directory yet) under its source's lock, once the
    source is seen to hold the files the view reads (``source_held``: `cache rm` of the source lists the view, or has
    removed the source and the build stops here with one line, instead of leaving a view onto a deleted cache)."""
    if not manifest.view_of or manifest.path.is_file():
        manifest.save()
        return
    with source_held(manifest.files_dir) as intact:
        if not (intact and _source_still_holds(manifest)):
            raise CacheError(f"the cache {manifest.view_of}, whose shards this view reads, was removed while this build "
                             f"started (`hmscale cache rm`); rerun {BUILDERS} (same config) to build {_key_of(manifest)} "
                             "without it")
        manifest.save()


def _key_of(manifest: Manifest) -> str:
    return str(manifest.data.get("key", manifest.cache_dir.name))


def _adopt_unrecorded(manifest: Manifest, cp: CachePlan, plan, shard_ids, log=_log) -> set[int]:
    """Record the shards of ``shard_ids`` whose file lies finished in the cache directory although the manifest does
    not name it (Ctrl-C of a build with several worker processes between a shard's rename and its record; a killed
    driver; a lost manifest), instead of computing them again; returns them. A file is taken only when it holds what
    the plan asks of the shard: the plan's sample keys, each once, with every field of this request's capture at its
    dtype and shape (``verify``'s check of a shard), and, where other views read the file, their recorded size and
    sha256. A regular file at the final name is whole (the writer renames it there after its fsync); any other is
    left to be redone."""
    from hmscale.teacher.cache.format import check_sample_key
    from hmscale.teacher.cache.verify import check_shard_file

    cache_dir = manifest.cache_dir
    candidates = [s for s in shard_ids if (cache_dir / shard_name(s)).is_file()
                  and not (cache_dir / shard_name(s)).is_symlink() and str(s) not in manifest.data["shards"]
                  and s not in manifest._dropped]
    if not candidates:
        return set()
    fields = cp.manifest_layout()["fields"]  # (a view's own shards are at its own capture: its own_layout)
    others = {} if manifest.view_of else _read_by_other_views(cache_dir)
    adopted = set()
    for s in candidates:
        p = cache_dir / shard_name(s)
        try:
            size, sha = p.stat().st_size, sha256_file(p)
            keys = sorted(check_sample_key(k) for k in plan.shard(s)["keys"])
        except (OSError, CacheError):
            continue
        ref = others.get(p.name)
        if ref is not None and (ref["bytes"], ref["sha256"]) != (size, sha):
            continue
        entry = {"file": p.name, "sha256": sha, "bytes": size, "samples": len(keys), "tokens": len(keys) * cp.seq_len}
        reason, got = check_shard_file(p, entry, fields)
        if reason or got != keys:
            continue
        manifest.add_shard(ShardInfo(shard=s, **entry))
        adopted.add(s)
    if adopted:
        log(f"cache: {len(adopted)} shards lay finished in {cache_dir} but were not in its manifest (an interrupted "
            f"build, or a lost manifest; e.g. {shard_name(min(adopted))}): checked against the plan and recorded, not "
            "computed again")
    return adopted


def local_devices(cfg, device=None) -> list[str]:
    """Devices of the local engine: the given one; else one per GPU, up to cache.workers; else the CPU."""
    if device is not None:
        return [str(device)]
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus > 1:
        return [f"cuda:{i}" for i in range(min(gpus, cfg.cache.workers))]
    return ["cuda" if gpus else "cpu"]


def run_local(cfg, plan, teacher, cp: CachePlan, pending, on_done, *, device=None, devices=None, capture_fn=None,
              log=_log, processes: bool = False) -> None:
    """The pending shards on this machine. One device: in this process, one teacher, several shards
    written concurrently (`ShardWorker.writer_threads`; $HMSCALE_CACHE_WRITERS overrides). Several
    (`devices`, or every GPU up to cache.workers): one spawned process per device (`multiproc`)."""
    devices = list(devices) if devices else local_devices(cfg, device)
    if processes or (len(devices) > 1 and len(pending) > 1):
        from hmscale.teacher.cache.multiproc import run_processes

        run_processes(cfg, plan, teacher, cp, pending, on_done, devices=devices, log=log, capture_fn=capture_fn)
        return
    from hmscale.teacher.cache.worker import ShardWorker

    worker = ShardWorker(teacher, plan, cp.spec, cp.cache_dir, batch_size=cfg.cache.batch_size, device=devices[0],
                         capture_fn=capture_fn)
    try:
        worker.run_shards(pending, on_done)
    except CacheError:
        raise
    except Exception as err:
        sid = getattr(err, "shard_id", None)
        where = shard_name(sid) if sid is not None else "a shard"
        raise CacheError(failure_message(err, where, cp.cache_dir)) from err
