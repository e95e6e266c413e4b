"""apply_compile: blocks compiled in place give the eager model's loss and gradients."""

import copy

import pytest
import torch

from hmscale.models.hedgemamba import HedgeMambaConfig, HedgeMambaForCausalLM
from hmscale.parallel import apply_compile
from hmscale.parallel.compile import compile_targets


def _model():
    torch.manual_seed(0)
    cfg = HedgeMambaConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           chunk_size=16)
    model = HedgeMambaForCausalLM(cfg)
    with torch.no_grad():  # move the recurrent parts off their identity init so every path is exercised
        for name, p in model.named_parameters():
            if any(k in name for k in ("dt_proj", "A_scale", "z_proj", "conv", "feature_map", ".D")):
                p.add_(0.1 * torch.randn_like(p))
    return model


def test_compile_targets_are_the_blocks():
    model = _model()
    assert [type(m).__name__ for m in compile_targets(model)] == ["HedgeMambaBlock"] * 2
    with pytest.raises(ValueError, match="_no_split_modules"):
        compile_targets(torch.nn.Linear(2, 2))


def test_compiled_blocks_match_eager():
    eager = _model()
    compiled = copy.deepcopy(eager)
    assert apply_compile(compiled) == 2
    assert all(b._compiled_call_impl is not None for b in compile_targets(compiled))
    assert all(b._compiled_call_impl is None for b in compile_targets(eager))
    ids = torch.randint(0, 97, (2, 40))
    seq_idx = torch.tensor([[0] * 25 + [1] * 15, [0] * 40])
    losses, grads = [], []
    for m in (eager, compiled):
        out = m(input_ids=ids, labels=ids, seq_idx=seq_idx)
        out.loss.backward()
        losses.append(out.loss.detach())
        grads.append({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 10
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_stage2_compiles_the_student_when_asked(tmp_path, monkeypatch):
    """parallel.compile=true routes the stage-2 student through apply_compile (recorded, not compiled, for speed)."""
    import numpy as np

    import hmscale.parallel as hp
    from hmscale.config import build_config
    from hmscale.models.convert import to_hedgehog
    from hmscale.teacher.flavors import neox_config
    from hmscale.train.data import ArraySource
    from hmscale.train.stage2 import run_stage2
    from transformers import GPTNeoXForCausalLM

    monkeypatch.setenv("HMSCALE_NO_PROGRESS", "1")
    seen = []
    monkeypatch.setattr(hp, "apply_compile", lambda model, **kw: seen.append(type(model).__name__) or 0)
    torch.manual_seed(0)
    teacher = GPTNeoXForCausalLM(neox_config("pythia-nano", vocab_size=96)).eval()
    tokens = np.random.default_rng(0).integers(0, 96, size=(16, 32))
    for flag, expect in (("false", []), ("true", ["HedgeMambaForCausalLM"])):
        seen.clear()
        cfg = build_config({}, ["stage2.steps=1", "stage2.micro_batch_size=4", "parallel.zero_stage=1",
                                f"parallel.compile={flag}"])
        run_stage2(cfg, tmp_path / flag, student=to_hedgehog(teacher), source=ArraySource(tokens), export=False)
        assert seen == expect
