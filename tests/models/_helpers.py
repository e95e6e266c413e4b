"""Shared builders for the models tests."""

from __future__ import annotations

import torch
from transformers import GPTNeoXForCausalLM

from hmscale.models.convert import to_hedgehog, to_hedgemamba
from hmscale.teacher.flavors import neox_config


def perturbed_hedgemamba(vocab: int):
    """A pythia-nano-shaped HedgeMamba (eval mode) moved away from its identity init: conv, decay, gate and feature
    maps all matter (seeded: the same model every call)."""
    torch.manual_seed(0)
    model = to_hedgemamba(to_hedgehog(GPTNeoXForCausalLM(neox_config("pythia-nano", vocab_size=vocab)).eval())).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(k in name for k in ("conv.", "dt_proj", "A_scale", "z_proj", "feature_map")):
                p.add_(0.2 * torch.randn(p.shape, generator=g))
        for layer in model.backbone.layers:
            layer.mixer.A_scale.abs_()
    return model
