"""The teacher-cache format, version 1 (written down in docs/CACHE_FORMAT.md).

A cache directory `{cache.root}/{key}/` holds `manifest.json` and `shard-NNNNNN.tar` files
(webdataset tars, one per data-plan shard). Each sample is a group of `.npy` members
`{sample_key}.{field}.npy`, raw arrays only (`allow_pickle=False` on both sides).

This module is pure layout: field names, storage dtypes, encode/decode of tensors, expected
shapes, the directory key and the bytes-per-token estimate. It has no I/O besides bytes.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

FORMAT_NAME = "hmscale-teacher-cache"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TENSORS = ("attn_input", "attn_output")
STORAGE_DTYPES = ("bfloat16", "float32", "fp8_e4m3")
FP8_MAX = 448.0  # largest finite float8_e4m3fn
_KEY_RE = re.compile(r"^[A-Za-z0-9_\-/]+$")


# the advice of the one-line errors: a cache is built by `hmscale cache` alone or by `hmscale run` (the whole recipe,
# as `hmscale stage1` / `stage2` do) before its training; a rerun of either with the same config finishes the shards
# it lacks and rebuilds a damaged one (verified on every build), so it names both, not only the first
BUILDERS = "`hmscale cache` or `hmscale run`"


class CacheError(RuntimeError):
    """A cache problem; the message is one line naming the cache / shard and what to do."""


def failure_message(err: BaseException, where: str, cache_dir) -> str:
    """One line for a shard that failed: a file-system error (disk full, permissions) is named as writing the shard,
    not as the teacher's forward; either way the shards already written are kept for the rerun."""
    if isinstance(err, OSError):
        return (f"writing {where} into {cache_dir} failed: {err.strerror or err}; the shards written so far are kept: "
                "free space or fix the permissions (or set cache.root elsewhere), then rerun "
                f"{BUILDERS}, whichever was building it (same config)")
    return f"teacher forward failed on {where}: {type(err).__name__}: {err}"


class CacheCorruptError(CacheError):
    """A shard whose bytes, checksum or contents do not match the manifest."""

    def __init__(self, shard: str, reason: str, cache_dir=None):
        self.shard = shard
        self.reason = reason
        where = f" in {cache_dir}" if cache_dir is not None else ""
        super().__init__(
            f"cache shard {shard}{where} is corrupted: {reason}; do not train on it "
            f"(rerun {BUILDERS} with the same config to rebuild it, or delete it)"
        )


def shard_name(shard_id: int) -> str:
    return f"shard-{shard_id:06d}.tar"


SHARD_FILE = re.compile(r"^shard-\d{6}\.tar$")  # the names `shard_name` gives


def lock_path(cache_dir) -> Path:
    """The file a build of ``cache_dir`` holds locked: under the root's ``.locks/`` (a cache holds shards and its
    manifest only)."""
    cache_dir = Path(cache_dir)
    return cache_dir.parent / ".locks" / f"{cache_dir.name}.lock"


def layer_field(layer: int, tensor: str) -> str:
    return f"l{layer:03d}_{tensor}"


def check_sample_key(key: str) -> str:
    if not _KEY_RE.match(key):
        raise CacheError(f"sample key {key!r} from the data plan has characters a webdataset key cannot hold; use [A-Za-z0-9_-/]")
    return key


# ---------------------------------------------------------------------------------- spec


@dataclass(frozen=True)
class TeacherShape:
    n_layers: int
    d_model: int
    n_heads: int
    vocab_size: int

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @classmethod
    def of(cls, model) -> "TeacherShape":
        c = model.config
        return cls(c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.vocab_size)


@dataclass(frozen=True)
class CaptureSpec:
    """What is stored per sample; part of the directory key."""

    layers: tuple[int, ...]
    tensors: tuple[str, ...]
    dtype: str = "bfloat16"
    token_fraction: float = 1.0
    seed: int = 0
    topk: int = 0
    topk_dtype: str = "float16"

    @classmethod
    def from_config(cls, capture, n_layers: int) -> "CaptureSpec":
        layers = list(range(n_layers)) if capture.layers == "all" else sorted(set(int(i) for i in capture.layers))
        bad = [i for i in layers if not 0 <= i < n_layers]
        if bad:
            raise CacheError(f"cache.capture.layers: {bad} out of range for a {n_layers}-layer teacher; use 0..{n_layers - 1} or 'all'")
        return cls(
            layers=tuple(layers),
            tensors=tuple(t for t in TENSORS if t in capture.tensors),
            dtype=capture.dtype,
            token_fraction=float(capture.token_fraction),
            seed=int(capture.seed),
            topk=int(capture.topk),
            topk_dtype=capture.topk_dtype,
        )

    @classmethod
    def from_json(cls, d: dict) -> "CaptureSpec":
        return cls(**{**d, "layers": tuple(d["layers"]), "tensors": tuple(d["tensors"])})

    def to_json(self) -> dict:
        d = asdict(self)
        d["layers"], d["tensors"] = list(self.layers), list(self.tensors)
        return d

    @property
    def stores_layers(self) -> bool:
        """Whether any layer tensor is stored: some layers and some tensors (either list empty: none, top-k only)."""
        return bool(self.layers and self.tensors)

    def kept_positions(self, seq_len: int) -> int:
        return seq_len if self.token_fraction >= 1.0 else max(1, int(round(self.token_fraction * seq_len)))


def cache_key(teacher_fingerprint: str, plan_hash: str, spec: CaptureSpec) -> str:
    blob = json.dumps(
        {"format_version": FORMAT_VERSION, "teacher": teacher_fingerprint, "plan": plan_hash, "capture": spec.to_json()},
        sort_keys=True,
    )
    return f"v{FORMAT_VERSION}-{hashlib.sha256(blob.encode()).hexdigest()[:20]}"


def positions_for(spec: CaptureSpec, key: str, seq_len: int) -> np.ndarray | None:
    """The sorted positions whose attn_output is kept (None = all): a function of (seed, key) only."""
    if spec.token_fraction >= 1.0:
        return None
    m = spec.kept_positions(seq_len)
    rng = np.random.default_rng(np.random.SeedSequence([spec.seed, zlib.crc32(key.encode())]))
    return np.sort(rng.choice(seq_len, size=m, replace=False)).astype(np.int32)


# ---------------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class FieldSpec:
    npy_dtype: str  # numpy dtype string of the stored array
    shape: tuple[int, ...]
    storage: str  # logical dtype: int32, bfloat16, float32, fp8_e4m3, float16, uint16 ...


def index_dtype(vocab_size: int) -> str:
    return "<u2" if vocab_size <= 65536 else "<i4"


def layout(spec: CaptureSpec, shape: TeacherShape, seq_len: int) -> dict[str, FieldSpec]:
    """Every member of one sample: field name -> stored dtype and shape."""
    L, d, h, p = seq_len, shape.d_model, shape.n_heads, shape.head_dim
    m = spec.kept_positions(L)
    out = {"tokens": FieldSpec("<i4", (L,), "int32"), "seq_idx": FieldSpec("<i4", (L,), "int32")}
    if spec.token_fraction < 1.0:
        out["positions"] = FieldSpec("<i4", (m,), "int32")
    npy = {"bfloat16": "<u2", "float32": "<f4", "fp8_e4m3": "|u1"}[spec.dtype]
    for i in spec.layers:
        for t in spec.tensors:
            shp = (L, d) if t == "attn_input" else (m, h, p)
            name = layer_field(i, t)
            out[name] = FieldSpec(npy, shp, spec.dtype)
            if spec.dtype == "fp8_e4m3":
                out[name + "_scale"] = FieldSpec("<f4", shp[:-1], "float32")
    if spec.topk:
        out["topk_logprobs"] = FieldSpec("<u2" if spec.topk_dtype == "bfloat16" else "<f2", (L, spec.topk), spec.topk_dtype)
        out["topk_indices"] = FieldSpec(index_dtype(shape.vocab_size), (L, spec.topk), "index")
    return out


def layout_json(fields: dict[str, FieldSpec]) -> dict:
    return {k: {"npy_dtype": v.npy_dtype, "shape": list(v.shape), "storage": v.storage} for k, v in fields.items()}


_TAR_BLOCK = 512
_NPY_HEADER = 128


def bytes_per_sample(fields: dict[str, FieldSpec]) -> int:
    """Exact tar bytes of one sample (header block + npy header + data, padded to 512)."""
    total = 0
    for f in fields.values():
        data = _NPY_HEADER + int(np.prod(f.shape)) * np.dtype(f.npy_dtype).itemsize
        total += _TAR_BLOCK + -(-data // _TAR_BLOCK) * _TAR_BLOCK
    return total


# ---------------------------------------------------------------------------------- tensors


# the torch dtype that holds each storage's bits (bf16 bits as int16: numpy has no bfloat16), and its numpy view
STORAGE_TORCH = {"bfloat16": torch.int16, "float32": torch.float32, "fp8_e4m3": torch.uint8, "float16": torch.float16}
STORAGE_NUMPY = {"bfloat16": np.uint16, "float32": np.float32, "fp8_e4m3": np.uint8, "float16": np.float16}


def encode_tensor(x: torch.Tensor, storage: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A float tensor -> (its stored bits as a contiguous tensor of STORAGE_TORCH[storage], fp32 scales or None).

    Runs where `x` is (on the device for the cache worker: only the stored bytes cross to the host).
    """
    if storage == "bfloat16":
        return x.to(torch.bfloat16).contiguous().view(torch.int16), None
    if storage == "float32":
        return x.to(torch.float32).contiguous(), None
    if storage == "fp8_e4m3":
        x = x.to(torch.float32)
        scale = x.abs().amax(dim=-1, keepdim=True) / FP8_MAX
        # 1 for a row of zeros, and for one so small (subnormal) that its scale underflows to 0: 0/0 stored NaN there
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
        return q.contiguous(), scale[..., 0].contiguous()
    if storage == "float16":
        return x.to(torch.float16).contiguous(), None
    raise CacheError(f"unknown storage dtype {storage!r}; choose one of {', '.join(STORAGE_DTYPES)}")


def host_array(t: torch.Tensor, storage: str | None = None) -> np.ndarray:
    """A CPU tensor from `encode_tensor` -> the numpy array that is stored (a view, no copy)."""
    arr = t.numpy()
    return arr.view(STORAGE_NUMPY[storage]) if storage is not None else arr


def encode(x: torch.Tensor, storage: str) -> tuple[np.ndarray, np.ndarray | None]:
    """A float tensor -> (stored numpy array, per-row fp32 scales or None). CPU or device input."""
    q, scale = encode_tensor(x, storage)
    return host_array(q.cpu(), storage), (scale.cpu().numpy() if scale is not None else None)


def decode(arr: np.ndarray, storage: str, scale: np.ndarray | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Inverse of `encode`: bf16 -> torch.bfloat16 (bit-exact), fp8 -> dequantised float32, else as stored."""
    if storage == "bfloat16":
        t = torch.from_numpy(np.ascontiguousarray(arr).view(np.int16)).view(torch.bfloat16)
    elif storage == "fp8_e4m3":
        q = torch.from_numpy(np.ascontiguousarray(arr)).view(torch.float8_e4m3fn).to(torch.float32)
        t = q * torch.from_numpy(np.ascontiguousarray(scale))[..., None]
    else:
        t = torch.from_numpy(np.ascontiguousarray(arr))
    return t if dtype is None else t.to(dtype)


def npy_bytes(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, np.ascontiguousarray(arr), allow_pickle=False)
    return buf.getvalue()


_NPY_MAGIC = b"\x93NUMPY"
# the header numpy writes: a dict literal with these keys in this order, then space padding and a newline
_NPY_HEADER_RE = re.compile(r"\{'descr': '([<>|=]?[biuf][1-8])', 'fortran_order': (True|False), "
                         r"'shape': \((|\d+,|\d+(?:, \d+)+)\), \}[ ]*\n?")


def load_npy(data: bytes) -> np.ndarray:
    """Parse .npy bytes of a plain numeric array (a fresh, writable copy); anything else, an object array
    included, raises ValueError. The header is matched by a strict pattern rather than evaluated (numpy's
    own reader runs `ast.literal_eval` on it, which is not thread-safe in CPython 3.11: concurrent verify
    threads failed with "AST constructor recursion depth mismatch"); nothing in a shard is ever unpickled
    or parsed as Python."""
    mv = memoryview(data)
    if len(mv) < 10 or bytes(mv[:6]) != _NPY_MAGIC:
        raise ValueError("not a .npy array (no magic, or truncated)")
    major = mv[6]
    if major == 1:
        hlen, start = int.from_bytes(mv[8:10], "little"), 10
    elif major in (2, 3):
        if len(mv) < 12:
            raise ValueError("truncated .npy header")
        hlen, start = int.from_bytes(mv[8:12], "little"), 12
    else:
        raise ValueError(f"unknown .npy format version {major}")
    try:
        header = bytes(mv[start: start + hlen]).decode("latin1" if major < 3 else "utf8")
    except UnicodeDecodeError:
        raise ValueError("undecodable .npy header") from None
    m = _NPY_HEADER_RE.fullmatch(header)
    if m is None:
        raise ValueError(f"not a plain numeric .npy array (header {header.strip()[:80]!r})")
    dtype = np.dtype(m.group(1))
    shape = tuple(int(d) for d in m.group(3).replace(" ", "").split(",") if d)
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    body = mv[start + hlen:]
    if len(body) != count * dtype.itemsize:
        raise ValueError(f".npy body has {len(body)} bytes, the header says {count * dtype.itemsize}")
    arr = np.frombuffer(body, dtype=dtype, count=count).copy()
    return arr.reshape(shape, order="F" if m.group(2) == "True" else "C")


@dataclass
class ShardInfo:
    shard: int
    file: str
    sha256: str
    bytes: int
    samples: int
    tokens: int
    seconds: float = 0.0
    keys: list[str] = field(default_factory=list)
    stats: dict = field(default_factory=dict)  # where the worker's time went (seconds); not in the manifest

    def manifest_entry(self) -> dict:
        return {"file": self.file, "sha256": self.sha256, "bytes": self.bytes, "samples": self.samples, "tokens": self.tokens}


def human_bytes(n: float) -> str:
    """1.2 MB, 3.4 GB (powers of 1000)."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} TB"
