"""Cached decoding of packed prompts (``seq_idx``): a one-token input with ``seq_idx`` crashed (the document ids of a
length-1 ``seq_idx`` came out empty), and ``generate(..., seq_idx=...)`` handed the prompt's whole ``seq_idx`` to every
one-token decode step. The reference is the last document alone, fed without packing."""

import torch

from hmscale.models.hedgemamba import CausalDepthwiseConv, HedgeMambaCache

from ._helpers import perturbed_hedgemamba

VOCAB = 97


def _model():
    return perturbed_hedgemamba(VOCAB)


def _packed(n1=13, n2=7, b=2):
    """Two documents per row: tokens, seq_idx, the per-document positions, and the second document alone."""
    ids = torch.randint(1, VOCAB, (b, n1 + n2))
    seq_idx = torch.zeros(b, n1 + n2, dtype=torch.int32)
    seq_idx[:, n1:] = 1
    pos = torch.cat([torch.arange(n1), torch.arange(n2)])[None].expand(b, -1)
    return ids, seq_idx, pos, ids[:, n1:]


def test_one_token_steps_with_seq_idx_continue_the_last_document():
    model = _model()
    ids, seq_idx, pos, last_doc = _packed()
    n1, extra = 13, 6
    more = torch.randint(1, VOCAB, (ids.shape[0], extra))
    with torch.no_grad():
        ref = model(torch.cat([last_doc, more], 1)).logits[:, -extra:]
        cache = HedgeMambaCache(model.config.num_hidden_layers)
        model(ids, seq_idx=seq_idx, position_ids=pos, cache=cache, use_cache=True)
        steps = []
        for t in range(extra):
            p = torch.full((ids.shape[0], 1), ids.shape[1] - n1 + t)
            steps.append(model(more[:, t:t + 1], seq_idx=torch.ones(ids.shape[0], 1, dtype=torch.int32),
                               position_ids=p, cache=cache, use_cache=True).logits)
    torch.testing.assert_close(torch.cat(steps, 1), ref, rtol=1e-4, atol=1e-5)
    # a one-token forward without a cache is one document whatever its seq_idx
    with torch.no_grad():
        one = model(more[:, :1], seq_idx=torch.full((ids.shape[0], 1), 3, dtype=torch.int32)).logits
        torch.testing.assert_close(one, model(more[:, :1]).logits, rtol=0, atol=0)


def test_conv_takes_a_one_token_seq_idx():
    torch.manual_seed(0)
    conv = CausalDepthwiseConv(6, 4)
    with torch.no_grad():
        conv.weight.normal_()
    x, state = torch.randn(2, 1, 6), torch.randn(2, 6, 3)
    y, new = conv(x, state, seq_idx=torch.zeros(2, 1, dtype=torch.int32))
    y_ref, new_ref = conv(x, state)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(new, new_ref)


def test_generate_with_seq_idx_continues_the_last_document():
    model = _model()
    ids, seq_idx, pos, last_doc = _packed()
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None, output_logits=True,
              return_dict_in_generate=True)
    packed = model.generate(ids, seq_idx=seq_idx, position_ids=pos, **kw)
    alone = model.generate(last_doc, **kw)
    assert torch.equal(packed.sequences[:, ids.shape[1]:], alone.sequences[:, last_doc.shape[1]:])
    torch.testing.assert_close(torch.stack(packed.logits), torch.stack(alone.logits), rtol=1e-4, atol=1e-5)
