"""Deterministic, resumable batches for the student workers.

The data position is a pure function of the optimizer step: the micro batch `m` of step `s` on
data-parallel rank `r` holds the sequences at positions `((s * ga + m) * dp + r) * mb + j` of an
epoch-wise seeded permutation of the train sequences. A checkpoint therefore only needs the step
(and `samples_seen` is stored for humans), and any worker can rebuild any batch.

Sources:
- `ArraySource(tokens[, topk_ids, topk_logprobs])`  in-memory rows (tests, fixtures, benchmarks).
- `PlanSource(plan)`                                 rows of a `hmscale.data.ShardPlan` (lazy, random access).
- `CacheSource(reader)`                              rows (+ top-k teacher log-probs) of a teacher cache.
- `plan_rows(plan, shard_ids)`                       the plan's rows of some shards (a stage's, as a cache holds them).
- `SubsetSource(source, ids)`                        a fixed subset of another source's rows (stage 1's
                                                     token share, revisited for several epochs).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


class ArraySource:
    def __init__(self, tokens, topk_ids=None, topk_logprobs=None):
        self.tokens = np.asarray(tokens)
        self.topk_ids = None if topk_ids is None else np.asarray(topk_ids)
        self.topk_logprobs = None if topk_logprobs is None else np.asarray(topk_logprobs)

    @property
    def num_sequences(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.tokens.shape[1])

    @property
    def has_topk(self) -> bool:
        return self.topk_ids is not None

    def fetch(self, ids: np.ndarray) -> dict:
        out = {"input_ids": torch.from_numpy(self.tokens[ids].astype(np.int64))}
        if self.topk_ids is not None:
            out["topk_ids"] = torch.from_numpy(self.topk_ids[ids].astype(np.int64))
            out["topk_logprobs"] = torch.from_numpy(self.topk_logprobs[ids].astype(np.float32))
        return out


class PlanSource:
    """Rows of a ShardPlan, read one sequence at a time (memory-mapped streams stay on disk)."""

    def __init__(self, plan):
        self.plan = plan

    @property
    def num_sequences(self) -> int:
        return int(self.plan.num_sequences)

    @property
    def seq_len(self) -> int:
        return int(self.plan.seq_len)

    has_topk = False

    def fetch(self, ids: np.ndarray) -> dict:
        return {"input_ids": torch.from_numpy(self.plan.rows(ids)[0].astype(np.int64))}


class CacheSource:
    """Rows of a teacher cache (`hmscale.teacher.cache.CacheReader`), by global sample index.

    stage 2: tokens and (when captured) top-k teacher log-probs; stage 1: tokens, positions and the
    given layers' cached tensors (only those members are read).
    """

    def __init__(self, reader, *, layers=None, tensors=None, topk: bool | None = None):
        self.reader = reader
        self._flat = reader.order(shuffle=False)  # global index -> (shard, sample)
        self.layers = list(layers) if layers else None
        self.tensors = tuple(tensors) if tensors else None
        self.topk = bool(reader.spec.topk) if topk is None else bool(topk)

    @property
    def num_sequences(self) -> int:
        return len(self._flat)

    @property
    def seq_len(self) -> int:
        return int(self.reader.seq_len)

    @property
    def has_topk(self) -> bool:
        return bool(self.reader.spec.topk)

    def fetch(self, ids: np.ndarray) -> dict:
        samples = [self.reader.sample(*self._flat[int(i)], layers=self.layers, tensors=self.tensors,
                                      topk=self.topk and self.has_topk, dtype=torch.float32) for i in ids]
        out = {"input_ids": torch.stack([s["tokens"] for s in samples]).long(),
               "positions": torch.stack([s["positions"] for s in samples]).long()}
        if self.topk and self.has_topk:
            out["topk_ids"] = torch.stack([s["topk_indices"] for s in samples]).long()
            out["topk_logprobs"] = torch.stack([s["topk_logprobs"] for s in samples]).float()
        if self.layers:
            for i in self.layers:
                for t in samples[0]["layers"][i]:
                    out[f"layer{i}.{t}"] = torch.stack([s["layers"][i][t] for s in samples])
        return out


class SubsetSource:
    """The rows `ids` (indices into `source`) of another source, renumbered 0..len(ids)-1."""

    def __init__(self, source, ids):
        self.source = source
        self.ids = np.asarray(ids, dtype=np.int64)
        if self.ids.ndim != 1 or len(self.ids) == 0:
            raise ValueError("SubsetSource: ids must be a non-empty 1-d list of row indices")
        if self.ids.min() < 0 or self.ids.max() >= source.num_sequences:
            raise ValueError(f"SubsetSource: ids must lie in [0, {source.num_sequences})")

    @property
    def num_sequences(self) -> int:
        return int(len(self.ids))

    @property
    def seq_len(self) -> int:
        return self.source.seq_len

    @property
    def has_topk(self) -> bool:
        return self.source.has_topk

    def fetch(self, ids: np.ndarray) -> dict:
        return self.source.fetch(self.ids[np.asarray(ids, dtype=np.int64)])


def plan_rows(plan, shard_ids) -> "PlanSource | SubsetSource":
    """The rows of the plan's shards ``shard_ids`` (in shard order, then row order: a cache over the same shards
    lists them so, so a seed draws the same rows from either)."""
    src = PlanSource(plan)
    ids = sorted(int(i) for i in shard_ids)
    return SubsetSource(src, np.concatenate([plan.shard_rows(i) for i in ids]))


def token_share(source, tokens: int, seed: int) -> "SubsetSource | None":
    """The rows a one-pass run over `tokens` tokens of `source` would read first (the first positions of
    the epoch-0 permutation of `Sampler(source.num_sequences, seed)`), as a SubsetSource; None when that
    share is the whole source."""
    n = -(-int(tokens) // source.seq_len)  # ceil
    n = max(1, n)
    if n >= source.num_sequences:
        return None
    return SubsetSource(source, Sampler(source.num_sequences, seed=seed).ids(0, n))


@dataclass
class Sampler:
    """Seeded per-epoch permutation of `num_sequences`; position -> sequence id."""

    num_sequences: int
    seed: int = 0
    shuffle: bool = True

    def __post_init__(self):
        if self.num_sequences <= 0:
            raise ValueError("the training data has no sequences; give the data plan more text or a shorter seq_len")
        self._cache: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._cache:
            if len(self._cache) > 2:
                self._cache.clear()
            if self.shuffle:
                self._cache[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.num_sequences)
            else:
                self._cache[epoch] = np.arange(self.num_sequences)
        return self._cache[epoch]

    def ids(self, position: int, count: int) -> np.ndarray:
        pos = np.arange(position, position + count)
        epochs, within = np.divmod(pos, self.num_sequences)
        return np.array([self._perm(int(e))[int(w)] for e, w in zip(epochs, within)], dtype=np.int64)


@dataclass
class BatchPlan:
    micro_batch_size: int
    grad_accum: int
    dp_rank: int
    dp_size: int

    def position(self, step: int, micro: int) -> int:
        return ((step * self.grad_accum + micro) * self.dp_size + self.dp_rank) * self.micro_batch_size

    def samples_seen(self, step: int) -> int:
        return step * self.grad_accum * self.dp_size * self.micro_batch_size


def get_batch(source, sampler: Sampler, plan: BatchPlan, step: int, micro: int, device) -> dict:
    ids = sampler.ids(plan.position(step, micro), plan.micro_batch_size)
    return {k: v.to(device, non_blocking=True) for k, v in source.fetch(ids).items()}
