"""A left-padded batch prefilled in segments carrying the cache (a long prompt fed a piece at a time): a segment that
is all padding for one row (its padding longer than the segment) must leave that row's recurrent state empty, so its
later tokens score as the row alone would. The reference is each row alone, unpadded, in one forward."""

import pytest
import torch

from hmscale.models.hedgemamba import HedgeMambaCache

from ._helpers import perturbed_hedgemamba

VOCAB = 97


def _model():
    return perturbed_hedgemamba(VOCAB)


@pytest.mark.parametrize("cuts", [[20], [30], [10, 20, 31, 40]])
def test_segmented_left_padded_prefill_equals_each_row_alone(cuts):
    model = _model()
    long, short, pad = torch.randint(1, VOCAB, (1, 50)), torch.randint(1, VOCAB, (1, 20)), 30
    batch = torch.cat([long, torch.cat([torch.zeros(1, pad, dtype=torch.long), short], 1)])
    mask = torch.ones_like(batch)
    mask[1, :pad] = 0
    with torch.no_grad():
        ref_long, ref_short = model(long).logits[0], model(short).logits[0]
        cache = HedgeMambaCache(model.config.num_hidden_layers)
        outs, a = [], 0
        for b in cuts + [batch.shape[1]]:
            outs.append(model(batch[:, a:b], attention_mask=mask[:, :b], cache=cache, use_cache=True).logits)
            a = b
        # and a decode step after the prompt
        nxt = torch.randint(1, VOCAB, (2, 1))
        step = model(nxt, attention_mask=torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1), cache=cache,
                     use_cache=True).logits[:, 0]
        ref_step = [model(torch.cat([r, n[None]], 1)).logits[0, -1] for r, n in ((long, nxt[0]), (short, nxt[1]))]
    got = torch.cat(outs, 1)
    torch.testing.assert_close(got[0], ref_long, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[1, pad:], ref_short, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(step, torch.stack(ref_step), rtol=1e-4, atol=1e-5)
