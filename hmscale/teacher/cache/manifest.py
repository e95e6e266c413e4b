"""`manifest.json`: what a cache directory holds, written only by the driver, always atomically."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

from hmscale.atomic import atomic_write_json
from hmscale.teacher.cache.format import (
    BUILDERS,
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST,
    STORAGE_DTYPES,
    TENSORS,
    CacheError,
    CaptureSpec,
    ShardInfo,
    TeacherShape,
    layer_field,
    layout,
    layout_json,
    shard_name,
)

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_DIR_NAME = re.compile(r"^[A-Za-z0-9_\-][A-Za-z0-9_.\-]*$")  # a sibling directory's plain name (no path)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _is_count(x) -> bool:
    """A non-negative JSON integer (``true`` is not one)."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _shard_problem(k, entry, seq_len: int | None = None) -> str | None:
    """What is wrong with one ``shards`` entry, or None."""
    if not (isinstance(k, str) and k.isdigit() and k == str(int(k))):  # ("00" would name shard 0 a second time)
        return f"shards: key {k!r} is not a shard number"
    if not isinstance(entry, dict):
        return f"shards[{k}] is not an object"
    if entry.get("file") != shard_name(int(k)):
        return f"shards[{k}].file is {entry.get('file')!r}, not {shard_name(int(k))!r}"
    if not (isinstance(entry.get("sha256"), str) and _HEX64.match(entry["sha256"])):
        return f"shards[{k}].sha256 is not 64 lowercase hex digits"
    bad = [f for f in ("bytes", "samples", "tokens") if not _is_count(entry.get(f))]
    if bad:
        return f"shards[{k}].{bad[0]} is {entry.get(bad[0])!r}, not a non-negative integer"
    if seq_len is not None and entry["tokens"] != entry["samples"] * seq_len:
        return f"shards[{k}].tokens is {entry['tokens']}, not its {entry['samples']} samples x {seq_len} tokens"
    return None


def _layout_problem(layout) -> str | None:
    """What is wrong with ``layout`` (the shapes every reader checks members against), or None."""
    if not isinstance(layout, dict) or not isinstance(layout.get("fields"), dict) or not _is_count(layout.get("seq_len")):
        return "layout needs 'fields' (an object) and 'seq_len' (an integer)"
    for name, f in layout["fields"].items():
        if not (isinstance(f, dict) and isinstance(f.get("npy_dtype"), str) and isinstance(f.get("storage"), str)
                and isinstance(f.get("shape"), list) and all(_is_count(n) for n in f["shape"])):
            return f"layout.fields.{name} needs npy_dtype, storage and shape (a list of integers)"
    return None


def structure_problem(data: dict) -> str | None:
    """The first thing in a manifest's structure that no reader can use (a hand edit, a damaged file), or None."""
    for name in ("teacher", "plan", "capture", "layout", "shards"):
        if not isinstance(data.get(name), dict):
            return f"'{name}' is missing or not an object"
    if not isinstance(data.get("key"), str):
        return "'key' is missing or not a string"
    plan = data["plan"]
    if not (isinstance(plan.get("hash"), str) and all(_is_count(plan.get(f)) for f in ("num_shards", "seq_len", "sequences_per_shard"))):
        return "plan needs hash, num_shards, seq_len and sequences_per_shard"
    try:
        spec = CaptureSpec.from_json(data["capture"])
    except (KeyError, TypeError, ValueError) as err:
        return f"capture is not a capture spec ({type(err).__name__}: {err})"
    if not (all(_is_count(i) for i in spec.layers) and set(spec.tensors) <= set(TENSORS) and _is_count(spec.topk)):
        return "capture needs layers (integers), tensors (of attn_input, attn_output) and topk (an integer)"
    req = data.get("requested_shards", [])
    if not (isinstance(req, list) and all(_is_count(s) for s in req)):
        return "requested_shards is not a list of shard numbers"
    view = data.get("view_of")
    if view is not None and not (isinstance(view, str) and _DIR_NAME.match(view) and view not in (".", "..")):
        return f"view_of {view!r} is not the name of a sibling cache directory"
    return (_layout_problem(data["layout"]) or _fields_problem(spec, data["layout"]["fields"])
            or _stored_problem(data, spec) or _own_problem(data, spec)
            or next((p for p in (_shard_problem(k, e, data["layout"]["seq_len"]) for k, e in data["shards"].items())
                     if p), None))


def _own_problem(data: dict, spec: CaptureSpec) -> str | None:
    """A view's own shards (``"own": true``: computed for the view, in its directory, at its own capture) and their
    ``own_layout`` (exactly what a cache built for the view's capture stores), or what is wrong with them."""
    own = [k for k, e in data["shards"].items() if isinstance(e, dict) and "own" in e]
    if own and data["shards"][own[0]]["own"] is not True:
        return f"shards[{own[0]}].own is {data['shards'][own[0]]['own']!r}, not true"
    if (own or "own_layout" in data) and data.get("view_of") is None:
        return "own_layout / shards[].own belong to a view (view_of), and this manifest is not one"
    if "own_layout" not in data:
        return f"shards[{own[0]}] is the view's own, but the manifest has no own_layout" if own else None
    problem = (_layout_problem(data["own_layout"]) or _fields_problem(spec, data["own_layout"]["fields"])
               or _stored_problem({**data, "layout": data["own_layout"], "view_of": None}, spec))
    return f"own_layout: {problem}" if problem else None


_LAYER_FIELD = re.compile(r"^l(\d{3})_(attn_input|attn_output)$")
_TOPK_DTYPES = ("float16", "bfloat16")


def _stored_problem(data: dict, spec: CaptureSpec) -> str | None:
    """Whether ``layout.fields`` is exactly what the format stores for some capture over this teacher and plan, and
    holds what ``capture`` reads (the spec itself for a cache, a covered request for a view), or what is not.

    Readers decode every member by its field's ``storage`` and build positions from ``seq_len``: a hand-edited
    storage would hand the bits back as integers, another seq_len wrong positions, without a word."""
    layout_d, fields = data["layout"], data["layout"]["fields"]
    L = layout_d["seq_len"]
    if data["plan"]["seq_len"] != L:
        return f"layout.seq_len {L} is not plan.seq_len {data['plan']['seq_len']}"
    if spec.dtype not in STORAGE_DTYPES or spec.topk_dtype not in _TOPK_DTYPES:
        return (f"capture.dtype {spec.dtype!r} / topk_dtype {spec.topk_dtype!r} is not one of "
                f"{', '.join(STORAGE_DTYPES)} / {', '.join(_TOPK_DTYPES)}")
    tf = spec.token_fraction
    if isinstance(tf, bool) or not isinstance(tf, (int, float)) or not 0 < tf <= 1 or not isinstance(spec.seed, int):
        return f"capture.token_fraction {tf!r} is not in (0, 1] (or seed {spec.seed!r} not an integer)"
    t = data["teacher"]
    dims = [t.get(f) for f in ("n_layers", "d_model", "n_heads", "vocab_size")]
    if not all(_is_count(x) and x > 0 for x in dims) or dims[1] % dims[2]:
        return "teacher needs n_layers, d_model, n_heads (dividing d_model) and vocab_size (positive integers)"
    shape = TeacherShape(*dims)
    if any(i >= shape.n_layers for i in spec.layers):
        return f"capture.layers {list(spec.layers)} lie outside the teacher's {shape.n_layers} layers"
    # the capture the fields store: its layers and tensors from the field names, its dtypes from the fields
    found = [m.groups() for m in map(_LAYER_FIELD.match, fields) if m]
    stored_dtype = next((fields[layer_field(int(i), n)]["storage"] for i, n in found), spec.dtype)
    topk = fields.get("topk_logprobs")
    try:
        stored = CaptureSpec(layers=tuple(sorted({int(i) for i, _ in found})),
                             tensors=tuple(n for n in TENSORS if any(n == m for _, m in found)),
                             dtype=stored_dtype, token_fraction=tf, seed=spec.seed,
                             topk=topk["shape"][-1] if topk and topk["shape"] else 0,
                             topk_dtype=topk["storage"] if topk else spec.topk_dtype)
        if stored.dtype not in STORAGE_DTYPES or stored.topk_dtype not in _TOPK_DTYPES:
            raise ValueError(f"storage {stored.dtype!r} / {stored.topk_dtype!r}")
        expected = layout_json(layout(stored, shape, L))
    except (KeyError, TypeError, ValueError) as err:
        return f"layout.fields do not describe a stored capture ({err})"
    if fields != expected:
        bad = sorted(set(fields) ^ set(expected)) or sorted(k for k in fields if fields[k] != expected[k])
        want = expected.get(bad[0], "no such field")
        return f"layout.fields.{bad[0]} is {fields.get(bad[0], 'missing')}, the format stores {want} there"
    if layout_d.get("kept_positions", spec.kept_positions(L)) != spec.kept_positions(L):
        return f"layout.kept_positions is {layout_d['kept_positions']}, capture keeps {spec.kept_positions(L)}"
    if data.get("view_of") is None:
        # (no layer tensor is stored when either list is empty: no layers, or no tensors of them)
        held = (spec.layers, spec.tensors) if spec.stores_layers else ((), ())
        same = (stored.layers, stored.tensors, stored.topk) == (*held, spec.topk)
        if (not same or (spec.stores_layers and stored.dtype != spec.dtype)
                or (spec.topk and stored.topk_dtype != spec.topk_dtype)):
            return "layout.fields do not hold what capture says this cache stores"
    elif (spec.stores_layers and stored.dtype != spec.dtype) or (spec.topk and (stored.topk < spec.topk
                                                                                or stored.topk_dtype != spec.topk_dtype)):
        return "layout.fields (the source's) do not hold what the view's capture reads"
    return None


def _fields_problem(spec: CaptureSpec, fields: dict) -> str | None:
    """A field the capture spec reads that the layout does not describe, or None."""
    need = ["tokens", "seq_idx", *(layer_field(i, t) for i in spec.layers for t in spec.tensors)]
    need += ["topk_logprobs", "topk_indices"] if spec.topk else []
    missing = [f for f in need if f not in fields]
    return f"layout.fields lacks {missing[0]!r}, which the capture spec holds" if missing else None


def source_dir(cache_dir, view_of: str) -> Path:
    """The directory of a view's source: its sibling ``view_of`` under the cache root the view is reached through (a
    view directory moved to another disk and linked back into the root reads its source there, not beside the link's
    target), else beside the directory itself (also when named `.` or `x/..`, whose lexical parent is not the root)."""
    roots = [Path(os.path.abspath(cache_dir)).parent, Path(cache_dir).resolve().parent]
    return next((r / view_of for r in roots if (r / view_of).is_dir()), roots[0] / view_of)


class Manifest:
    def __init__(self, data: dict, path: Path):
        self.data = data
        self.path = Path(path)
        self._dropped: set[int] = set()  # shards this process found bad: never taken back from the file on save

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
        if not Path(cache_dir).is_dir():  # (a mistyped path is not "a directory without a manifest")
            raise CacheError(f"{cache_dir} does not exist or is not a directory; name a cache directory "
                             "(`hmscale cache list ROOT` lists a root's caches)")
        if not path.exists():
            raise CacheError(f"{cache_dir} has no {MANIFEST}; it is not a teacher cache (build one with `hmscale cache CONFIG`)")
        try:
            data = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError) as err:
            raise CacheError(f"{path} is not valid JSON ({err}); rebuild the cache") from None
        except OSError as err:  # a directory by that name, no permission to read it
            raise CacheError(f"{path} cannot be read ({err.strerror or err}); fix its permissions or rebuild the cache") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
            raise CacheError(f"{path} is not a {FORMAT_NAME} manifest")
        if data.get("format_version") != FORMAT_VERSION:
            raise CacheError(
                f"{path} has format version {data.get('format_version')}, this hmscale reads version {FORMAT_VERSION}; rebuild the cache"
            )
        problem = structure_problem(data)
        if problem:
            raise CacheError(f"{path} is damaged or was edited by hand: {problem}; rebuild the cache "
                             f"({BUILDERS}, same config) or restore the file")
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
        """Where the shard files named in ``shards`` lie: this directory, or a view's source's (``source_dir``)."""
        return source_dir(self.cache_dir, self.view_of) if self.view_of else self.cache_dir

    @property
    def shards(self) -> dict[int, dict]:
        return {int(k): v for k, v in self.data["shards"].items()}

    def shard_path(self, shard: int) -> Path:
        """Where a recorded shard's file lies: ``files_dir``, except a view's own shards (computed for it, in its own
        directory: shards its source does not hold)."""
        entry = self.data["shards"][str(shard)]
        return (self.cache_dir if entry.get("own") else self.files_dir) / entry["file"]

    def shard_fields(self, shard: int) -> dict:
        """The fields (``layout.fields`` form) a recorded shard's file holds: ``layout``'s (for a view, its source's),
        or ``own_layout``'s for a view's own shards (what a cache built for the view's capture holds)."""
        own = self.data["shards"][str(shard)].get("own")
        return self.data["own_layout" if own else "layout"]["fields"]

    def own_counts(self, shard_ids) -> tuple[int, int]:
        """(read from the source, the view's own) among the recorded ``shard_ids``."""
        entries = self.shards
        own = sum(1 for s in shard_ids if s in entries and entries[s].get("own"))
        return sum(1 for s in shard_ids if s in entries) - own, own

    @property
    def complete(self) -> bool:
        return bool(self.data.get("complete"))

    def add_shard(self, info: ShardInfo) -> None:
        """Record a shard written into this directory (for a view: one of its own, at its own capture)."""
        self.data["shards"][str(info.shard)] = {**info.manifest_entry(), **({"own": True} if self.view_of else {})}

    def drop_shard(self, shard: int) -> None:
        self.data["shards"].pop(str(shard), None)
        self._dropped.add(int(shard))

    def _merge_from_disk(self) -> None:
        """Take in the shards (and requests) another build of the same cache recorded in the file since this one read
        it: two builds sharing a cache directory each save their own progress without erasing the other's."""
        try:
            disk = Manifest.load(self.cache_dir)
        except CacheError:
            return
        if disk.data["key"] != self.data.get("key") or disk.view_of != self.view_of:
            return
        for sid, entry in disk.shards.items():
            if sid not in self.shards and sid not in self._dropped:
                self.data["shards"][str(sid)] = entry
        self.set_requested(disk.data.get("requested_shards", []))
        self.update_complete()

    def set_requested(self, shard_ids) -> None:
        self.data["requested_shards"] = sorted(set(self.data.get("requested_shards", [])) | set(int(s) for s in shard_ids))

    def update_complete(self) -> bool:
        done = set(self.shards)
        self.data["complete"] = all(s in done for s in self.data["requested_shards"])
        return self.data["complete"]

    def save(self) -> None:
        self._merge_from_disk()
        self.data["updated"] = _now()
        # the root it is written through (informative): for a cache later moved to another disk and linked back into
        # the root, `cache rm` given the moved directory finds the link there (and the root's views and lock)
        self.data["root"] = os.path.abspath(self.cache_dir.parent)
        self.data["shards"] = {str(k): self.data["shards"][str(k)] for k in sorted(self.shards)}
        atomic_write_json(self.path, self.data)
        try:
            self.path.chmod(0o644)
        except OSError:
            pass
