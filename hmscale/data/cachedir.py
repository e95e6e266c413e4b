"""On-disk cache entries that appear atomically: build in a temporary sibling, then rename."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

from hmscale.atomic import exclusive_lock


def stable_hash(obj, n: int = 16) -> str:
    """A short sha256 of a JSON-serialisable object (keys sorted)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:n]


def atomic_dir(target: str | os.PathLike, build: Callable[[Path], None]) -> Path:
    """Create directory `target` by calling build(tmp_dir) and renaming tmp_dir into place.

    Readers never see a half-written entry. When another process finished the same entry
    first, its copy wins and ours is discarded (entries are content-addressed, so equal).
    """
    target = Path(target)
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        build(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.is_dir():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def resumable_dir(target: str | os.PathLike, build: Callable[[Path], None], log=print, *, resume: bool = True,
                  tag: str = "data", lock_path: str | os.PathLike | None = None) -> Path:
    """Create directory `target` like ``atomic_dir``, for long builds that must survive an interruption:
    build(partial) works in the fixed sibling `.{name}.partial`, which an interrupted build leaves behind, so the
    next call hands the same directory back and `build` resumes from what it recorded there. One builder at a
    time: the others wait on a lock file (saying so), then find `target` built. Where the filesystem has no
    ``flock`` (some network mounts), each builder works apart as in ``atomic_dir``, without resuming.

    ``resume=False``: for builds that cannot resume (a teacher's pretraining): what an interrupted build left in
    `.{name}.partial` is deleted first, so it never leaks into the entry (the lock still makes the others wait).
    ``lock_path``: the lock file (default `.{name}.lock` beside `target`; it stays, as removing it would race)."""
    target = Path(target)
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    lock_path = Path(lock_path) if lock_path is not None else target.parent / f".{target.name}.lock"
    on_wait = lambda: log(f"[{tag}] {target.name}: another process is building it; waiting for it")  # noqa: E731
    with exclusive_lock(lock_path, on_wait) as waited:
        if waited is None:
            log(f"[{tag}] {target.parent}: no file locks here; building {target.name} without resume")
            return atomic_dir(target, build)
        if target.is_dir():
            return target
        partial = target.parent / f".{target.name}.partial"
        if not resume and partial.exists():  # an interrupted build's leftovers (we hold the lock: no one writes it)
            shutil.rmtree(partial)
        partial.mkdir(exist_ok=True)
        build(partial)
        os.rename(partial, target)
        fd = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return target
