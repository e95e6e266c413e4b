"""HedgeMambaConfig refuses a model that cannot be built or run, in one line naming the field, when the config is made
(by hand, or by ``from_pretrained`` from an edited config.json): before, ``num_attention_heads=0`` raised
ZeroDivisionError from the check meant to catch it, ``feature_dim=0`` silently became head_dim, and the others failed
later, deep in the model (IndexError for ``conv_width=0``, ``math domain error`` in the first forward for
``dt_min=0``, a shape mismatch for ``rotary_pct > 1``), or never (``dt_min > dt_max`` pinned dt to dt_max)."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import hmscale.models  # noqa: F401  (registers the Auto classes)
from hmscale.models.hedgemamba import HedgeMambaConfig, HedgeMambaForCausalLM

TINY = dict(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64)

BAD = [
    ({"num_attention_heads": 0}, "num_attention_heads"),
    ({"hidden_size": 30}, "hidden_size"),
    ({"feature_dim": 0}, "feature_dim"),
    ({"feature_dim": -3}, "feature_dim"),
    ({"conv_width": 0}, "conv_width"),
    ({"chunk_size": 0}, "chunk_size"),
    ({"rotary_pct": 1.5}, "rotary_pct"),
    ({"rotary_pct": -0.5}, "rotary_pct"),
    ({"dt_min": 0.0}, "dt_min"),
    ({"dt_min": 10.0, "dt_max": 1.0}, "dt_min"),
    ({"hidden_act": "nope"}, "hidden_act"),
    ({"vocab_size": 0}, "vocab_size"),
    ({"intermediate_size": -1}, "intermediate_size"),
]


@pytest.mark.parametrize("bad,field", BAD, ids=[next(iter(b)) + "=" + str(next(iter(b.values()))) for b, _ in BAD])
def test_impossible_configs_are_one_line_errors_naming_the_field(bad, field):
    with pytest.raises(ValueError, match=field) as e:
        HedgeMambaConfig(**{**TINY, **bad})
    assert "\n" not in str(e.value)


def test_an_edited_config_json_is_refused_at_load(tmp_path):
    HedgeMambaForCausalLM(HedgeMambaConfig(**TINY)).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["conv_width"] = 0
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="conv_width"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


@pytest.mark.parametrize("good", [{}, {"feature_dim": None}, {"feature_dim": 3}, {"conv_width": 1}, {"rotary_pct": 0.0},
                                  {"rotary_pct": 1.0}, {"dt_min": 0.5, "dt_max": 0.5}, {"chunk_size": 48},
                                  {"gate": False, "conv": False, "ssm": False, "normalize": False}])
def test_the_limits_themselves_still_build_and_run(good):
    cfg = HedgeMambaConfig(**{**TINY, **good})
    model = HedgeMambaForCausalLM(cfg).eval()
    with torch.no_grad():
        logits = model(torch.randint(0, cfg.vocab_size, (1, 9))).logits
    assert logits.shape == (1, 9, cfg.vocab_size) and bool(torch.isfinite(logits).all())


def test_conversion_refuses_a_teacher_it_cannot_map_in_one_line():
    """``to_hedgehog`` took any model: a GPT-2 or a GPT-NeoX backbone without its LM head became a student that failed
    at its first forward (AttributeError 'gpt_neox'), and ``feature_dim=0`` silently became head_dim."""
    from transformers import GPT2Config, GPT2LMHeadModel, GPTNeoXForCausalLM, GPTNeoXModel

    from hmscale.models.convert import to_hedgehog
    from hmscale.teacher.flavors import neox_config

    neox = neox_config("pythia-nano", vocab_size=50)
    for teacher, name in ((GPT2LMHeadModel(GPT2Config(vocab_size=50, n_embd=32, n_layer=1, n_head=2)), "GPT2LMHeadModel"),
                          (GPTNeoXModel(neox), "GPTNeoXModel")):
        with pytest.raises(TypeError, match=f"GPTNeoXForCausalLM.*got {name}") as e:
            to_hedgehog(teacher)
        assert "\n" not in str(e.value)
    for bad in (0, -2):
        with pytest.raises(ValueError, match="feature_dim") as e:
            to_hedgehog(GPTNeoXForCausalLM(neox), feature_dim=bad)
        assert "\n" not in str(e.value)
