"""Exact init: HedgeMamba at init computes the Hedgehog student's logits (fp32, CPU), every component on."""

import pytest
import torch
from transformers import GPTNeoXForCausalLM

from hmscale.models.convert import compare_logits, to_hedgehog, to_hedgemamba
from hmscale.models.hedgehog import hedgehog_layer_output, hedgehog_loss
from hmscale.teacher.flavors import neox_config

VOCAB = 97


def make_teacher(rotary_pct=0.25, parallel=True, heads=4, hidden=64, layers=2, seed=0):
    torch.manual_seed(seed)
    cfg = neox_config("pythia-nano", vocab_size=VOCAB, rotary_pct=rotary_pct, use_parallel_residual=parallel,
                      num_attention_heads=heads, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers)
    return GPTNeoXForCausalLM(cfg).eval()


def randomise_feature_maps(student, scale=0.5):
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for fm in student.feature_maps:
            fm.weight.add_(scale * torch.randn(fm.weight.shape, generator=g).to(fm.weight.device))
            fm.bias.copy_(0.3 * torch.randn(fm.bias.shape, generator=g).to(fm.bias.device))


@pytest.mark.parametrize("rotary_pct", [0.25, 1.0])
@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("heads", [2, 4, 8])
def test_hedgemamba_init_equals_hedgehog(rotary_pct, parallel, heads):
    teacher = make_teacher(rotary_pct, parallel, heads)
    student = to_hedgehog(teacher)
    randomise_feature_maps(student)
    model = to_hedgemamba(student).eval()
    assert all([model.config.gate, model.config.conv, model.config.ssm, model.config.normalize])
    ids = torch.randint(0, VOCAB, (2, 83))  # not a multiple of the chunk (64)
    diff = compare_logits(student, model, ids)
    assert diff["max_rel"] <= 1e-4, diff
    # and the students are not trivially the teacher
    assert compare_logits(teacher, student, ids)["max_abs"] > 1e-4


@pytest.mark.parametrize("feature_dim", [8, 32])
def test_exact_init_other_feature_dims(feature_dim):
    teacher = make_teacher(heads=4)  # head_dim 16
    student = to_hedgehog(teacher, feature_dim=feature_dim)
    randomise_feature_maps(student)
    model = to_hedgemamba(student).eval()
    assert model.config.feature_dim == feature_dim
    assert model.backbone.layers[0].mixer.feature_map.weight.shape == (4, feature_dim, 16)
    ids = torch.randint(0, VOCAB, (2, 40))
    assert compare_logits(student, model, ids)["max_rel"] <= 1e-4


def test_exact_init_with_seq_idx():
    teacher = make_teacher()
    student = to_hedgehog(teacher)
    randomise_feature_maps(student)
    model = to_hedgemamba(student).eval()
    ids = torch.randint(0, VOCAB, (2, 70))
    seq_idx = torch.zeros(2, 70, dtype=torch.int32)
    seq_idx[0, 30:] = 1
    seq_idx[1, 50:] = 7
    diff = compare_logits(student, model, ids, seq_idx=seq_idx)
    assert diff["max_rel"] <= 1e-4
    # documents are independent: the second document of row 0 equals running it alone (positions restart)
    with torch.no_grad():
        pos = torch.cat([torch.arange(30), torch.arange(40)])[None].expand(2, -1)
        packed = model(ids, seq_idx=seq_idx, position_ids=pos).logits[0, 30:]
        alone = model(ids[:1, 30:]).logits[0]
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)


def test_identity_values_are_exact():
    model = to_hedgemamba(to_hedgehog(make_teacher()))
    mx = model.backbone.layers[0].mixer
    h = torch.randn(2, 5, 64)
    dt, A, D = mx.ssm_parameters(h)
    assert torch.equal(dt, torch.ones_like(dt))
    assert torch.equal(torch.exp(dt[..., :1] * A), torch.ones(2, 5, 4))
    assert torch.equal(D, torch.zeros(4))
    assert torch.equal(2 * torch.sigmoid(mx.z_proj(h)), torch.ones(2, 5, 64))
    x = torch.randn(2, 9, 192)
    y, _ = mx.conv(x)
    assert torch.equal(y, x)


def test_student_shares_teacher_weights_and_trains_only_phi():
    teacher = make_teacher()
    student = to_hedgehog(teacher)
    trainable = {n for n, p in student.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith("feature_maps.") for n in trainable)
    assert student.teacher.gpt_neox.embed_in.weight.data_ptr() == teacher.gpt_neox.embed_in.weight.data_ptr()
    ids = torch.randint(0, VOCAB, (2, 20))
    out = student(ids, labels=ids)
    assert out.logits.shape == (2, 20, VOCAB) and out.loss.ndim == 0
    out.loss.backward()
    assert all(p.grad is not None for p in student.feature_maps.parameters())
    assert all(p.grad is None for p in teacher.parameters())


def test_layer_output_matches_teacher_attention_and_linear_attention():
    """o_teacher is the teacher's own attention output; o_lin is normalised linear attention with phi."""
    teacher = make_teacher(rotary_pct=0.25, heads=4)
    student = to_hedgehog(teacher)
    randomise_feature_maps(student)
    ids = torch.randint(0, VOCAB, (2, 24))
    captured = {}
    layer = teacher.gpt_neox.layers[1]
    h1 = layer.attention.dense.register_forward_pre_hook(lambda m, a: captured.__setitem__("o", a[0]))
    h2 = layer.input_layernorm.register_forward_hook(lambda m, a, o: captured.__setitem__("x", o))
    with torch.no_grad():
        teacher(ids)
    h1.remove(), h2.remove()
    o_lin, o_t = hedgehog_layer_output(layer.attention, student.feature_maps[1], captured["x"], teacher.config)
    torch.testing.assert_close(o_t.reshape(2, 24, -1), captured["o"], rtol=1e-5, atol=1e-5)
    # linear attention by its definition (quadratic, test only)
    from hmscale.models.neox_attention import qkv_with_rotary

    q, k, v = qkv_with_rotary(layer.attention, captured["x"], teacher.config)
    fq, fk = student.feature_maps[1](q), student.feature_maps[1](k)
    s = torch.einsum("bthn,bshn->bhts", fq, fk).tril()
    ref = torch.einsum("bhts,bshp->bthp", s, v) / s.sum(-1).transpose(1, 2)[..., None]
    torch.testing.assert_close(o_lin, ref, rtol=1e-5, atol=1e-5)
    # the loss: zero against itself, positive against the teacher, gradient reaches phi only
    assert float(hedgehog_loss(o_t, o_t)) < 1e-6
    loss = hedgehog_loss(o_lin, o_t)
    assert 0 < float(loss.detach()) < 2
    loss.backward()
    assert student.feature_maps[1].weight.grad is not None and layer.attention.query_key_value.weight.grad is None
