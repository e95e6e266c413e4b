"""Edge cases of the teacher helpers a user can reach: an out-of-range negative capture layer, a pretraining that made
no step, rotary overrides of `neox_config` in transformers 5's names, a damaged weight file."""

import numpy as np
import pytest
import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

from hmscale.models.neox_attention import rope_theta, rotary_fraction
from hmscale.teacher.capture import capture_hooks, capture_layers
from hmscale.teacher.flavors import neox_config
from hmscale.teacher.load import load_teacher
from hmscale.teacher.pretrain import pretrain_teacher


def _tiny(**kw):
    torch.manual_seed(0)
    base = dict(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=64,
                max_position_embeddings=128, bos_token_id=0, eos_token_id=0)
    base.update(kw)
    return GPTNeoXForCausalLM(GPTNeoXConfig(**base)).eval()


def test_negative_capture_layers_past_the_first_are_out_of_range():
    """layers=[-4] on a 3-layer teacher wrapped around to layer 2 (-4 % 3) and captured it silently."""
    model = _tiny()
    ids = torch.arange(10)[None]
    assert list(capture_layers(model, ids, layers=[-1])) == [2]
    assert list(capture_layers(model, ids, layers=[-3])) == [0]
    for bad in ([-4], [-7, 0], [3]):
        with pytest.raises(IndexError, match="out of range"):
            capture_layers(model, ids, layers=bad)
    layers = model.gpt_neox.layers
    assert not any(layer.attention._forward_pre_hooks or layer.attention.dense._forward_pre_hooks for layer in layers)


def test_capture_leaves_no_hooks_after_an_error_in_the_forward():
    model = _tiny()
    with pytest.raises(IndexError):  # a token id past the vocabulary fails inside the forward
        capture_layers(model, torch.tensor([[1, 2, 999]]), layers=[0, 2])
    with pytest.raises(RuntimeError, match="boom"), torch.no_grad(), capture_hooks(model, [1]):
        raise RuntimeError("boom")
    layers = model.gpt_neox.layers
    assert not any(layer.attention._forward_pre_hooks or layer.attention.dense._forward_pre_hooks for layer in layers)


@pytest.mark.parametrize("kw", [dict(steps=0), dict(steps=5, seconds=1e-9)])
def test_pretraining_that_made_no_step_returns_instead_of_crashing_in_its_log(kw):
    """teacher.pretrain_steps=0 (allowed) or a time cap spent before the first step, without validation rows:
    the closing log line formatted final_loss=None with :.3f and raised TypeError."""
    toks = np.random.default_rng(0).integers(0, 64, size=(16, 16)).astype(np.int32)
    lines = []
    model, stats = pretrain_teacher("pythia-nano", 64, toks, batch_size=4, log=lines.append, **kw)
    assert stats["steps"] == 0 and stats["final_loss"] is None and not model.training
    assert "0 steps" in lines[-1]


def test_neox_config_keeps_rotary_overrides_in_transformers_5_names():
    """neox_config(..., partial_rotary_factor=1.0) or rope_parameters={...} gave the flavour's 0.25 instead."""
    assert rotary_fraction(neox_config("pythia-nano", 64)) == 0.25
    assert rotary_fraction(neox_config("pythia-nano", 64, rotary_pct=0.5)) == 0.5
    assert rotary_fraction(neox_config("pythia-nano", 64, partial_rotary_factor=1.0)) == 1.0
    cfg = neox_config("pythia-nano", 64, rope_parameters={"rope_type": "default", "rope_theta": 500.0,
                                                          "partial_rotary_factor": 1.0})
    assert rotary_fraction(cfg) == 1.0 and rope_theta(cfg) == 500.0
    cfg = neox_config("pythia-nano", 64, rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    assert rotary_fraction(cfg) == 0.25 and rope_theta(cfg) == 500.0  # no fraction given: the flavour's
    assert rope_theta(neox_config("pythia-nano", 64, rotary_emb_base=20000.0)) == 20000.0
    # the model built from it rotates what the config says (the capture reads the same config)
    model = GPTNeoXForCausalLM(neox_config("pythia-nano", 64, partial_rotary_factor=1.0))
    assert model.gpt_neox.layers[0].attention.rotary_ndims == 16


@pytest.mark.parametrize("damage", ["truncated", "empty"])
def test_a_damaged_safetensors_file_is_refused_in_one_line(tmp_path, damage):
    """A partly copied or downloaded model.safetensors raised safetensors' SafetensorError, which no command catches
    (a traceback naming neither the teacher nor the file)."""
    _tiny().save_pretrained(tmp_path / "t")
    f = tmp_path / "t" / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"")
    with pytest.raises(ValueError) as err:
        load_teacher(tmp_path / "t")
    msg = str(err.value)
    assert "\n" not in msg and "teacher.name_or_path" in msg and str(tmp_path / "t") in msg
    assert "damaged or incomplete" in msg
