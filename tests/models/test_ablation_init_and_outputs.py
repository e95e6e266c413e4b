"""Every component ablation starts stage 2 from the stage-1 student; hidden states and config fields as transformers has them."""

import itertools

import pytest
import torch
from transformers import GPTNeoXForCausalLM

from hmscale.models import HedgeMambaConfig, HedgeMambaForCausalLM
from hmscale.models.convert import compare_logits, hedgemamba_config_from_teacher, to_hedgehog, to_hedgemamba
from hmscale.teacher.flavors import neox_config

VOCAB = 97


def _teacher(**overrides):
    torch.manual_seed(0)
    return GPTNeoXForCausalLM(neox_config("pythia-nano", vocab_size=VOCAB, **overrides)).eval()


@pytest.mark.parametrize("gate,conv", list(itertools.product([True, False], [True, False])))
def test_gate_is_identity_at_init_without_ssm(gate, conv):
    # transformers skipped the init of a mixer with no parameters of its own (ssm=False), leaving z_proj random
    cfg = HedgeMambaConfig(vocab_size=VOCAB, hidden_size=40, num_hidden_layers=2, num_attention_heads=5,
                           gate=gate, conv=conv, ssm=False)
    model = HedgeMambaForCausalLM(cfg)
    for block in model.backbone.layers:
        if gate:
            assert block.mixer.z_proj.weight.abs().max() == 0 and block.mixer.z_proj.bias.abs().max() == 0


@pytest.mark.parametrize("ssm", [True, False])
def test_ablations_with_normaliser_start_from_the_student(ssm):
    student = to_hedgehog(_teacher(hidden_size=40, num_attention_heads=5, intermediate_size=80))
    model = to_hedgemamba(student, components=dict(gate=True, conv=True, ssm=ssm, normalize=True)).eval()
    diff = compare_logits(student.eval(), model, torch.randint(0, VOCAB, (2, 21)))
    assert diff["max_abs"] == 0.0, diff


def test_loaded_gate_weights_are_not_reinitialised(tmp_path):
    cfg = HedgeMambaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, ssm=False)
    model = HedgeMambaForCausalLM(cfg)
    with torch.no_grad():
        model.backbone.layers[0].mixer.z_proj.weight.fill_(0.25)
    model.save_pretrained(tmp_path)
    loaded = HedgeMambaForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(loaded.backbone.layers[0].mixer.z_proj.weight, model.backbone.layers[0].mixer.z_proj.weight)


def test_last_hidden_state_is_after_final_layernorm_like_the_teacher():
    teacher = _teacher()
    student = to_hedgehog(teacher).eval()
    model = to_hedgemamba(student).eval()
    ids = torch.randint(0, VOCAB, (2, 11))
    with torch.no_grad():
        t = teacher(ids, output_hidden_states=True)
        s = student(ids, output_hidden_states=True)
        m = model(ids, output_hidden_states=True)
    for out, head in ((t, teacher.get_output_embeddings()), (s, teacher.get_output_embeddings()), (m, model.lm_head)):
        assert len(out.hidden_states) == teacher.config.num_hidden_layers + 1
        torch.testing.assert_close(head(out.hidden_states[-1]), out.logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(s.hidden_states[-1], m.hidden_states[-1], rtol=0, atol=1e-5)


def test_pad_token_id_survives_conversion():
    teacher = _teacher(pad_token_id=1)
    assert hedgemamba_config_from_teacher(teacher.config).pad_token_id == 1


def test_bare_config_has_pad_token_id(tmp_path):
    cfg = HedgeMambaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2)
    assert cfg.pad_token_id is None  # transformers 5 raised AttributeError for an unset one
    cfg.pad_token_id = 3
    cfg.save_pretrained(tmp_path)
    assert HedgeMambaConfig.from_pretrained(tmp_path).pad_token_id == 3
