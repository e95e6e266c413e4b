"""`manifest.json`: what a cache directory holds, written only by the driver, always atomically."""

from __future__ import annotations

import json
import time
from pathlib import Path

from hmscale.atomic import atomic_write_json
from hmscale.teacher.cache.format import FORMAT_NAME, FORMAT_VERSION, MANIFEST, CacheError, ShardInfo


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class Manifest:
    def __init__(self, data: dict, path: Path):
        self.data = data
        self.path = Path(path)

    # -------------------------------------------------------------------- construction

    @classmethod
    def new(cls, cache_dir, *, key, teacher, plan, capture, layout, config_hash) -> "Manifest":
        data = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "key": key,
            "teacher": teacher,
            "plan": plan,
            "capture": capture,
            "layout": layout,
            "config_hash": config_hash,
            "shards": {},
            "requested_shards": [],
            "complete": False,
            "created": _now(),
            "updated": _now(),
        }
        return cls(data, Path(cache_dir) / MANIFEST)

    @classmethod
    def load(cls, cache_dir) -> "Manifest":
        path = Path(cache_dir) / MANIFEST
        if not path.exists():
            raise CacheError(f"{cache_dir} has no {MANIFEST}; it is not a teacher cache (build one with `hmscale cache CONFIG`)")
        try:
            data = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError) as err:
            raise CacheError(f"{path} is not valid JSON ({err}); rebuild the cache") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
            raise CacheError(f"{path} is not a {FORMAT_NAME} manifest")
        if data.get("format_version") != FORMAT_VERSION:
            raise CacheError(
                f"{path} has format version {data.get('format_version')}, this hmscale reads version {FORMAT_VERSION}; rebuild the cache"
            )
        return cls(data, path)

    # -------------------------------------------------------------------- access

    @property
    def cache_dir(self) -> Path:
        return self.path.parent

    @property
    def view_of(self) -> str | None:
        """The key of the cache whose shard files this one reads (a view: ``hmscale.teacher.cache.reuse``), or None."""
        return self.data.get("view_of")

    @property
    def files_dir(self) -> Path:
        """Where the shard files named in ``shards`` lie: this directory, or for a view its source's (a sibling)."""
        return self.cache_dir.parent / self.view_of if self.view_of else self.cache_dir

    @property
    def shards(self) -> dict[int, dict]:
        return {int(k): v for k, v in self.data["shards"].items()}

    @property
    def complete(self) -> bool:
        return bool(self.data.get("complete"))

    def add_shard(self, info: ShardInfo) -> None:
        self.data["shards"][str(info.shard)] = info.manifest_entry()

    def drop_shard(self, shard: int) -> None:
        self.data["shards"].pop(str(shard), None)

    def set_requested(self, shard_ids) -> None:
        self.data["requested_shards"] = sorted(set(self.data.get("requested_shards", [])) | set(int(s) for s in shard_ids))

    def update_complete(self) -> bool:
        done = set(self.shards)
        self.data["complete"] = all(s in done for s in self.data["requested_shards"])
        return self.data["complete"]

    def save(self) -> None:
        self.data["updated"] = _now()
        self.data["shards"] = {str(k): self.data["shards"][str(k)] for k in sorted(self.shards)}
        atomic_write_json(self.path, self.data)
        try:
            self.path.chmod(0o644)
        except OSError:
            pass
