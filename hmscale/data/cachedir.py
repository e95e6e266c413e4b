"""On-disk cache entries that appear atomically: build in a temporary sibling, then rename."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path


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
