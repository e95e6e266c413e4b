"""The whole mixer on the Triton kernels (SSD, feature map, conv, split + rotary; under TRITON_INTERPRET=1 on
CPU) against the plain path, through a small HedgeMamba: loss and every parameter's gradient."""

import torch

from ._helpers import TRITON_DEVICE, needs_triton

pytestmark = needs_triton
DEVICE = TRITON_DEVICE


def test_model_on_triton_kernels_matches_plain(monkeypatch):
    """A small HedgeMamba (every component on, off its identity init) with the kernels' backend forced to
    Triton (SSD, feature map, conv, split + rotary) gives the plain path's loss and gradients."""
    from hmscale.models.hedgemamba import HedgeMambaConfig, HedgeMambaForCausalLM

    torch.manual_seed(0)
    model = HedgeMambaForCausalLM(HedgeMambaConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2,
                                                   num_attention_heads=2, chunk_size=16)).to(DEVICE)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(k in name for k in ("dt_proj", "A_scale", "z_proj", "conv", "feature_map", ".D")):
                p.add_(0.1 * torch.randn_like(p))
    ids = torch.randint(0, 50, (2, 21), device=DEVICE)
    results = []
    for backend in ("triton", "torch"):
        monkeypatch.setenv("HMSCALE_SSD_BACKEND", backend)
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (l_tri, g_tri), (l_ref, g_ref) = results
    assert abs(float(l_tri - l_ref)) <= 1e-5 * abs(float(l_ref))
    assert g_tri.keys() == g_ref.keys() and len(g_ref) > 20
    for name, g in g_ref.items():  # relative, with an absolute floor for gradients that are ~0 on both paths
        # (A_log behind a negative A_scale; dt where the normaliser cancels it)
        assert float((g_tri[name] - g).norm()) <= 1e-4 * float(g.norm()) + 1e-8, name
