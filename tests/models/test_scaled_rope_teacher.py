"""A GPT-NeoX teacher with a scaled rotary embedding (linear, dynamic, yarn: transformers 5 supports them) handed to
the students or the capture directly, not through `load_teacher` (which refuses it): the capture's q, k and both
students recompute the plain rotary, so they were silently not the teacher's (the capture's q, k gave another
attention output than the teacher's own, and HedgeMamba's config dropped the scaling)."""

import pytest
import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

from hmscale.models.convert import hedgemamba_config_from_teacher, to_hedgehog, to_mixer_student
from hmscale.teacher.capture import capture_hooks, capture_layers

SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0},
}


def _teacher(rope_scaling):
    torch.manual_seed(0)
    cfg = GPTNeoXConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                        max_position_embeddings=16, rotary_pct=1.0, rope_scaling=rope_scaling)
    return GPTNeoXForCausalLM(cfg).eval()


def _one_line(err, kind):
    msg = str(err.value)
    assert "\n" not in msg and f"rope_type={kind!r}" in msg, msg
    return msg


@pytest.mark.parametrize("kind", list(SCALINGS))
def test_students_refuse_a_scaled_rotary_teacher(kind):
    teacher = _teacher(SCALINGS[kind])
    for build in (to_hedgehog, to_mixer_student):
        with pytest.raises(ValueError) as err:
            build(teacher)
        _one_line(err, kind)
    with pytest.raises(ValueError) as err:
        hedgemamba_config_from_teacher(teacher.config)
    _one_line(err, kind)


@pytest.mark.parametrize("kind", list(SCALINGS))
def test_capture_of_q_k_refuses_a_scaled_rotary_teacher_and_leaves_no_hooks(kind):
    teacher = _teacher(SCALINGS[kind])
    ids = torch.arange(40)[None] % 64  # past max_position_embeddings: where dynamic and yarn scale too
    with pytest.raises(ValueError) as err:
        capture_layers(teacher, ids)
    _one_line(err, kind)
    with pytest.raises(ValueError):
        capture_hooks(teacher)
    layers = teacher.gpt_neox.layers
    assert not any(layer.attention._forward_pre_hooks or layer.attention.dense._forward_pre_hooks for layer in layers)
    # without q, k the capture is what the teacher itself computed: still allowed
    caps = capture_layers(teacher, ids, qkv=False)
    assert sorted(caps) == [0, 1] and caps[0].q is None
