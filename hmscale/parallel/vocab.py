"""Vocabulary-parallel LM head and the softmax statistics the losses need from it.

With tensor parallelism the LM head is the largest replicated matmul of a Pythia-shaped student (50,304
rows), and its fp32 softmax over ``tokens x vocabulary`` is the largest elementwise work. Sharding it by
vocabulary rows gives each rank ``logits[..., start:end]``; a loss then needs only per-token statistics
over the full vocabulary, each one all-reduce of a ``(tokens,)`` vector:

- ``logsumexp``: the max (all-reduce MAX, no gradient) and the sum of ``exp(z - max)`` (all-reduce SUM);
- ``gather``: ``z[id]`` for global ids, from the rank that holds each id (SUM of masked gathers);
- ``shard_sum``: the sum over the vocabulary of a per-rank partial (SUM).

The SUMs go through ``reduce_from_tp_region`` (backward: identity): every rank computes the same loss from
the reduced values and backpropagates into its own shard, which is the gradient of that shard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .layers import ColumnParallelLinear, reduce_from_tp_region

__all__ = ["VocabShard", "shard_lm_head", "whole_head_note", "vocab_logsumexp", "vocab_gather", "vocab_shard_sum"]


@dataclass(frozen=True)
class VocabShard:
    """Rows ``[start, end)`` of a ``vocab_size``-row LM head on this rank of a tp group of ``tp_size``."""

    start: int
    end: int
    vocab_size: int
    group: Any
    tp_size: int

    @property
    def size(self) -> int:
        return self.end - self.start


def whole_head_note(vocab_size: int, tp: int) -> str | None:
    """One line when a tp group keeps the LM head whole because ``tp`` does not divide the vocabulary (every rank
    then computes all the logits and the loss over them), None otherwise."""
    if tp <= 1 or vocab_size % tp == 0:
        return None
    fits = [d for d in range(2, min(tp * 4, vocab_size) + 1) if vocab_size % d == 0][:3]
    hint = f"a tp of {' or '.join(map(str, fits))} would shard it" if fits else "no small tp divides it"
    return (f"parallel.tp={tp} does not divide the vocabulary ({vocab_size:,} rows): the LM head stays whole on every "
            f"tp rank (each computes all the logits and the loss); {hint}")


def shard_lm_head(model: nn.Module, mesh) -> VocabShard:
    """Replace ``model.lm_head`` by this rank's vocabulary rows (a column-parallel linear whose input gradient
    is all-reduced); sets and returns ``model.vocab_shard``. The model then returns local logits."""
    head = model.lm_head
    vocab = head.out_features
    tp = mesh.tp_size
    if vocab % tp:
        raise ValueError(f"parallel.tp: {tp} does not divide the vocabulary ({vocab} rows of the LM head)")
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    emb_w = getattr(emb, "weight", None)
    if emb_w is not None and head.weight is emb_w and emb_w.requires_grad:
        # the shard would be a copy: the two would train apart (the embeddings losing the head's gradient)
        raise ValueError("vocab_parallel: the LM head is tied to the input embeddings, which train; sharding it by "
                         "vocabulary would untie them. Freeze the input embeddings, or keep the head replicated "
                         "(vocab_parallel=False)")
    n = vocab // tp
    start = mesh.tp_rank * n
    model.lm_head = ColumnParallelLinear.from_linear(head, torch.arange(start, start + n), mesh)
    model.vocab_shard = VocabShard(start, start + n, vocab, mesh.tp_group, tp)
    return model.vocab_shard


def vocab_logsumexp(z: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """logsumexp over the full vocabulary of the sharded ``z`` (..., n) -> (...)."""
    with torch.no_grad():
        m = z.max(dim=-1).values
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=shard.group)
    s = torch.exp(z - m.unsqueeze(-1)).sum(dim=-1)
    return m + torch.log(reduce_from_tp_region(s, shard.group, shard.tp_size))


def vocab_gather(z: torch.Tensor, ids: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """``z[..., ids]`` for global vocabulary ids (..., k) from the sharded ``z`` (..., n) -> (..., k)."""
    local = ids - shard.start
    inside = (local >= 0) & (local < shard.size)
    vals = z.gather(-1, local.clamp(0, shard.size - 1)) * inside.to(z.dtype)
    return reduce_from_tp_region(vals, shard.group, shard.tp_size)


def vocab_shard_sum(partial: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """Sum over ranks of per-rank partial sums over their vocabulary rows."""
    return reduce_from_tp_region(partial, shard.group, shard.tp_size)
