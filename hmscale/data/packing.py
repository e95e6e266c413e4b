"""Packing: documents -> token ids + eos, concatenated, cut into fixed-length rows.

Document boundaries survive as `seq_idx` (int32 per token): within a row it starts at 0 and
increases by one wherever a new document begins (the SSD kernels reset their state there).
A document's eos token belongs to that document. A trailing partial row is dropped.
"""

from __future__ import annotations

import numpy as np


def tokenize_documents(tokenizer, documents: list[str], eos_id: int, batch_size: int = 512):
    """(tokens int32 flat, doc_lens int64): each document's ids followed by eos, concatenated."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    pieces: list[np.ndarray] = []
    lens = np.zeros(len(documents), dtype=np.int64)
    for start in range(0, len(documents), batch_size):
        batch = documents[start : start + batch_size]
        if backend is not None:
            ids = [e.ids for e in backend.encode_batch(batch, add_special_tokens=False)]
        else:
            ids = tokenizer(batch, add_special_tokens=False)["input_ids"]
        for j, seq in enumerate(ids):
            arr = np.empty(len(seq) + 1, dtype=np.int32)
            arr[:-1] = seq
            arr[-1] = eos_id
            pieces.append(arr)
            lens[start + j] = len(arr)
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)
    return tokens, lens


def doc_ids_from_lens(doc_lens: np.ndarray) -> np.ndarray:
    """Per-token document index (int64) of a concatenated stream."""
    return np.repeat(np.arange(len(doc_lens), dtype=np.int64), np.asarray(doc_lens, dtype=np.int64))


def rows_seq_idx(doc_ids: np.ndarray) -> np.ndarray:
    """seq_idx for rows of per-token document ids (n, L): 0 at each row start, +1 at each new document."""
    doc_ids = np.asarray(doc_ids)
    return (doc_ids - doc_ids[:, :1]).astype(np.int32)


def pack(tokens: np.ndarray, doc_lens: np.ndarray, seq_len: int):
    """Cut a stream into rows: (tokens int32 [n, L], seq_idx int32 [n, L]); the tail is dropped."""
    n = len(tokens) // seq_len
    rows = np.ascontiguousarray(tokens[: n * seq_len], dtype=np.int32).reshape(n, seq_len)
    ids = doc_ids_from_lens(doc_lens)[: n * seq_len].reshape(n, seq_len)
    return rows, rows_seq_idx(ids)


def pack_documents(token_lists: list[list[int]], eos_id: int, seq_len: int):
    """Pack already tokenised documents (lists of ids, without eos)."""
    pieces = [np.asarray(list(t) + [eos_id], dtype=np.int32) for t in token_lists]
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)
    return pack(tokens, np.array([len(p) for p in pieces], dtype=np.int64), seq_len)
