"""Teacher directories that transformers 5 cannot build, refused by `load_teacher` in one line naming the teacher and
what is wrong (the commands print a ValueError's first line). Before: a config.json whose rope type transformers does
not know was a bare KeyError (a traceback from `hmscale cache`); a damaged shard index (a partial copy) a bare
JSONDecodeError naming no file; a config field of the wrong type or a hidden size the heads do not divide was
huggingface_hub's StrictDataclassError (not a ValueError: a traceback), two lines."""

import json

import pytest
import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

from hmscale.teacher.load import load_teacher


def _save(path, **kw):
    torch.manual_seed(0)
    base = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                max_position_embeddings=128, bos_token_id=0, eos_token_id=0)
    base.update(kw)
    GPTNeoXForCausalLM(GPTNeoXConfig(**base)).save_pretrained(path, max_shard_size="20KB")
    return path


def _edit_config(path, **fields):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(fields)
    (path / "config.json").write_text(json.dumps(cfg))


def _one_line(err, path, *words):
    msg = str(err.value)
    assert "\n" not in msg and "teacher.name_or_path" in msg and str(path) in msg, msg
    for w in words:
        assert w in msg, msg
    return msg


@pytest.mark.parametrize("rope", [{"rope_type": "wat", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
                                  {"type": "wat", "factor": 2.0}])
def test_a_rope_type_transformers_does_not_know_is_refused_in_one_line(tmp_path, rope):
    path = _save(tmp_path / "t")
    key = "rope_parameters" if "rope_type" in rope else "rope_scaling"  # transformers 5's name, or the legacy one
    _edit_config(path, **{key: rope})
    with pytest.raises(ValueError) as err:
        load_teacher(path)
    _one_line(err, path, "rope_type='wat'")


def test_a_damaged_shard_index_is_refused_in_one_line_naming_it(tmp_path):
    path = _save(tmp_path / "t")
    index = path / "model.safetensors.index.json"
    assert index.exists()
    index.write_text(index.read_text()[:40])  # a partial copy
    with pytest.raises(ValueError) as err:
        load_teacher(path)
    _one_line(err, path, "damaged or incomplete")


@pytest.mark.parametrize("fields, word", [({"layer_norm_eps": "1e-5"}, "layer_norm_eps"),
                                          ({"num_attention_heads": 3}, "hidden size")])
def test_a_config_transformers_refuses_is_one_line(tmp_path, fields, word):
    path = _save(tmp_path / "t")
    _edit_config(path, **fields)
    with pytest.raises(ValueError) as err:
        load_teacher(path)
    _one_line(err, path, "config.json", word)
