"""`CacheReader`: batches for stage 1 (per-layer tensors) and stage 2 (tokens, top-k) from a cache directory.

- Every shard's size and sha256 are checked against the manifest before its first use in this
  process; a mismatch raises `CacheCorruptError` naming the shard (nothing from it is returned).
- Only the requested members are read (a worker training layers {i} reads those layers only).
- Sample order: shards in a seeded permutation, samples within a shard permuted, per epoch; the
  list is cut to a multiple of `world_size x batch_size` and rank r takes every world_size-th sample
  from r, so all ranks get the same number of batches. A loader over fewer rows than one batch per
  rank is refused (`CacheError`): its epochs would all be empty. Inside a torch DataLoader worker the
  batches are further dealt round-robin to the loader workers.
- Resumable: `loader.state_dict()` / `load_state_dict()` (epoch and batches consumed), or `start=`.
- Never unpickles: every member goes through `format.load_npy` (plain numeric arrays only).
"""

from __future__ import annotations

import tarfile
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

from hmscale.teacher.cache.format import (
    BUILDERS,
    CacheCorruptError,
    CacheError,
    CaptureSpec,
    decode,
    layer_field,
    load_npy,
)
from hmscale.teacher.cache.manifest import Manifest
from hmscale.teacher.cache.writer import sha256_file


class CacheReader:
    def __init__(self, path, *, shards=None, verify: bool = True, allow_incomplete: bool = False, max_open_shards: int = 4):
        """``shards``: read only these shard ids (a run reads the shards its own budget asked for, however many more an
        earlier run with the same capture added: ``run_shard_ids``); all of them must be there."""
        self.dir = Path(path)
        self.manifest = Manifest.load(self.dir)
        m = self.manifest.data
        self._entries = self.manifest.shards  # sid -> entry
        if shards is not None:
            missing = sorted(set(int(s) for s in shards) - set(self._entries))
            if missing:
                raise CacheError(f"cache {self.dir} lacks {len(missing)} of the run's shards (e.g. shard {missing[0]}); "
                                 f"finish it with {BUILDERS} (same config)")
            self._entries = {int(s): self._entries[int(s)] for s in shards}
        elif not self.manifest.complete and not allow_incomplete:
            raise CacheError(
                f"cache {self.dir} is incomplete ({len(m['shards'])}/{len(m['requested_shards'])} shards); "
                f"finish it with {BUILDERS} (same config) or pass allow_incomplete=True"
            )
        self.spec = CaptureSpec.from_json(m["capture"])
        self.fields = m["layout"]["fields"]
        self.seq_len = int(m["layout"]["seq_len"])
        self.teacher = m["teacher"]
        self.verify = verify
        self.shard_ids = sorted(self._entries)
        self._counts = {s: int(self._entries[s]["samples"]) for s in self.shard_ids}
        self._verified: set[int] = set()
        self._index: OrderedDict[int, dict] = OrderedDict()
        self._max_open = max_open_shards

    # ------------------------------------------------------------------ facts

    @property
    def layers(self) -> tuple[int, ...]:
        return self.spec.layers

    @property
    def num_samples(self) -> int:
        return sum(self._counts.values())

    def __len__(self) -> int:
        return self.num_samples

    # ------------------------------------------------------------------ shard access

    def _shard_path(self, sid: int) -> Path:
        return self.manifest.shard_path(sid)  # (a view's shards lie in its source, but for those computed for it)

    def _where(self, sid: int):
        """Where a bad shard lies, for the errors: a view's shards are its source's, but for its own."""
        path = self._shard_path(sid).parent
        return f"{path} (read through the view {self.dir})" if self.manifest.view_of and path != self.dir else self.dir

    def verify_shard(self, sid: int) -> None:
        """Size and sha256 against the manifest; raises CacheCorruptError naming the shard."""
        if sid in self._verified:
            return
        entry, path = self._entries[sid], self._shard_path(sid)
        if path.is_symlink():  # the writer renames regular files into place: never read through a link
            raise CacheCorruptError(entry["file"], "the file is a symbolic link, not a shard the cache wrote", self._where(sid))
        if not path.exists():
            raise CacheCorruptError(entry["file"], "the file is missing", self._where(sid))
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise CacheCorruptError(entry["file"], f"{size} bytes on disk, the manifest says {entry['bytes']} (truncated?)", self._where(sid))
        if self.verify:
            got = sha256_file(path)
            if got != entry["sha256"]:
                raise CacheCorruptError(entry["file"], f"sha256 {got[:16]}... does not match the manifest's {entry['sha256'][:16]}...", self._where(sid))
        self._verified.add(sid)

    def _shard_index(self, sid: int) -> dict:
        """{member name: (data offset, size)} of a verified shard (a small LRU of open shards)."""
        if sid in self._index:
            self._index.move_to_end(sid)
            return self._index[sid]
        self.verify_shard(sid)
        name = self._entries[sid]["file"]
        try:
            with tarfile.open(self._shard_path(sid), mode="r:") as tf:
                members = tf.getmembers()
        except tarfile.TarError as err:
            raise CacheCorruptError(name, f"not a readable tar ({err})", self._where(sid)) from None
        index = {}
        for ti in members:  # regular .npy members only, each once (a second copy would silently replace the first)
            if not ti.isfile():
                raise CacheCorruptError(name, f"member {ti.name!r} is not a regular file", self._where(sid))
            if ti.name in index:
                raise CacheCorruptError(name, f"member {ti.name!r} appears twice", self._where(sid))
            index[ti.name] = (ti.offset_data, ti.size)
        # in the tar's order, which is the plan's row order (a sort by name would put row 10000 before row 9999 once
        # a shard holds that many rows: the keys' row number has 4 digits)
        keys = list(dict.fromkeys(n.split(".", 1)[0] for n in index))
        if len(keys) != self._counts[sid]:
            raise CacheCorruptError(name, f"{len(keys)} samples, the manifest says {self._counts[sid]}", self._where(sid))
        self._index[sid] = {"members": index, "keys": keys}
        while len(self._index) > self._max_open:
            self._index.popitem(last=False)
        return self._index[sid]

    def _read(self, sid: int, key: str, field: str) -> np.ndarray:
        idx = self._shard_index(sid)
        name = self._entries[sid]["file"]
        member = f"{key}.{field}.npy"
        if member not in idx["members"]:
            raise CacheCorruptError(name, f"sample {key} has no {field}", self._where(sid))
        off, size = idx["members"][member]
        with open(self._shard_path(sid), "rb") as f:
            f.seek(off)
            data = f.read(size)
        try:
            arr = load_npy(data)
        except ValueError as err:
            raise CacheCorruptError(name, f"{member} is not a plain .npy array ({err})", self._where(sid)) from None
        spec = self.manifest.shard_fields(sid)[field]  # (a view's own shards: its capture's shapes, not the source's)
        if list(arr.shape) != spec["shape"] or arr.dtype != np.dtype(spec["npy_dtype"]):
            raise CacheCorruptError(
                name, f"{member} has shape {list(arr.shape)} {arr.dtype}, expected {spec['shape']} {spec['npy_dtype']}", self._where(sid)
            )
        return arr

    def _tensor(self, sid, key, field, dtype=None) -> torch.Tensor:
        arr = self._read(sid, key, field)
        storage = self.manifest.shard_fields(sid)[field]["storage"]
        scale = self._read(sid, key, field + "_scale") if storage == "fp8_e4m3" else None
        return decode(arr, storage, scale, dtype)

    # ------------------------------------------------------------------ samples

    def sample(self, sid: int, j: int, *, layers=None, tensors=None, topk: bool = False, dtype=None) -> dict:
        """One sample: tokens, seq_idx, positions; `layers` -> {i: {tensor: ...}}; topk when asked."""
        key = self._shard_index(sid)["keys"][j]
        out = {"key": key, "tokens": torch.from_numpy(self._read(sid, key, "tokens")).long(),
               "seq_idx": torch.from_numpy(self._read(sid, key, "seq_idx"))}
        if "positions" in self.fields:
            out["positions"] = torch.from_numpy(self._read(sid, key, "positions")).long()
        else:
            out["positions"] = torch.arange(self.seq_len)
        if layers:
            tensors = tuple(tensors or self.spec.tensors)
            missing = [i for i in layers if i not in self.spec.layers]
            if missing:
                raise CacheError(f"cache {self.dir} holds layers {list(self.spec.layers)}, not {missing}")
            missing = [t for t in tensors if t not in self.spec.tensors]  # (a view's source may hold more: not read)
            if missing:
                raise CacheError(f"cache {self.dir} holds tensors {list(self.spec.tensors)}, not {missing}")
            out["layers"] = {i: {t: self._tensor(sid, key, layer_field(i, t), dtype) for t in tensors} for i in layers}
        if topk:
            if not self.spec.topk:
                raise CacheError(f"cache {self.dir} has no top-k log-probs; build one with cache.capture.topk=K")
            k = self.spec.topk  # a view may read the first k of a source's larger top-k (sorted, largest first)
            out["topk_logprobs"] = decode(self._read(sid, key, "topk_logprobs")[..., :k], self.spec.topk_dtype).float()
            out["topk_indices"] = torch.from_numpy(self._read(sid, key, "topk_indices")[..., :k].astype(np.int64))
        return out

    def order(self, seed: int = 0, epoch: int = 0, shuffle: bool = True) -> list[tuple[int, int]]:
        """Every (shard, sample) in the epoch's deterministic order."""
        if not shuffle:
            return [(s, j) for s in self.shard_ids for j in range(self._counts[s])]
        rng = np.random.default_rng([int(seed), int(epoch)])
        out = []
        for s in rng.permutation(self.shard_ids).tolist():
            out += [(s, int(j)) for j in rng.permutation(self._counts[s])]
        return out

    def loader(self, batch_size: int, *, kind: str = "stage1", layers=None, tensors=None, rank: int = 0,
               world_size: int = 1, seed: int = 0, shuffle: bool = True, epoch: int = 0, start: int = 0,
               dtype=None) -> "CacheLoader":
        if kind not in ("stage1", "stage2"):
            raise ValueError(f"kind {kind!r}: choose 'stage1' or 'stage2'")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range for world_size {world_size}")
        if int(batch_size) < 1:
            raise ValueError(f"batch_size {batch_size}: must be at least 1")
        if self.num_samples < world_size * int(batch_size):  # (every rank's epoch would be empty, forever)
            raise CacheError(f"cache {self.dir} holds {self.num_samples} rows over {len(self.shard_ids)} shard(s), fewer "
                             f"than one batch per rank (world_size {world_size} x batch_size {batch_size}): no rank "
                             "would get a batch; use a smaller batch, fewer workers or more shards (cache.max_tokens)")
        nb = self.num_samples // (world_size * int(batch_size))  # batches per rank and epoch
        if not 0 <= int(start) <= nb:  # (a negative start read the epoch's tail as its head, then failed)
            raise ValueError(f"start {start}: the batches consumed in the epoch, from 0 to its {nb} batches per rank")
        return CacheLoader(self, batch_size, kind=kind, layers=layers, tensors=tensors, rank=rank, world_size=world_size,
                           seed=seed, shuffle=shuffle, epoch=epoch, start=start, dtype=dtype)

    def stage1_batches(self, layers, batch_size: int, **kw) -> "CacheLoader":
        """Batches with tokens, seq_idx, positions and, per layer in `layers`, its cached tensors."""
        return self.loader(batch_size, kind="stage1", layers=list(layers), **kw)

    def stage2_batches(self, batch_size: int, **kw) -> "CacheLoader":
        """Batches with tokens, seq_idx and (when cached) the teacher's top-k log-probs."""
        return self.loader(batch_size, kind="stage2", **kw)


def _collate(samples: list[dict]) -> dict:
    out = {"keys": [s["key"] for s in samples]}
    for k in ("tokens", "seq_idx", "positions", "topk_logprobs", "topk_indices"):
        if k in samples[0]:
            out[k] = torch.stack([s[k] for s in samples])
    if "layers" in samples[0]:
        out["layers"] = {i: {t: torch.stack([s["layers"][i][t] for s in samples]) for t in samples[0]["layers"][i]}
                         for i in samples[0]["layers"]}
    return out


class CacheLoader(torch.utils.data.IterableDataset):
    """An iterable of batches for one rank; iterating runs the rest of the current epoch, then moves to the next.

    A torch `IterableDataset` of whole batches: `DataLoader(loader, batch_size=None, num_workers=n)`
    deals the batches round-robin to the n loader processes. Their copies of the loader advance, not this one: call
    `set_epoch(e)` before each pass over such a DataLoader (else every pass is this loader's current epoch again),
    and resume with `set_epoch(e, start)` (or `start=`), as its state_dict is then the workers'.
    """

    def __init__(self, reader: CacheReader, batch_size: int, *, kind, layers, tensors, rank, world_size, seed, shuffle,
                 epoch, start, dtype):
        self.reader, self.batch_size, self.kind = reader, int(batch_size), kind
        self.layers = list(layers) if layers is not None else (list(reader.layers) if kind == "stage1" else [])
        self.tensors, self.rank, self.world_size = tensors, rank, world_size
        self.seed, self.shuffle, self.dtype = seed, shuffle, dtype
        self.epoch, self.position = int(epoch), int(start)  # position: batches consumed in this epoch

    def _mine(self, epoch: int) -> list[tuple[int, int]]:
        """This rank's samples of the epoch: the first ``used`` of the order (every rank the same number of whole
        batches), dealt round-robin. Without shuffling, epoch e starts where epoch e - 1 stopped, so the samples an
        epoch leaves over are the next epoch's first (a fixed order would otherwise never reach its tail)."""
        order = self.reader.order(self.seed, epoch, self.shuffle)
        per_step = self.world_size * self.batch_size
        used = len(order) // per_step * per_step
        if not self.shuffle and used:
            k = epoch * used % len(order)
            order = order[k:] + order[:k]
        return order[:used][self.rank :: self.world_size]

    def __len__(self) -> int:
        return (self.reader.num_samples // self.world_size) // self.batch_size

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """The next pass reads epoch ``epoch`` from its ``start``-th batch (DataLoader workers: before each pass)."""
        if int(epoch) < 0 or not 0 <= int(start) <= len(self):
            raise ValueError(f"set_epoch({epoch}, {start}): epoch >= 0 and 0 <= start <= {len(self)} batches per epoch")
        self.epoch, self.position = int(epoch), int(start)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "rank": self.rank,
                "world_size": self.world_size, "batch_size": self.batch_size}

    def load_state_dict(self, state: dict) -> None:
        for k in ("seed", "world_size", "batch_size"):
            if k in state and state[k] != getattr(self, k):
                raise ValueError(f"loader state has {k}={state[k]}, this loader {k}={getattr(self, k)}; resume with the same setting")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])

    def __iter__(self):
        mine = self._mine(self.epoch)
        nb = len(mine) // self.batch_size
        if nb and self.position >= nb:  # every batch of the epoch consumed (a state saved after its last batch): the
            self.epoch, self.position = self.epoch + 1, 0  # next ones are the next epoch's, as they are uninterrupted
            mine = self._mine(self.epoch)
        winfo = torch.utils.data.get_worker_info()
        start = self.position
        for b in range(start, nb):
            # dealt from the resume point: the DataLoader takes one batch from each worker in turn, from worker 0, so
            # worker w holds the (start + w)-th, ... batches whatever the start and the number of workers
            if winfo is not None and (b - start) % winfo.num_workers != winfo.id:
                continue
            chunk = mine[b * self.batch_size : (b + 1) * self.batch_size]
            samples = [
                self.reader.sample(s, j, layers=self.layers if self.kind == "stage1" else None, tensors=self.tensors,
                                   topk=self.kind == "stage2" and bool(self.reader.spec.topk), dtype=self.dtype)
                for s, j in chunk
            ]
            self.position = b + 1
            yield _collate(samples)
        self.epoch += 1
        self.position = 0
