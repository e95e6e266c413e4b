"""Perplexity on held-out token rows, one harness for the teacher and both students."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F


def _rows(tokens) -> torch.Tensor:
    t = torch.as_tensor(np.asarray(tokens) if not torch.is_tensor(tokens) else tokens)
    if t.ndim != 2:
        raise ValueError(f"tokens must be (rows, length), got shape {tuple(t.shape)}")
    if t.shape[0] == 0 or t.shape[1] < 2:  # (else no target: a perplexity of exactly 1)
        raise ValueError(f"tokens of shape {tuple(t.shape)} have no next token to score; pass at least one row of "
                         "2 or more tokens")
    return t.long()


def check_token_ids(model, ids: torch.Tensor) -> None:
    """One line instead of the embedding's ``IndexError`` when ``ids`` hold ids outside the model's vocabulary (tokens
    of another tokenizer)."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or (vocab is not None and hi >= vocab):
        raise ValueError(f"token ids span {lo}..{hi}, outside the model's vocabulary (0..{vocab - 1 if vocab else '?'}); "
                         "tokenise with the model's own tokenizer")


@torch.no_grad()
def mean_nll(model, tokens, batch_size: int = 8, device: str | torch.device | None = None) -> tuple[float, int]:
    """Mean next-token negative log-likelihood (nats) over every position of every row, and the count."""
    rows = _rows(tokens)
    check_token_ids(model, rows)
    if batch_size < 1:
        raise ValueError(f"batch_size: {batch_size}; use 1 or more rows per forward")
    if device is None:
        device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for i in range(0, rows.shape[0], batch_size):
            ids = rows[i : i + batch_size].to(device)
            logits = model(input_ids=ids, return_dict=True).logits.float()
            nll = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum")
            total += nll.item()
            count += ids[:, 1:].numel()
    finally:
        model.train(was_training)
    return total / count, count


def perplexity(model, tokens, batch_size: int = 8, device=None) -> float:
    """exp(mean next-token NLL) of `model` on `tokens` (rows, length)."""
    return math.exp(mean_nll(model, tokens, batch_size, device)[0])


def unigram_perplexity(train_tokens, val_tokens, vocab_size: int, smoothing: float = 1.0) -> float:
    """Perplexity of an add-`smoothing` unigram model fitted on `train_tokens`, scored like `perplexity`
    (every position after the first of each row is a target) on `val_tokens`."""
    counts = np.bincount(np.asarray(train_tokens).reshape(-1), minlength=vocab_size).astype(np.float64) + smoothing
    logp = np.log(counts / counts.sum())
    targets = np.asarray(val_tokens)[:, 1:].reshape(-1)
    return float(math.exp(-logp[targets].mean()))
