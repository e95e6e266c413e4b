"""GraphDecoder's CPU-reachable parts: the CUDA check, and ``greedy(n)``'s count (n greedy tokens; 0 gave one). The
decode step is stubbed with a fixed logits table (its CUDA graph is tested on the GPU)."""

import pytest
import torch

from hmscale.eval.graph_decode import GraphDecoder


class _TableDecoder(GraphDecoder):
    """``step(tok)`` returns row ``tok`` of a fixed (vocab, vocab) logits table: a Markov chain to decode greedily."""

    def __init__(self, table, first_logits):
        self.table, self.next_logits, self.pos = table, first_logits, 0

    def step(self, ids):
        self.pos += 1
        return self.table[ids.view(-1)]


def test_greedy_gives_n_tokens_as_an_argmax_chain():
    g = torch.Generator().manual_seed(0)
    table, first = torch.randn(11, 11, generator=g), torch.randn(3, 11, generator=g)
    for n in (0, 1, 5):
        got = _TableDecoder(table, first).greedy(n)
        tok, ref = first.argmax(-1), []
        for _ in range(n):
            ref.append(tok)
            tok = table[tok].argmax(-1)
        assert got.shape == (3, n)
        if n:
            assert torch.equal(got, torch.stack(ref, 1))


def test_graph_decoder_refuses_cpu_tensors():
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        GraphDecoder(None, torch.zeros(1, 3, dtype=torch.long))
