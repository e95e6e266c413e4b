"""Packing keeps document boundaries as seq_idx (0 at each row start, +1 at each new document)."""

import numpy as np

from hmscale.data.packing import pack, pack_documents, tokenize_documents


def _reference_seq_idx(docs, eos, L):
    doc_of = [d for d, t in enumerate(docs) for _ in range(len(t) + 1)]
    n = len(doc_of) // L
    rows = []
    for r in range(n):
        ids = doc_of[r * L : (r + 1) * L]
        rows.append([i - ids[0] for i in ids])
    return np.array(rows, dtype=np.int32).reshape(n, L)


def test_pack_documents_keeps_boundaries():
    rng = np.random.default_rng(0)
    docs = [list(rng.integers(1, 50, size=int(n))) for n in rng.integers(1, 40, size=60)]
    L, eos = 16, 0
    tokens, seq_idx = pack_documents(docs, eos, L)
    flat = np.concatenate([np.array(d + [eos]) for d in docs])
    n = len(flat) // L
    assert tokens.dtype == np.int32 and seq_idx.dtype == np.int32 and tokens.shape == (n, L) == seq_idx.shape
    assert np.array_equal(tokens.reshape(-1), flat[: n * L])
    assert np.array_equal(seq_idx, _reference_seq_idx(docs, eos, L))
    assert (seq_idx[:, 0] == 0).all() and (np.diff(seq_idx, axis=1) >= 0).all()
    # a new document starts exactly after each eos (within a row)
    after_eos = tokens[:, :-1] == eos
    assert np.array_equal(np.diff(seq_idx, axis=1) == 1, after_eos)


def test_pack_drops_tail_and_handles_long_documents():
    tokens = np.arange(1, 101, dtype=np.int32)
    t, s = pack(tokens, np.array([100]), 30)
    assert t.shape == (3, 30) and (s == 0).all()  # one long document spans rows
    t, s = pack(tokens, np.array([10, 90]), 30)
    assert list(s[0]) == [0] * 10 + [1] * 20 and (s[1:] == 0).all()


def test_tokenize_documents_appends_eos():
    class Tok:  # a slow-tokenizer stand-in (no backend): one id per character
        def __call__(self, batch, add_special_tokens=False):
            return {"input_ids": [[ord(c) for c in t] for t in batch]}

    tokens, lens = tokenize_documents(Tok(), ["ab", "", "cde"], eos_id=0, batch_size=2)
    assert tokens.tolist() == [97, 98, 0, 0, 99, 100, 101, 0] and lens.tolist() == [3, 1, 4]
