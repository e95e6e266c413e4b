"""Perplexity by position over contexts longer than the training rows.

A distilled recurrent model is worth most where a Transformer is weakest: long contexts. This scores every
position of rows ``length`` tokens long and reports the perplexity per bucket of target positions, the first
bucket inside the training length and each next one twice as far (``[1, T), [T, 2T), [2T, 4T), ...``), so one
table shows whether a model keeps using its context past the length it was trained on, or breaks down there.

Rows come from the validation split: the first ``length`` tokens of every document at least that long (real
long-range structure), or, when no document is, consecutive slices of the concatenated stream (``rows_from``
says which). A model with a recurrent cache (HedgeMamba) can be fed in segments carrying its state
(``segment``): memory stays that of one segment whatever the length, and the scores equal the whole-row
forward's (tested).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from hmscale.eval.perplexity import check_token_ids


def long_context_rows(stream_dir: str | Path, length: int, max_rows: int, split: str = "validation") -> tuple[np.ndarray, str]:
    """(rows int64 (n, length), rows_from): prefixes of the documents of at least ``length`` tokens, else slices of
    the concatenated split."""
    if length < 2:
        raise ValueError(f"eval.context_length: {length} scores nothing; use at least 2 tokens (e.g. 4 x data.seq_len)")
    stream = Path(stream_dir)
    tokens = np.load(stream / f"{split}.tokens.npy", mmap_mode="r")
    lens = np.load(stream / f"{split}.doc_lens.npy")
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
    long_docs = starts[lens >= length][:max_rows]
    if len(long_docs):
        return np.stack([np.asarray(tokens[s:s + length], dtype=np.int64) for s in long_docs]), "documents"
    n = min(len(tokens) // length, max_rows)
    if n == 0:
        raise ValueError(f"eval.context_length: the {split} split has {len(tokens):,} tokens, fewer than one row of "
                         f"{length:,}; lower eval.context_length or raise data.val_fraction")
    return np.asarray(tokens[: n * length], dtype=np.int64).reshape(n, length), "stream"


def bucket_edges(length: int, train_len: int) -> list[int]:
    """Target-position bucket edges: 1, the training length, then doubling up to ``length``
    (inside the training length, quarters of it)."""
    if length <= train_len:
        edges = [1] + [e for e in (length // 4, length // 2) if e > 1] + [length]
    else:
        edges, e = [1, train_len], 2 * train_len
        while e < length:
            edges.append(e)
            e *= 2
        edges.append(length)
    return sorted(set(edges))


_CE_BLOCK = 2048  # positions per fp32 cross-entropy block


def _has_recurrent_cache(model) -> bool:
    return getattr(getattr(model, "config", None), "model_type", None) == "hedgemamba"


@torch.no_grad()
def position_nll(model, rows, batch_size: int = 1, segment: int | None = None,
                 device: str | torch.device | None = None, progress=None) -> tuple[np.ndarray, np.ndarray]:
    """(sum of next-token NLL, count) per target position 1..L-1 over ``rows`` (n, L). With ``segment`` (HedgeMamba
    only) each row goes through the model ``segment`` tokens at a time, the recurrent cache carried between them.
    ``progress(rows_done, n)`` is called after each batch of rows."""
    rows = torch.as_tensor(rows).long()
    if rows.ndim != 2 or rows.shape[0] == 0 or rows.shape[1] < 2:
        raise ValueError(f"rows must be (n, L) with n >= 1 and L >= 2, got shape {tuple(rows.shape)}")
    if batch_size < 1:
        raise ValueError(f"batch_size: {batch_size}; use 1 or more rows per forward")
    check_token_ids(model, rows)
    if segment is not None and not _has_recurrent_cache(model):
        raise ValueError(f"segment: {type(model).__name__} has no recurrent cache; score it whole (segment=None)")
    device = device or next(model.parameters()).device
    n, L = rows.shape
    step = L if segment is None else max(1, int(segment))
    total = np.zeros(L - 1, dtype=np.float64)
    was_training = model.training
    model.eval()
    try:
        for i in range(0, n, batch_size):
            ids = rows[i:i + batch_size].to(device)
            cache = None
            for a in range(0, L - 1, step):
                b = min(a + step, L)
                if segment is None:
                    logits = model(input_ids=ids[:, a:b], return_dict=True).logits
                else:
                    out = model(input_ids=ids[:, a:b], cache=cache, use_cache=True, return_dict=True)
                    logits, cache = out.logits, out.cache
                m = min(b, L - 1) - a  # targets a+1 .. min(b, L-1)
                for c in range(0, m, _CE_BLOCK):  # fp32 logits a block of positions at a time (long rows, big vocab)
                    e = min(c + _CE_BLOCK, m)
                    nll = F.cross_entropy(logits[:, c:e].float().reshape(-1, logits.shape[-1]),
                                          ids[:, a + 1 + c:a + 1 + e].reshape(-1), reduction="none")
                    total[a + c:a + e] += nll.view(-1, e - c).sum(0).double().cpu().numpy()
            if progress is not None:
                progress(min(i + batch_size, n), n)
    finally:
        model.train(was_training)
    return total, np.full(L - 1, n, dtype=np.int64)


def bucket_perplexities(total: np.ndarray, count: np.ndarray, edges: list[int]) -> list[float]:
    """exp(mean NLL) over the target positions of each bucket ``[edges[i], edges[i+1])`` (target position j, the
    token at index j of a row, is ``total[j - 1]``)."""
    out = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        s, c = total[lo - 1:hi - 1].sum(), count[lo - 1:hi - 1].sum()
        out.append(float(math.exp(s / c)) if c else float("nan"))
    return out


def _progress_log(name: str, every: float, log):
    """A ``position_nll`` progress callback: one log line per ``every`` seconds at most (long rows of a large model
    take minutes per model; without it the run is silent until the model's table line)."""
    t0 = last = time.monotonic()

    def report(done: int, n: int) -> None:
        nonlocal last
        now = time.monotonic()
        if done < n and now - last >= every:
            last = now
            log(f"[eval] long context {name}: {done}/{n} rows scored in {now - t0:.0f} s")

    return report


def long_context_eval(models: dict, rows: np.ndarray, train_len: int, tokens_per_batch: int = 8192,
                      segment: int | None = 4096, rows_from: str = "documents", log=print,
                      progress_every: float = 30.0) -> dict:
    """Bucketed perplexities of each named model on ``rows``; HedgeMamba models are fed in ``segment``-token
    pieces carrying their state (``None``: whole rows). A progress line every ``progress_every`` seconds."""
    n, length = rows.shape
    edges = bucket_edges(length, train_len)
    bs = max(1, tokens_per_batch // length)
    out = {"length": int(length), "train_seq_len": int(train_len), "rows": int(n), "rows_from": rows_from,
           "buckets": [[lo, hi] for lo, hi in zip(edges[:-1], edges[1:])], "ppl": {}, "overall_ppl": {}}
    for name, model in models.items():
        seg = segment if segment is not None and segment < length and _has_recurrent_cache(model) else None
        total, count = position_nll(model, rows, batch_size=bs, segment=seg,
                                    progress=_progress_log(name, progress_every, log))
        out["ppl"][name] = bucket_perplexities(total, count, edges)
        out["overall_ppl"][name] = float(math.exp(total.sum() / count.sum()))
        log(f"[eval] long context {name}: " + ", ".join(
            f"[{lo}, {hi}) {p:.2f}" for (lo, hi), p in zip(out["buckets"], out["ppl"][name])))
    return out


def models_in_order(res: dict, labels: dict) -> list[str]:
    """The models of a result, in ``labels``' order first (results.json stores them with its keys sorted)."""
    return [n for n in labels if n in res["ppl"]] + [n for n in res["ppl"] if n not in labels]


def long_context_table(res: dict, labels: dict | None = None) -> list[str]:
    """Markdown rows: one line per model, one column per position bucket (perplexity)."""
    labels = labels or {}
    head = " | ".join(f"{lo}-{hi - 1}" + (" *" if lo >= res["train_seq_len"] else "") for lo, hi in res["buckets"])
    lines = [f"| model | {head} |", "| --- |" + " --- |" * len(res["buckets"])]
    for name in models_in_order(res, labels):
        lines.append(f"| {labels.get(name, name)} | " + " | ".join(f"{p:.2f}" for p in res["ppl"][name]) + " |")
    return lines
