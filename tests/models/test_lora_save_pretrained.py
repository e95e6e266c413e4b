"""A HedgeMamba with LoRA adapters, saved with its own ``save_pretrained`` (not through the recipe's ``export_hf``),
is the model it computes: the adapters are folded in, as ``lora.merged_state_dict`` folds them for the recipe's
export. It was saved with the base weights and the ``lora_A`` / ``lora_B`` entries, which ``from_pretrained`` drops
(a load report, no error): the loaded model was the model before LoRA training."""

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, GPTNeoXForCausalLM

import hmscale.models  # noqa: F401  (registers the Auto classes)
from hmscale.models.convert import to_hedgehog, to_hedgemamba
from hmscale.models.lora import LoRALinear, apply_lora
from hmscale.teacher.flavors import neox_config

VOCAB = 97


def _lora_model(targets, tie=False):
    torch.manual_seed(0)
    model = to_hedgemamba(to_hedgehog(GPTNeoXForCausalLM(neox_config("pythia-nano", vocab_size=VOCAB)).eval())).eval()
    if tie:
        model.config.tie_word_embeddings = True
        model.tie_weights()
    apply_lora(model, targets, rank=4, alpha=8.0, seed=1)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():  # trained adapters: B away from zero
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_B.copy_(0.1 * torch.randn(m.lora_B.shape, generator=g))
    return model


def test_save_pretrained_folds_the_adapters_in(tmp_path):
    model = _lora_model(["in_proj", "out_proj", "z_proj", "lm_head"])
    ids = torch.randint(1, VOCAB, (2, 30), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model(ids).logits
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.save_pretrained(tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert not any("lora" in k for k in saved)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert not any(isinstance(m, LoRALinear) for m in loaded.modules())
    with torch.no_grad():
        got = loaded(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the in-memory model keeps its adapters and its unmerged weights (saving does not fold them into it)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_a_given_state_dict_with_adapters_is_folded_too(tmp_path):
    model = _lora_model(["in_proj"])
    ids = torch.randint(1, VOCAB, (1, 20), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = model(ids).logits
    model.save_pretrained(tmp_path, state_dict={k: v.clone() for k, v in model.state_dict().items()})
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(tmp_path).eval()(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_an_adapter_on_a_tied_lm_head_is_refused_in_one_line(tmp_path):
    model = _lora_model(["lm_head"], tie=True)
    with pytest.raises(ValueError, match="lm_head.*tied") as e:
        model.save_pretrained(tmp_path)
    assert "\n" not in str(e.value)
