"""Packing: documents -> token ids + eos, concatenated, cut into fixed-length rows.

Document boundaries survive as `seq_idx` (int32 per token): within a row it starts at 0 and
increases by one wherever a new document begins (the SSD kernels reset their state there).
A document's eos token belongs to that document. A trailing partial row is dropped.
"""

from __future__ import annotations

import numpy as np


PIECE_CHARS = 1 << 20  # a document longer than this is encoded in pieces of about this many characters


def _cut_points(text: str, size: int):
    """Where a long text may be cut without changing its tokens under a byte-level BPE: after a newline that has a
    non-space on each side (the pre-tokenizer splits there whatever the tokenizer), about every ``size`` characters."""
    start = 0
    while len(text) - start > size:
        i = start + size
        while True:
            i = text.find("\n", i)
            if i < 0 or i + 1 >= len(text):
                return
            if i > 0 and not text[i - 1].isspace() and not text[i + 1].isspace():
                break
            i += 1
        yield i + 1
        start = i + 1


def _encode_in_pieces(encode_batch) -> bool:
    """Whether this tokenizer encodes text cut at ``_cut_points`` as it encodes it whole (byte-level BPEs do; one
    that marks the start of a text, e.g. a SentencePiece prefix, does not: its documents are encoded whole)."""
    probe = ["alpha beta, gamma.\nDelta 12 epsilon\n(zeta) eta\n", "alpha beta, gamma.\n", "Delta 12 epsilon\n",
             "(zeta) eta\n"]
    whole, *parts = encode_batch(probe)
    return whole == [t for p in parts for t in p]


def tokenize_documents(tokenizer, documents: list[str], eos_id: int, batch_size: int = 512,
                       piece_chars: int = PIECE_CHARS):
    """(tokens int32 flat, doc_lens int64): each document's ids followed by eos, concatenated. A document longer than
    ``piece_chars`` is encoded in pieces cut at newlines (same tokens, bounded memory: a tokenizer's per-token
    objects take ~0.5 KB a token, so a GB-sized document encoded whole would need hundreds of GB)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        def encode_batch(texts):
            return [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
    else:
        def encode_batch(texts):
            return tokenizer(texts, add_special_tokens=False)["input_ids"]
    in_pieces = None
    pieces: list[np.ndarray] = []
    lens = np.zeros(len(documents), dtype=np.int64)
    for start in range(0, len(documents), batch_size):
        batch = documents[start : start + batch_size]
        long = {j for j, d in enumerate(batch) if len(d) > piece_chars}
        if long and in_pieces is None:
            in_pieces = _encode_in_pieces(encode_batch)
        if not in_pieces:
            long = set()
        short = [d for j, d in enumerate(batch) if j not in long]
        encoded = iter(encode_batch(short) if short else [])
        for j, doc in enumerate(batch):
            if j in long:
                cuts = [0, *_cut_points(doc, piece_chars), len(doc)]
                seq = np.concatenate([np.asarray(encode_batch([doc[a:b]])[0], dtype=np.int32)
                                      for a, b in zip(cuts, cuts[1:])])
            else:
                seq = next(encoded)
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
