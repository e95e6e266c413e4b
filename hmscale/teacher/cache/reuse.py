"""Views: a run whose capture is contained in an existing cache reads that cache instead of running the teacher.

A cache is keyed by its exact capture spec, so without views a stage-2 run without KD (``topk: 0``) next to one with
KD (``topk: 32``), or a stage 1 over a few layers next to one over all of them, would each pay a teacher pass. A cache
*covers* a request when it was made by the same teacher (fingerprint) over the same data plan, in the same storage
dtype, with the same kept positions (token fraction and seed), and holds every requested layer and tensor and a
top-k at least as large (stored largest first, so the first k are the top k) in the same dtype; of the caches that
cover it and hold some of its shards, the one holding the most (all intact) is read.

The request's own directory then gets a manifest with ``view_of: <source key>``: the request's capture spec, and the
source's entries (file, bytes, sha256) for the requested shards it holds. Readers of the view open the source's files
(``Manifest.files_dir``), read only the view's layers and tensors and the first k of the top-k: what a cache built for
the request would return, bit for bit (tested), without its teacher forward or its bytes. A view whose source lost a
shard is found by the same checks as any cache (size and sha256 before use) and is rebuilt (keeping its own shards).

A request that asks for shards the source does not hold (a larger token budget, ``cache.max_tokens``) still reads
those it does from the source: only the others get a teacher forward, at the request's own capture, into the view's
own directory (entries ``"own": true``, their fields in ``own_layout``: what a cache built for the request holds, so
its readers see the same bytes). A view asked later for more shards takes from its source those it holds by then,
and computes the rest the same way.
"""

from __future__ import annotations

from pathlib import Path

from hmscale.teacher.cache.format import CacheError, CaptureSpec
from hmscale.teacher.cache.manifest import Manifest


def covers(source: Manifest, fingerprint: str, plan_hash: str, spec: CaptureSpec) -> bool:
    """Whether ``source`` (not itself a view) holds what ``spec`` asks of each of its shards."""
    d = source.data
    if source.view_of or d.get("teacher", {}).get("fingerprint") != fingerprint or d.get("plan", {}).get("hash") != plan_hash:
        return False
    try:
        have = CaptureSpec.from_json(d["capture"])
    except (KeyError, TypeError):
        return False
    if spec.stores_layers and (have.dtype != spec.dtype or not set(spec.layers) <= set(have.layers)
                               or not set(spec.tensors) <= set(have.tensors)):
        return False
    if have.token_fraction != spec.token_fraction:  # the kept positions, read by every stage
        return False
    if spec.token_fraction < 1.0 and have.seed != spec.seed:  # (the seed draws them; with every position kept, unused)
        return False
    return not spec.topk or (have.topk >= spec.topk and have.topk_dtype == spec.topk_dtype)


def covering_caches(root, fingerprint: str, plan_hash: str, spec: CaptureSpec, shard_ids) -> list[Manifest]:
    """The caches under ``root`` that cover the request's capture and hold some of its shards: those holding the most
    first (all of them: no teacher forward), then the smallest (fewest bytes to read)."""
    root, want = Path(root), set(shard_ids)
    if not root.is_dir():
        return []
    found = []
    for d in sorted(root.iterdir()):
        if not d.is_dir() or d.name.startswith(".") or _alias(d):
            continue
        try:
            m = Manifest.load(d)
        except CacheError:
            continue
        if covers(m, fingerprint, plan_hash, spec) and want & set(m.shards):
            found.append(m)
    return sorted(found, key=lambda m: (-len(want & set(m.shards)), sum(int(e["bytes"]) for e in m.shards.values())))


def _alias(d: Path) -> bool:
    """A link under another name than the directory it names (a friendly name for a cache): never a view's source, as
    the view would name the link, which `cache rm` of the cache itself does not know (a cache moved to another disk
    and linked back under its own name is one)."""
    return d.is_symlink() and d.resolve().name != d.name


def view_manifest(cache_dir, source: Manifest, *, key: str, spec: CaptureSpec, shard_ids, own_layout: dict,
                  config_hash: str) -> Manifest:
    """The (unsaved) manifest of a view onto ``source`` for ``spec`` over ``shard_ids``: the source's entries for the
    shards it holds; the others are to be computed into the view (at ``spec``, whose layout is ``own_layout``)."""
    src = source.data
    m = Manifest.new(cache_dir, key=key, teacher=src["teacher"], plan=src["plan"], capture=spec.to_json(),
                     layout=src["layout"], config_hash=config_hash)
    m.data["view_of"] = source.cache_dir.name
    m.data["own_layout"] = own_layout
    m.data["shards"] = {str(s): source.shards[s] for s in sorted(set(shard_ids) & set(source.shards))}
    m.set_requested(shard_ids)
    m.update_complete()
    return m


def borrow(view: Manifest, shard_ids) -> list[int]:
    """Record in ``view`` its source's entries for those of ``shard_ids`` the view lacks and the source holds now (a
    source extended since the view was written); returns them, for the caller to verify."""
    try:
        source = Manifest.load(view.files_dir)
    except CacheError:
        return []
    if source.view_of or source.data["key"] != view.view_of:
        return []
    took = [s for s in shard_ids if s in source.shards and s not in view.shards]
    for s in took:
        view.data["shards"][str(s)] = source.shards[s]
    return took


def shards_line(view: Manifest, shard_ids) -> str:
    """How a view's shards among ``shard_ids`` are had: "3 shards read from <source>, 1 computed for this view"."""
    theirs, own = view.own_counts(shard_ids)
    return f"{theirs} shards read from {view.view_of}, {own} computed for this view"


def describe_view(spec: CaptureSpec, source: Manifest) -> str:
    have = CaptureSpec.from_json(source.data["capture"])
    parts = []
    if set(have.layers) != set(spec.layers) and spec.stores_layers:
        parts.append(f"layers {list(spec.layers)} of {len(have.layers)}")
    if set(have.tensors) != set(spec.tensors):
        parts.append(f"tensors {'+'.join(spec.tensors) or 'none'} of {'+'.join(have.tensors)}")
    if have.topk != spec.topk:
        parts.append(f"top-{spec.topk} of top-{have.topk}" if spec.topk else f"no top-k (it has {have.topk})")
    return ", ".join(parts) or "the same content"
