"""`verify_cache(dir)`: every shard's size, sha256, tar structure, member dtypes and shapes, sample keys."""

from __future__ import annotations

import os
import tarfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hmscale.teacher.cache.format import BUILDERS, MANIFEST, SHARD_FILE, CacheError, load_npy
from hmscale.teacher.cache.manifest import Manifest
from hmscale.teacher.cache.writer import sha256_file



@dataclass
class VerifyReport:
    cache_dir: Path
    shards_ok: list[str] = field(default_factory=list)
    bad: dict[str, str] = field(default_factory=dict)  # shard file -> reason
    problems: list[str] = field(default_factory=list)  # cache-level problems
    # a view's shards: shard file -> where it lies ("in DIR, the view's own" / "in DIR, read through this view"), so a
    # bad one is looked for in the right directory (its source's, unless computed for the view)
    where: dict[str, str] = field(default_factory=dict)
    samples: int = 0
    bytes: int = 0

    @property
    def ok(self) -> bool:
        return not self.bad and not self.problems

    def summary(self) -> str:
        if self.ok:
            return f"ok: {self.cache_dir}: {len(self.shards_ok)} shards, {self.samples:,} samples, {self.bytes:,} bytes verified"
        lines = [f"FAILED: {self.cache_dir}: {len(self.bad)} bad shard(s), {len(self.problems)} other problem(s)"]
        lines += [f"  bad shard {name}{f' ({self.where[name]})' if name in self.where else ''}: {why}"
                  for name, why in sorted(self.bad.items())]
        lines += [f"  {p}" for p in self.problems]
        return "\n".join(lines)


def _check_shard(path: Path, entry: dict, fields: dict) -> tuple[str | None, list[str]]:
    if path.is_symlink():  # the writer renames regular files into place: a link points wherever someone chose
        return "the file is a symbolic link, not a shard the cache wrote (it would be read from outside the cache)", []
    if not path.exists():
        return "the file is missing", []
    if not path.is_file():
        return "not a regular file", []
    size = path.stat().st_size
    if size != entry["bytes"]:
        return f"{size} bytes on disk, the manifest says {entry['bytes']} (truncated or appended)", []
    got = sha256_file(path)
    if got != entry["sha256"]:
        return f"sha256 {got} does not match the manifest's {entry['sha256']}", []
    seen: dict[str, set] = {}
    try:
        with tarfile.open(path, mode="r:") as tf:
            for ti in tf:
                if not ti.isfile():
                    return f"member {ti.name!r} is not a regular file", []
                key, _, rest = ti.name.partition(".")
                if not rest.endswith(".npy"):
                    return f"member {ti.name!r} is not a .npy array", []
                fname = rest[: -len(".npy")]
                if fname not in fields:
                    return f"member {ti.name!r}: unknown field {fname!r}", []
                try:
                    arr = load_npy(tf.extractfile(ti).read())
                except ValueError as err:
                    return f"member {ti.name!r} is not a plain .npy array ({err})", []
                spec = fields[fname]
                if list(arr.shape) != spec["shape"] or arr.dtype != np.dtype(spec["npy_dtype"]):
                    return (f"member {ti.name!r} has shape {list(arr.shape)} {arr.dtype}, "
                            f"expected {spec['shape']} {spec['npy_dtype']}"), []
                if fname in seen.get(key, ()):  # a reader would take one of the two and never see the other
                    return f"member {ti.name!r} appears twice", []
                seen.setdefault(key, set()).add(fname)
    except (tarfile.TarError, OSError, EOFError) as err:
        return f"not a readable tar ({err})", []
    for key, got_fields in seen.items():
        if got_fields != set(fields):
            return f"sample {key} lacks {sorted(set(fields) - got_fields)}", []
    if len(seen) != entry["samples"]:
        return f"{len(seen)} samples, the manifest says {entry['samples']}", []
    return None, sorted(seen)


def check_shard_file(path: Path, entry: dict, fields: dict) -> tuple[str | None, list[str]]:
    """One shard file against a manifest entry (size, sha256, samples) and the fields it should hold: (what is wrong
    or None, its sample keys sorted). The check `verify_cache` runs on each shard; a build runs it on a finished shard
    its manifest lacks before recording it."""
    return _check_shard(path, entry, fields)


def verify_cache(path, threads: int | None = None) -> VerifyReport:
    """Check a cache directory; never raises for a bad shard (see `report.ok`, `report.bad`).

    Shards are checked by up to `threads` threads (default: the cores, at most 8)."""
    path = Path(path)
    report = VerifyReport(path)
    try:
        manifest = Manifest.load(path)
    except CacheError as err:
        report.problems.append(str(err))
        return report
    entries = manifest.shards
    owner: dict[str, str] = {}
    sids = sorted(entries)
    # shards are checked concurrently (sha256 and file reads release the GIL), reported in shard order
    workers = max(1, min(threads or min(8, os.cpu_count() or 1), len(sids) or 1))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="cache-verify") as ex:
        # each shard where it lies, against the fields it holds (a view's: its source's, or its own capture's for the
        # shards computed for it)
        results = list(ex.map(lambda s: _check_shard(manifest.shard_path(s), entries[s], manifest.shard_fields(s)), sids))
    if manifest.view_of:
        report.where = {entries[s]["file"]: (f"in {manifest.shard_path(s).parent}, the view's own" if entries[s].get("own")
                                             else f"in {manifest.shard_path(s).parent}, read through this view")
                        for s in sids}
    for sid, (reason, keys) in zip(sids, results):
        entry = entries[sid]
        if reason:
            report.bad[entry["file"]] = reason
            continue
        dup = [k for k in keys if k in owner]
        if dup:
            report.bad[entry["file"]] = f"sample {dup[0]} also in {owner[dup[0]]} (duplicated)"
            continue
        owner.update({k: entry["file"] for k in keys})
        report.shards_ok.append(entry["file"])
        report.samples += len(keys)
        report.bytes += entry["bytes"]
    missing = [s for s in manifest.data.get("requested_shards", []) if s not in entries]
    if missing:
        report.problems.append(f"{len(missing)} requested shard(s) not built yet (e.g. shard {missing[0]}); "
                               f"rerun {BUILDERS} (same config)")
    here = {e["file"] for e in entries.values() if e.get("own") or not manifest.view_of}  # (a view's others: the source's)
    for p in sorted(path.iterdir()):
        if p.name == MANIFEST or p.name.startswith("."):  # hidden: temporaries of shards and manifests being written
            continue
        if SHARD_FILE.match(p.name):
            if p.name not in here:
                report.problems.append(f"{p.name} is not in the manifest (stray shard)")
        else:
            report.problems.append(f"{p.name} is not part of the cache (a cache directory holds {MANIFEST} and "
                                   "shard-NNNNNN.tar files only); move it elsewhere")
    return report
