"""Views: a run whose capture is contained in an existing cache reads that cache instead of running the teacher.

A cache is keyed by its exact capture spec, so without views a stage-2 run without KD (``topk: 0``) next to one with
KD (``topk: 32``), or a stage 1 over a few layers next to one over all of them, would each pay a teacher pass. A cache
*covers* a request when it was made by the same teacher (fingerprint) over the same data plan, in the same storage
dtype, with the same kept positions (token fraction and seed), and holds every requested layer, tensor and shard and
a top-k at least as large (stored largest first, so the first k are the top k) in the same dtype.

The request's own directory then gets a manifest with ``view_of: <source key>``: the request's capture spec, and the
source's entries (file, bytes, sha256) for the requested shards only. Readers of the view open the source's files
(``Manifest.files_dir``), read only the view's layers and tensors and the first k of the top-k: what a cache built for
the request would return, bit for bit (tested), without its teacher forward or its bytes. A view whose source lost a
shard is found by the same checks as any cache (size and sha256 before use) and is rebuilt.
"""

from __future__ import annotations

from pathlib import Path

from hmscale.teacher.cache.format import CacheError, CaptureSpec
from hmscale.teacher.cache.manifest import Manifest


def covers(source: Manifest, fingerprint: str, plan_hash: str, spec: CaptureSpec, shard_ids) -> bool:
    """Whether ``source`` (not itself a view) holds everything ``spec`` asks of ``shard_ids``."""
    d = source.data
    if source.view_of or d.get("teacher", {}).get("fingerprint") != fingerprint or d.get("plan", {}).get("hash") != plan_hash:
        return False
    try:
        have = CaptureSpec.from_json(d["capture"])
    except (KeyError, TypeError):
        return False
    if spec.tensors and (have.dtype != spec.dtype or not set(spec.layers) <= set(have.layers)
                         or not set(spec.tensors) <= set(have.tensors)):
        return False
    if have.token_fraction != spec.token_fraction:  # the kept positions, read by every stage
        return False
    if spec.token_fraction < 1.0 and have.seed != spec.seed:  # (the seed draws them; with every position kept, unused)
        return False
    if spec.topk and (have.topk < spec.topk or have.topk_dtype != spec.topk_dtype):
        return False
    return set(shard_ids) <= set(source.shards)


def covering_caches(root, fingerprint: str, plan_hash: str, spec: CaptureSpec, shard_ids) -> list[Manifest]:
    """The caches under ``root`` that cover the request, smallest first (fewest bytes to read)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for d in sorted(root.iterdir()):
        if not d.is_dir() or d.name.startswith("."):
            continue
        try:
            m = Manifest.load(d)
        except CacheError:
            continue
        if covers(m, fingerprint, plan_hash, spec, shard_ids):
            found.append(m)
    return sorted(found, key=lambda m: sum(int(e.get("bytes", 0)) for e in m.shards.values()))


def view_manifest(cache_dir, source: Manifest, *, key: str, spec: CaptureSpec, shard_ids, config_hash: str) -> Manifest:
    """The (unsaved) manifest of a view onto ``source`` for ``spec`` over ``shard_ids``; complete by construction."""
    src = source.data
    m = Manifest.new(cache_dir, key=key, teacher=src["teacher"], plan=src["plan"], capture=spec.to_json(),
                     layout=src["layout"], config_hash=config_hash)
    m.data["view_of"] = source.cache_dir.name
    m.data["shards"] = {str(s): source.shards[s] for s in sorted(set(shard_ids))}
    m.set_requested(shard_ids)
    m.update_complete()
    return m


def describe_view(spec: CaptureSpec, source: Manifest) -> str:
    have = CaptureSpec.from_json(source.data["capture"])
    parts = []
    if set(have.layers) != set(spec.layers) and spec.tensors:
        parts.append(f"layers {list(spec.layers)} of {len(have.layers)}")
    if set(have.tensors) != set(spec.tensors):
        parts.append(f"tensors {'+'.join(spec.tensors) or 'none'} of {'+'.join(have.tensors)}")
    if have.topk != spec.topk:
        parts.append(f"top-{spec.topk} of top-{have.topk}" if spec.topk else f"no top-k (it has {have.topk})")
    return ", ".join(parts) or "the same content"
