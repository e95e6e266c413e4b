"""What a cache root holds: one row per cache directory, read from the manifests only (no shard is opened).

``hmscale cache list [ROOT]`` prints it: for a team that keeps one teacher pass per (teacher, data plan, capture
spec) and reuses it across runs, which caches exist, how far each got, what they weigh on disk and when each was
last written; directories under the root that are not readable caches are listed with the reason, and leftover
temporary shard files (a worker killed mid-shard; the next build of that cache removes them) are counted.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX: no file locks, so no way to tell a build at work
    fcntl = None

from hmscale.teacher.cache.format import MANIFEST, CacheError, human_bytes, lock_path
from hmscale.teacher.cache.manifest import Manifest, source_dir

__all__ = ["CacheEntry", "list_caches", "format_catalog"]


@dataclass
class CacheEntry:
    path: Path
    error: str | None = None  # not a readable cache: why
    key: str = ""
    teacher: str = ""
    fingerprint: str = ""
    plan: str = ""
    layers: str = ""
    tensors: str = ""
    dtype: str = ""
    token_fraction: float = 1.0
    topk: int = 0
    shards_done: int = 0
    shards_requested: int = 0
    tokens: int = 0
    bytes: int = 0
    complete: bool = False
    updated: str = ""
    view_of: str = ""  # the key of the cache whose shards a view reads ("" for a cache of its own)
    temporaries: list[Path] = field(default_factory=list)

    def row(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k not in ("path", "temporaries")}
        d["path"] = str(self.path)
        d["temporaries"] = len(self.temporaries)
        d["temporary_bytes"] = sum(_size(p) for p in self.temporaries)
        return d


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except OSError:
        return 0


def _layers(spec) -> str:
    if spec == "all" or not isinstance(spec, list):
        return str(spec)
    if spec and spec == list(range(spec[0], spec[-1] + 1)):
        return f"{spec[0]}-{spec[-1]}" if len(spec) > 1 else str(spec[0])
    return ",".join(str(i) for i in spec)


def _entry(d: Path) -> CacheEntry:
    e = CacheEntry(path=d, temporaries=sorted(d.glob(".shard-*.tmp")))
    try:
        m = Manifest.load(d)
    except CacheError as err:
        e.error = str(err)
        return e
    data = m.data
    t, cap, plan = data.get("teacher", {}), data.get("capture", {}), data.get("plan", {})
    shards = m.shards
    e.key = data.get("key", d.name)
    e.teacher = str(t.get("name_or_path") or t.get("flavor") or "?")
    e.fingerprint = str(t.get("fingerprint", ""))[:12]
    e.plan = str(plan.get("hash", ""))
    e.layers = _layers(cap.get("layers"))
    e.tensors = "+".join(cap.get("tensors", []))
    e.dtype = str(cap.get("dtype", ""))
    e.token_fraction = float(cap.get("token_fraction", 1.0))
    e.topk = int(cap.get("topk", 0))
    e.shards_done = len(shards)
    e.shards_requested = len(data.get("requested_shards", []))
    e.tokens = sum(int(s.get("tokens", 0)) for s in shards.values())
    e.view_of = m.view_of or ""
    # its own bytes: a view's are the shards computed for it (those its source lacks), none of its source's
    e.bytes = sum(int(s.get("bytes", 0)) for s in shards.values() if s.get("own") or not e.view_of)
    e.complete = m.complete
    e.updated = str(data.get("updated", ""))
    return e


def list_caches(root) -> list[CacheEntry]:
    """Every directory directly under ``root`` (and ``root`` itself if it is a cache), in name order."""
    root = Path(root).expanduser()  # (cache.root from a config: `hmscale cache list` without ROOT)
    if not root.is_dir():
        what = "is not a directory" if root.exists() else "does not exist"
        raise CacheError(f"{root} {what}; pass the folder holding the caches (a config's cache.root, default "
                         ".cache/hmscale/teacher)")
    if (root / MANIFEST).exists():
        return [_entry(root)]
    return [_entry(d) if d.is_dir() else _dangling(d) for d in sorted(root.iterdir())
            if not d.name.startswith(".") and (d.is_dir() or (d.is_symlink() and not d.exists()))]


def _dangling(d: Path) -> CacheEntry:
    """A link in the root whose directory is gone (a cache moved to another disk, then removed there): a build of that
    key stops on it, so it is listed."""
    return CacheEntry(path=d, error=f"a link to {os.readlink(d)}, which does not exist (moved or removed); remove the "
                                    "link, or put back the directory it names")


def format_catalog(entries: list[CacheEntry], root) -> str:
    """The table ``hmscale cache list`` prints, and a total line."""
    if not entries:
        return f"{root}: no caches (build one with `hmscale cache CONFIG`)"
    lines = [f"{'cache':<26} {'teacher':<22} {'layers':<9} {'tensors':<22} {'dtype':<9} {'tok':>4} {'top-k':>5} "
             f"{'shards':>11} {'tokens':>13} {'size':>10}  {'state':<9} updated"]
    total = stale = 0
    for e in entries:
        tmp = sum(_size(p) for p in e.temporaries)
        stale += tmp
        if e.error:
            lines.append(f"{e.path.name:<26} not a cache: {e.error}")
            continue
        total += e.bytes
        teacher = f"{e.teacher[-13:]}@{e.fingerprint[:8]}"
        state = "complete" if e.complete else "partial"
        if e.view_of:
            gone = not (source_dir(e.path, e.view_of) / MANIFEST).is_file()  # (`cache list .` in the view)
            state = (f"view of {e.view_of}" + ("" if e.complete else ", partial")  # (its own shards interrupted)
                     + (" (source missing: the next build replaces it)" if gone else ""))
        lines.append(f"{e.key:<26} {teacher:<22} {e.layers:<9} {e.tensors:<22} {e.dtype:<9} {e.token_fraction:>4g} "
                     f"{e.topk:>5} {e.shards_done:>5}/{e.shards_requested:<5} {e.tokens:>13,} {human_bytes(e.bytes):>10}  "
                     f"{state:<9} {e.updated}" + (f"  ({len(e.temporaries)} temporary files, {human_bytes(tmp)})" if e.temporaries else ""))
    n = sum(1 for e in entries if not e.error)
    lines.append(f"{n} cache(s), {human_bytes(total)} in shards" + (f"; {human_bytes(stale)} in temporary files of interrupted "
                                                            "shards (the next build of their cache removes them)"
                                                            if any(e.temporaries for e in entries) else ""))
    return "\n".join(lines)


def _held_by_another(f) -> bool:
    """Take ``f``'s flock without waiting: False when taken (it stays held until ``f`` closes), True when another
    open file holds it (a live build: locks die with their process). Without file locks, False."""
    if fcntl is None:
        return False
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:  # a filesystem without locks: nothing to tell
        return False
    return False


@contextlib.contextmanager
def _not_being_built(dirs):
    """Refuse (CacheError) while a build writes one of ``dirs``: it holds the cache's lock under the root's ``.locks/``
    (``build_cache``) or a shard temporary locked (``ShardWriter``). The build locks stay taken until the block ends,
    so a build starting meanwhile waits for the removal instead of writing into a directory being deleted."""
    with contextlib.ExitStack() as stack:
        for d in dirs:
            lock = lock_path(d)
            held = [lock] if lock.is_file() and _held_by_another(stack.enter_context(open(lock, "rb"))) else []
            for tmp in [] if held else sorted(d.glob(".shard-*.tmp")):
                try:
                    with open(tmp, "rb") as f:
                        if _held_by_another(f):
                            held = [tmp]
                            break
                except OSError:  # renamed or removed meanwhile: not being written any more
                    pass
            if held:
                raise CacheError(f"{d.name} is being built (a running build holds {held[0]}); wait for that build to "
                                 "finish, or stop it, then rerun `hmscale cache rm`")
        yield


def remove_cache(path, force: bool = False) -> list[Path]:
    """Delete a cache directory (one with a manifest, never anything else), and with ``force`` the views that read
    it; without ``force`` a cache that views read is refused, naming them. A cache (or view) a running build is
    writing is refused, ``force`` or not: deleting it under the build broke the build and left a manifest naming
    the deleted shards. Returns what was removed."""
    # given a moved cache's own directory, the link in the root that names it is found (``_cache_dir_named``): the
    # root's views and lock are checked through it, and it goes with the directory, as if the link had been given
    path = _cache_dir_named(path)
    if not (path / MANIFEST).is_file():
        Manifest.load(path)  # raises CacheError for a directory that is not a cache
    # a manifest that no longer loads (damaged, edited, another format version) still marks a cache: removable
    # (a view moved to another disk and linked back into the root reads this cache too: it counts, and goes with it)
    # the views are listed, and everything removed, holding the directory's removal lock: a build making a view onto
    # it holds that lock shared while it checks the cache and saves the view (``source_held``), so the view is either
    # listed here (refused without --force) or finds the cache gone, never a view onto a deleted cache
    with _removal_lock(path):
        views = [e.path for e in list_caches(path.parent) if e.view_of == path.name]
        if views and not force:
            raise CacheError(f"{len(views)} view(s) read {path.name}'s shards ({', '.join(v.name for v in views)}); "
                             "pass --force to remove them too (their runs would otherwise rebuild them with a teacher "
                             "pass)")
        with _not_being_built([*views, path]):
            for d in views:
                _remove_dir(d)
            _remove_dir(path)
    return [*views, path]


def _flock(fd, shared: bool, wait_s: float | None) -> bool | None:
    """Take ``fd``'s flock (shared or exclusive): True once taken; False when ``wait_s`` passed first; None where the
    filesystem has no file locks (nothing to coordinate with)."""
    if fcntl is None:
        return None
    mode = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
    deadline = None if wait_s is None else time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        except OSError:
            return None


def _open_dir(d: Path) -> int | None:
    try:
        return os.open(d, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # gone (removed meanwhile), or not openable: nothing to lock
        return None


@contextlib.contextmanager
def _removal_lock(d: Path, wait_s: float = 60.0):
    """``cache rm``'s exclusive flock on the cache directory itself (not a file in it: removed with it) for the whole
    removal; a view being saved onto it holds it shared for a moment (``source_held``), so this waits for that."""
    fd = _open_dir(d)
    try:
        if fd is not None and _flock(fd, shared=False, wait_s=wait_s) is False:
            raise CacheError(f"{d.name} is being made the source of a view by a running build (it holds {d}'s lock); "
                             "rerun `hmscale cache rm` once that build has started")
        yield
    finally:
        if fd is not None:
            os.close(fd)


@contextlib.contextmanager
def source_held(source: Path):
    """Hold ``source``'s directory lock shared (``cache rm`` takes it exclusive while it lists the views and removes):
    yields whether ``source`` is still the cache it was when opened (its manifest present, the directory not removed
    or replaced meanwhile). A build saves a view onto ``source`` only inside this block, and only when it yields True."""
    fd = _open_dir(source)
    try:
        if fd is None:
            yield False
            return
        _flock(fd, shared=True, wait_s=None)
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(source))
        except OSError:
            same = False
        yield same and (source / MANIFEST).is_file()
    finally:
        if fd is not None:
            os.close(fd)


def _cache_dir_named(path) -> Path:
    """The cache directory ``path`` names, as its root holds it: `.` or `x/..` resolved (their lexical parent is not the
    root); a link in the root to a directory of its own name (a cache moved to another disk) as the link, so that the
    views and the build lock under that root are found (also when given the moved directory itself: the link in the
    root that names it, see ``_link_in_root``). Any other link (another name for a cache) is refused."""
    given = Path(path)
    if not given.is_symlink():
        real = given.resolve()
        return _link_in_root(real) or real
    target = given.resolve()
    if target.name != given.name or not target.is_dir():
        raise CacheError(f"{path} is a link; pass the cache directory itself")
    return Path(os.path.abspath(given))


def _link_in_root(real: Path) -> Path | None:
    """For a cache directory moved to another disk and linked back into its root under its own name, given by its
    real path: that link. The roots looked in: the one its manifest was last written through (``root``), and the
    default cache.root (relative to the working directory). None when neither holds a link naming ``real``."""
    roots = []
    try:
        recorded = json.loads((real / MANIFEST).read_text()).get("root")
        if isinstance(recorded, str) and recorded:
            roots.append(Path(recorded))
    except (OSError, ValueError, AttributeError):  # (no readable manifest: the default root only)
        pass
    try:
        from hmscale.config import CacheConfig

        roots.append(Path(CacheConfig().root).expanduser())
    except Exception:  # noqa: BLE001 - a hint only
        pass
    for r in roots:
        link = Path(os.path.abspath(r)) / real.name
        try:
            if link.is_symlink() and link.resolve() == real:
                return link
        except OSError:
            continue
    return None


def _remove_dir(d: Path) -> None:
    """Delete a cache directory; for a link in the root (a cache or view moved elsewhere), the directory it names,
    and the link."""
    import shutil

    target = d.resolve() if d.is_symlink() else d
    if target.is_dir():  # (gone already when another link in the root named it too)
        shutil.rmtree(target)
    if d.is_symlink():
        d.unlink()
