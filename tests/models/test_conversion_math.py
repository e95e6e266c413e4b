"""Conversions and their math (tiny GPT-NeoX configs built locally, CPU, fp32).

Checked on the walk (no bug found in these; kept as regression tests over configs the earlier walks did not build):
- the stage-1 student reads every teacher weight where the teacher does: with its linear attention swapped for the
  softmax attention of the same q, k, v, it gives the HF teacher's logits, for sequential residuals, rotary_pct 0 /
  0.5 / 1 and an odd rotary width, no attention bias, tied embeddings, 1 and 5 heads, another rope base, relu;
- HedgeMamba at its exact init gives the stage-1 student's logits bit for bit on those configs, with trained
  (perturbed) feature maps of F = P, F < P and F > P, packed documents (int64 seq_idx, a document id that comes back)
  and given positions;
- the student's linear attention is the recipe's quadratic formula (per document), phi = softmax([Wu+b, -(Wu+b)]);
- LoRA adapters folded by merged_state_dict into a plain HedgeMamba (no attention bias, lm_head adapted) give the
  adapted model's logits.
"""

import pytest
import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

import hmscale.models.hedgehog as hedgehog_mod
from hmscale.models.convert import compare_logits, to_hedgehog, to_hedgemamba
from hmscale.models.feature_map import HedgehogFeatureMap
from hmscale.models.hedgehog import HedgehogForCausalLM, linear_attention
from hmscale.models.neox_attention import qkv_with_rotary, softmax_attention

VOCAB = 61

VARIANTS = [
    dict(),
    dict(use_parallel_residual=False),
    dict(rotary_pct=1.0),
    dict(rotary_pct=0.0),
    dict(hidden_size=28, num_attention_heads=2, rotary_pct=0.25),  # head_dim 14: 3 rotary dims (odd)
    dict(attention_bias=False),
    dict(tie_word_embeddings=True),
    dict(num_attention_heads=1),
    dict(hidden_size=30, num_attention_heads=5),
    dict(rotary_emb_base=500.0, use_parallel_residual=False),
    dict(hidden_act="relu", layer_norm_eps=1e-2),
]


def _teacher(seed=0, **kw):
    base = dict(vocab_size=VOCAB, hidden_size=24, num_hidden_layers=2, num_attention_heads=3, intermediate_size=40,
                max_position_embeddings=128, rotary_pct=0.5)
    base.update(kw)
    torch.manual_seed(seed)
    teacher = GPTNeoXForCausalLM(GPTNeoXConfig(**base)).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # biases and LayerNorms away from 0 / 1, so a misplaced one shows
        for p in teacher.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return teacher


def _ids(rows=2, length=23, seed=3):
    return torch.randint(0, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: ",".join(f"{k}={w}" for k, w in v.items()) or "pythia")
def test_student_with_softmax_attention_is_the_teacher(monkeypatch, variant):
    teacher = _teacher(**variant)
    student = to_hedgehog(teacher)

    def softmax_layer_output(attn_module, feature_map, attn_input, config, position_ids=None, seq_idx=None,
                             with_teacher=True, chunk_size=64):
        q, k, v = qkv_with_rotary(attn_module, attn_input, config, position_ids)
        return softmax_attention(q, k, v), None

    monkeypatch.setattr(hedgehog_mod, "hedgehog_layer_output", softmax_layer_output)
    ids = _ids()
    with torch.no_grad():
        want = teacher(ids).logits
        got = student(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: ",".join(f"{k}={w}" for k, w in v.items()) or "pythia")
def test_hedgemamba_init_is_the_student_bit_for_bit(variant):
    teacher = _teacher(**variant)
    head_dim = teacher.config.hidden_size // teacher.config.num_attention_heads
    seq = torch.tensor([[0] * 8 + [1] * 9 + [0] * 6, [0] * 3 + [2] * 20])  # int64; id 0 comes back in row 0
    pos = torch.randint(0, 100, (2, 23), generator=torch.Generator().manual_seed(7))
    for fd in (None, max(1, head_dim - 3), head_dim + 3):
        student = HedgehogForCausalLM(teacher, feature_dim=fd, chunk_size=8)
        g = torch.Generator().manual_seed(11)
        with torch.no_grad():  # as after stage 1
            for p in student.feature_maps.parameters():
                p.add_(0.3 * torch.randn(p.shape, generator=g))
        model = to_hedgemamba(student).eval()
        for kw in (dict(), dict(seq_idx=seq), dict(position_ids=pos)):
            r = compare_logits(student, model, _ids(), **kw)
            assert r["max_abs"] == 0.0, (fd, kw, r)


def test_linear_attention_is_the_recipes_quadratic_formula():
    b, l, h, p = 2, 37, 3, 8
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, l, h, p, generator=g) for _ in range(3))
    seq = torch.tensor([[0] * 15 + [1] * 22, [0] * 4 + [1] * 33], dtype=torch.int32)
    for F in (p, p - 3, p + 4):
        fm = HedgehogFeatureMap(h, p, F)
        with torch.no_grad():
            fm.weight.add_(0.3 * torch.randn(fm.weight.shape, generator=g))
            fm.bias.add_(0.3 * torch.randn(fm.bias.shape, generator=g))

        def phi(u):
            z = torch.einsum("blhp,hfp->blhf", u.double(), fm.weight.double()) + fm.bias.double()
            return torch.softmax(torch.cat([z, -z], -1), -1)

        with torch.no_grad():
            torch.testing.assert_close(fm(q).double(), phi(q), rtol=1e-6, atol=1e-7)
            for s in (None, seq):
                got = linear_attention(fm(q), fm(k), v, seq_idx=s, chunk_size=8)
                scores = torch.einsum("bthn,bshn->bhts", phi(q), phi(k))
                mask = torch.ones(l, l, dtype=torch.bool).tril()[None, None]
                if s is not None:
                    mask = mask & (s[:, None, :, None] == s[:, None, None, :])
                scores = scores * mask
                want = torch.einsum("bhts,bshp->bthp", scores, v.double()) / scores.sum(-1).transpose(1, 2)[..., None]
                torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def test_lora_folded_into_a_plain_hedgemamba_gives_the_adapted_logits():
    from hmscale.models.hedgemamba import HedgeMambaForCausalLM
    from hmscale.models.lora import apply_lora, is_lora_param, merged_state_dict

    teacher = _teacher(attention_bias=False)
    model = to_hedgemamba(to_hedgehog(teacher)).eval()
    plain = HedgeMambaForCausalLM(model.config).eval()
    wrapped = apply_lora(model, ["in_proj", "out_proj", "dense_4h_to_h", "lm_head"], rank=3, alpha=6.0, seed=1)
    assert len(wrapped) == 2 * 3 + 1
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    merged = merged_state_dict(model, model.state_dict())
    assert not any(is_lora_param(k) for k in merged)
    plain.load_state_dict(merged, strict=True)
    ids = _ids()
    with torch.no_grad():
        want, got = model(ids).logits, plain(ids).logits
        assert float((want - to_hedgemamba(to_hedgehog(teacher)).eval()(ids).logits).abs().max()) > 1e-3
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
