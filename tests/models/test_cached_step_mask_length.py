"""A cached step after a left-padded prompt given only the new tokens' attention_mask (transformers' convention is the
mask of every position so far): the positions restarted at 0 for the padded row and its logits were wrong, silently.
Now refused in one line; the full mask gives what the uncached forward gives."""

import pytest
import torch

from hmscale.models import HedgeMambaConfig, HedgeMambaForCausalLM


def test_a_cached_step_needs_the_mask_of_every_position():
    torch.manual_seed(0)
    model = HedgeMambaForCausalLM(HedgeMambaConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2,
                                                   num_attention_heads=2, rotary_pct=0.5, chunk_size=8)).eval()
    ids = torch.randint(1, 50, (2, 7))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # row 1 left-padded
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits[:, -1]
        cache = model(ids[:, :-1], attention_mask=mask[:, :-1], use_cache=True).cache
        with pytest.raises(ValueError, match="attention_mask has 1 positions for 6 cached and 1 new"):
            model(ids[:, -1:], attention_mask=mask[:, -1:], cache=cache, use_cache=True)
        step = model(ids[:, -1:], attention_mask=mask, cache=cache, use_cache=True).logits[:, -1]
    torch.testing.assert_close(step, full, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="attention_mask has 3 positions for 0 cached and 7 new"):
        model(ids, attention_mask=mask[:, :3])
