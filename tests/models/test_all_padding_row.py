"""A batch with a row that is all padding (attention_mask all zeros: an empty document in a padded batch). Every
position of it has a normaliser of 0 (dt = 0 everywhere): its outputs are masked, but the backward's 0 / 0 through
the kernel's division made every gradient of the model NaN. Now such a row keeps its dt (its normaliser is positive,
its outputs still masked, so nothing flows from it): the gradients equal those of the other rows alone."""

import torch
import torch.nn.functional as F

from hmscale.models import HedgeMambaConfig, HedgeMambaForCausalLM

VOCAB = 97


def test_a_batch_with_an_all_padding_row_trains_as_its_other_rows():
    torch.manual_seed(0)
    cfg = HedgeMambaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                           rotary_pct=0.5, chunk_size=8)
    model = HedgeMambaForCausalLM(cfg).double().train()
    with torch.no_grad():  # away from the identity init: every recurrent part matters
        for name, p in model.named_parameters():
            if any(k in name for k in ("conv.", "dt_proj", "A_scale", "z_proj", "feature_map", "mixer.D")):
                p.add_(0.2 * torch.randn_like(p))
        for layer in model.backbone.layers:
            layer.mixer.A_scale.abs_()
    rows = [torch.randint(1, VOCAB, (12,)), torch.randint(1, VOCAB, (7,))]
    ids = torch.zeros(3, 12, dtype=torch.long)
    mask = torch.zeros_like(ids)
    ids[0], mask[0] = rows[0], 1
    ids[2, 5:], mask[2, 5:] = rows[1], 1  # left padding, so the rows are rotated in the scan
    ids[1] = torch.randint(1, VOCAB, (12,))  # row 1: tokens, all masked out
    labels = ids.masked_fill(mask == 0, -100)
    labels[2, 5] = -100
    out = model(ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    got = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    bad = sorted(n for n, g in got.items() if not torch.isfinite(g).all())
    assert not bad, f"non-finite gradients: {bad[:3]} ({len(bad)} in all)"
    assert torch.isfinite(out.logits).all()

    model.zero_grad()
    n_targets = sum(len(r) - 1 for r in rows)
    total = sum(F.cross_entropy(model(r[None]).logits[0, :-1].float(), r[1:], reduction="sum") for r in rows) / n_targets
    torch.testing.assert_close(out.loss, total, rtol=1e-6, atol=1e-6)
    total.backward()
    for n, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(got[n], p.grad, rtol=1e-5, atol=1e-8, msg=n)
