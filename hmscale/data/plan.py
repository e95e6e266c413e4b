"""The shard plan: a deterministic map shard id -> sequences of the packed train stream.

The packed stream's rows are dealt into shards in a fixed pseudo-random order (``row_order``, seeded by the plan's
hash): shard i holds rows ``row_order[i*S : (i+1)*S]`` (S = sequences_per_shard; the last shard may be shorter), so
the first k shards are a uniform sample of the whole stream, not its first documents (a corpus in file order would
otherwise put its first files in them), whatever the number of workers and in whatever order they run: any worker
can build any shard and a rerun builds byte-identical shards. `hash` identifies the plan (tokenizer, source,
seq_len, S, the tokenised content and this layout), so caches keyed by it are invalidated by any change that alters a
shard.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from hmscale.data.cachedir import stable_hash
from hmscale.data.packing import rows_seq_idx

ROW_LAYOUT = "shuffled-1"  # shards hold rows in a fixed pseudo-random order (part of the hash: older caches are not read)


def stream_digest(tokens: np.ndarray, doc_lens: np.ndarray) -> str:
    h = hashlib.sha256()
    h.update(np.ascontiguousarray(tokens, dtype="<i4").tobytes())
    h.update(np.ascontiguousarray(doc_lens, dtype="<i8").tobytes())
    return h.hexdigest()


class ShardPlan:
    """Shards of fixed-length rows cut from one token stream (flat int32 tokens + document lengths)."""

    def __init__(self, tokens: np.ndarray, doc_lens: np.ndarray, seq_len: int, sequences_per_shard: int, *,
                 tokenizer_fingerprint: str = "", source: str = "", content_digest: str | None = None,
                 stream_path: str | Path | None = None):
        if seq_len < 2 or sequences_per_shard < 1:
            raise ValueError("ShardPlan: seq_len must be >= 2 and sequences_per_shard >= 1")
        self.seq_len = int(seq_len)
        self.sequences_per_shard = int(sequences_per_shard)
        self.tokenizer_fingerprint = tokenizer_fingerprint
        self.source = source
        self.stream_path = str(stream_path) if stream_path is not None else None
        self._set_stream(tokens, doc_lens)
        self.content_digest = content_digest or stream_digest(self._tokens, self._doc_lens)
        self.hash = stable_hash({
            "tokenizer": tokenizer_fingerprint, "source": source, "seq_len": self.seq_len,
            "sequences_per_shard": self.sequences_per_shard, "content": self.content_digest,
            "rows": ROW_LAYOUT,
        })
        self._row_order = None

    def _set_stream(self, tokens, doc_lens):
        self._tokens = tokens
        self._doc_lens = np.asarray(doc_lens, dtype=np.int64)
        self._doc_starts = np.concatenate([[0], np.cumsum(self._doc_lens)[:-1]]).astype(np.int64)
        if int(self._doc_lens.sum()) != len(tokens):
            raise ValueError("ShardPlan: document lengths do not add up to the token count")

    # A plan backed by a cached stream pickles as its path (cheap to send to Ray workers).
    def __getstate__(self):
        state = self.__dict__.copy()
        state["_row_order"] = None  # (recomputed where needed)
        if self.stream_path is not None:
            for k in ("_tokens", "_doc_lens", "_doc_starts"):
                state.pop(k)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        if "_tokens" not in state:
            base = Path(self.stream_path)
            self._set_stream(np.load(f"{base}.tokens.npy", mmap_mode="r"), np.load(f"{base}.doc_lens.npy"))

    # ------------------------------------------------------------------ sizes
    @property
    def num_sequences(self) -> int:
        return len(self._tokens) // self.seq_len

    @property
    def num_shards(self) -> int:
        return -(-self.num_sequences // self.sequences_per_shard)

    @property
    def total_tokens(self) -> int:
        """Tokens covered by the plan's sequences (the stream's tail shorter than a row is dropped)."""
        return self.num_sequences * self.seq_len

    def shard_size(self, i: int) -> int:
        self._check(i)
        return min(self.sequences_per_shard, self.num_sequences - i * self.sequences_per_shard)

    def _check(self, i: int):
        if not 0 <= i < self.num_shards:
            raise IndexError(f"shard {i} out of range: the plan has {self.num_shards} shards")

    # ------------------------------------------------------------------ content
    def sequences(self, start: int, stop: int):
        """(tokens int32 [n, L], seq_idx int32 [n, L]) for packed sequences [start, stop)."""
        start, stop = max(0, start), min(stop, self.num_sequences)
        L = self.seq_len
        n = max(0, stop - start)
        toks = np.array(self._tokens[start * L : (start + n) * L], dtype=np.int32).reshape(n, L)
        pos = np.arange(start * L, (start + n) * L, dtype=np.int64)
        doc_ids = np.searchsorted(self._doc_starts, pos, side="right").reshape(n, L)
        return toks, rows_seq_idx(doc_ids)

    def rows(self, ids) -> tuple[np.ndarray, np.ndarray]:
        """(tokens int32 [n, L], seq_idx int32 [n, L]) for the packed sequences ``ids`` (stream row numbers, any order)."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        L = self.seq_len
        pos = ids[:, None] * L + np.arange(L, dtype=np.int64)[None, :]
        toks = np.asarray(self._tokens[pos.reshape(-1)], dtype=np.int32).reshape(len(ids), L)
        doc_ids = np.searchsorted(self._doc_starts, pos, side="right")
        return toks, rows_seq_idx(doc_ids)

    @property
    def row_order(self) -> np.ndarray:
        """The stream's rows in the order the shards hold them: a fixed pseudo-random permutation (seeded by the hash)."""
        if self._row_order is None:
            rng = np.random.default_rng(int(self.hash[:16], 16))
            self._row_order = rng.permutation(self.num_sequences).astype(np.int64)
        return self._row_order

    def shard_rows(self, i: int) -> np.ndarray:
        """The stream rows shard ``i`` holds, in its order."""
        self._check(i)
        S = self.sequences_per_shard
        return self.row_order[i * S : i * S + self.shard_size(i)]

    def shard_keys(self, i: int) -> list[str]:
        return [f"{i:06d}-{j:04d}" for j in range(self.shard_size(i))]

    def shard(self, i: int) -> dict:
        """{"keys": [f"{i:06d}-{j:04d}"], "tokens": int32 [n, L], "seq_idx": int32 [n, L]}: the rows ``shard_rows(i)``."""
        toks, seq_idx = self.rows(self.shard_rows(i))
        return {"keys": self.shard_keys(i), "tokens": toks, "seq_idx": seq_idx}

    def all_tokens(self) -> np.ndarray:
        """All packed train rows, int32 [num_sequences, L] (a view of the stream when memory-mapped)."""
        return np.asarray(self._tokens[: self.total_tokens]).reshape(self.num_sequences, self.seq_len)

    def describe(self) -> dict:
        return {
            "hash": self.hash, "source": self.source, "tokenizer_fingerprint": self.tokenizer_fingerprint,
            "seq_len": self.seq_len, "sequences_per_shard": self.sequences_per_shard,
            "num_sequences": self.num_sequences, "num_shards": self.num_shards,
            "total_tokens": self.total_tokens, "content_digest": self.content_digest,
        }

    def __repr__(self) -> str:
        return (f"ShardPlan(hash={self.hash}, shards={self.num_shards}, sequences={self.num_sequences}, "
                f"seq_len={self.seq_len}, per_shard={self.sequences_per_shard})")


def shards_for_tokens(num_shards: int, sequences_per_shard: int, seq_len: int, tokens: int) -> list[int]:
    """The plan's shards a run over ``tokens`` tokens reads: the first ones, as many as hold ``tokens`` (at least one,
    at most all). Each shard holds rows drawn from the whole stream (``ShardPlan.row_order``), so these are a uniform
    sample of it whatever the corpus order, the same for every run of the plan whatever its seed (teacher caches are
    shared between them), and a larger budget's shards hold a smaller one's. Every way of reading a stage's rows (live
    teacher, teacher cache, with or without top-k) draws them from these shards."""
    return list(range(min(int(num_shards), max(1, -(-int(tokens) // (int(sequences_per_shard) * int(seq_len)))))))
