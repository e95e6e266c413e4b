"""The teacher cache: per-layer teacher tensors (and top-k log-probs) in versioned webdataset shards.

    build_cache(cfg, data=None, teacher=None, engine=None) -> Path   # "local" or "ray"
    CacheReader(dir).stage1_batches(layers, batch_size, rank=, world_size=, seed=, start=)
    CacheReader(dir).stage2_batches(batch_size, ...)
    open_for_run(cfg, dir) -> CacheReader                            # over the run's own shards
    verify_cache(dir) -> VerifyReport (.ok, .bad {shard: reason}, .summary())

Format: docs/CACHE_FORMAT.md (FORMAT_VERSION in format.py).
"""

from hmscale.teacher.cache.build import CachePlan, build_cache, open_for_run, plan_cache
from hmscale.teacher.cache.format import FORMAT_VERSION, CacheCorruptError, CacheError, CaptureSpec
from hmscale.teacher.cache.reader import CacheLoader, CacheReader
from hmscale.teacher.cache.verify import VerifyReport, verify_cache

__all__ = [
    "FORMAT_VERSION",
    "CacheCorruptError",
    "CacheError",
    "CacheLoader",
    "CachePlan",
    "CacheReader",
    "CaptureSpec",
    "VerifyReport",
    "build_cache",
    "open_for_run",
    "plan_cache",
    "verify_cache",
]
