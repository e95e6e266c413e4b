"""Training on a left-padded batch (attention_mask zeros before a row's first token, as a tokenizer with
padding_side="left" gives): the padded positions are invisible to the forward, and must be to the backward too.

Before the fix, the attention normaliser of a position before any real token is 0 (its dt is 0), the kernel divides
without an epsilon, and the backward's 0 / 0 made every gradient of the model NaN, though the loss was finite."""

import pytest
import torch
import torch.nn.functional as F

from hmscale.models import HedgeMambaConfig, HedgeMambaForCausalLM

VOCAB = 97


def _model(**overrides):
    torch.manual_seed(0)
    cfg = HedgeMambaConfig(**{**dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     rotary_pct=0.5, chunk_size=8), **overrides})
    model = HedgeMambaForCausalLM(cfg).double()
    with torch.no_grad():  # away from the identity init: every recurrent part matters
        for name, p in model.named_parameters():
            if any(k in name for k in ("conv.", "dt_proj", "A_scale", "z_proj", "feature_map", "mixer.D")):
                p.add_(0.2 * torch.randn_like(p))
        for layer in model.backbone.layers:
            if cfg.ssm:
                layer.mixer.A_scale.abs_()
    return model


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("components", [{}, {"ssm": False}, {"gate": False, "conv": False}])
def test_left_padded_batch_gradients_equal_the_rows_alone(components):
    model = _model(**components).train()
    torch.manual_seed(1)
    rows = [torch.randint(1, VOCAB, (20,)), torch.randint(1, VOCAB, (11,)), torch.randint(1, VOCAB, (3,))]
    ids = torch.zeros(3, 20, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):  # left padding (a row longer than one chunk is padded too)
        ids[i, 20 - len(r):] = r
        mask[i, 20 - len(r):] = 1
    labels = ids.masked_fill(mask == 0, -100)
    labels[1, 9], labels[2, 17] = -100, -100  # a row's first token is no target (not predicted from padding)
    out = model(ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    got = _grads(model)
    bad = sorted(n for n, g in got.items() if not torch.isfinite(g).all())
    assert not bad, f"non-finite gradients: {bad[:3]} ({len(bad)} in all)"

    model.zero_grad()
    n_targets = sum(len(r) - 1 for r in rows)
    # (the loss is computed in fp32, as the model's own)
    total = sum(F.cross_entropy(model(r[None]).logits[0, :-1].float(), r[1:], reduction="sum") for r in rows) / n_targets
    torch.testing.assert_close(out.loss, total, rtol=1e-6, atol=1e-6)
    total.backward()
    want = _grads(model)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=name)


def test_left_padded_generate_with_a_cache_segment_still_matches_the_row_alone():
    """The prompt of a left-padded batch fed in two segments through the cache (the second one holding only real
    tokens) then decoded: each row as it is alone."""
    model = _model().eval()
    torch.manual_seed(2)
    a, b = torch.randint(1, VOCAB, (1, 14)), torch.randint(1, VOCAB, (1, 5))
    ids = torch.cat([a, torch.cat([torch.zeros(1, 9, dtype=torch.long), b], 1)])
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    with torch.no_grad():
        first = model(ids[:, :11], attention_mask=mask[:, :11], use_cache=True)
        second = model(ids[:, 11:], attention_mask=mask, cache=first.cache, use_cache=True)
        for i, row in enumerate((a, b)):
            alone = model(row).logits[0, -3:]
            torch.testing.assert_close(second.logits[i], alone, rtol=1e-9, atol=1e-10)
        kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
        out = model.generate(ids, attention_mask=mask, **kw)
        assert torch.equal(out[0, 14:], model.generate(a, **kw)[0, 14:])
        assert torch.equal(out[1, 14:], model.generate(b, **kw)[0, 5:])
