"""Vocabulary-parallel LM head and tied word embeddings (``tie_word_embeddings=True``).

Found on the walk: ``apply_tensor_parallel(..., vocab_parallel=True)`` replaced a head tied to *trainable* input
embeddings by a sharded copy, silently untying them: at tp=2 ``backbone.embed_in.weight`` lost the head's share
of its gradient (off by ~82 in a tiny model against tp=1) and the head's shard trained on its own, so the export
(tied in its config) kept only one of the two diverged tensors. Now a clear error; with the embeddings frozen
(stage 2 always freezes them) the head still shards.
"""

import pytest
import torch

from hmscale.models.hedgemamba import HedgeMambaConfig, HedgeMambaForCausalLM
from hmscale.parallel import ParallelMesh, apply_tensor_parallel


def _tied_model():
    torch.manual_seed(0)
    return HedgeMambaForCausalLM(HedgeMambaConfig(vocab_size=20, hidden_size=16, num_hidden_layers=1,
                                                  num_attention_heads=4, chunk_size=8, tie_word_embeddings=True))


def _mesh(rank=0):  # building the shards needs no collective: a tp=2 mesh without groups
    return ParallelMesh(world_size=2, rank=rank, tp_size=2, dp_size=1, tp_rank=rank, dp_rank=0)


def test_tied_model_is_really_tied():
    model = _tied_model()
    assert model.lm_head.weight is model.backbone.embed_in.weight


def test_vocab_parallel_refuses_a_head_tied_to_trainable_embeddings():
    model = _tied_model()
    with pytest.raises(ValueError, match="tied"):
        apply_tensor_parallel(model, _mesh(), vocab_parallel=True)


def test_vocab_parallel_shards_a_tied_head_when_the_embeddings_are_frozen():
    for rank in (0, 1):
        model = _tied_model()
        full = model.lm_head.weight.detach().clone()
        model.backbone.embed_in.weight.requires_grad_(False)
        apply_tensor_parallel(model, _mesh(rank), vocab_parallel=True)
        assert model.vocab_shard.start == rank * 10
        assert torch.equal(model.lm_head.weight, full[rank * 10:(rank + 1) * 10])
        assert not model.lm_head.weight.requires_grad


def test_tied_head_without_vocab_parallel_stays_tied():
    model = _tied_model()
    apply_tensor_parallel(model, _mesh(), vocab_parallel=False)
    assert model.lm_head.weight is model.backbone.embed_in.weight
