"""A checkpoint holding weights its config.json does not use loaded as another, smaller model without a word:
transformers drops them as "unexpected" (a table on stderr). A config.json from a model of the same width but fewer
layers (pythia-1b's beside pythia-1.4b's weights: every shape matches) gave a truncated teacher; attention_bias=false
beside weights with attention biases gave a teacher without them. Refused in one line, naming what is dropped."""

import json

import pytest
import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

from hmscale.teacher.load import load_teacher


def _save(path, **kw):
    torch.manual_seed(0)
    base = dict(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=64,
                max_position_embeddings=128, bos_token_id=0, eos_token_id=0)
    base.update(kw)
    GPTNeoXForCausalLM(GPTNeoXConfig(**base)).save_pretrained(path)
    return path


@pytest.mark.parametrize("fields, dropped", [({"num_hidden_layers": 2}, "gpt_neox.layers.2."),
                                             ({"attention_bias": False}, "attention.dense.bias")])
def test_weights_the_config_does_not_use_are_refused_in_one_line(tmp_path, fields, dropped):
    path = _save(tmp_path / "t")
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(fields)
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as err:
        load_teacher(path)
    msg = str(err.value)
    assert "\n" not in msg and "teacher.name_or_path" in msg and str(path) in msg and dropped in msg, msg
    assert "config.json" in msg
