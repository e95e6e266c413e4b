"""Capture hooks agree with the teacher's own forward (fp32).

- the per-head attention output, through the layer's `attention.dense`, equals the attention module's output
  (rel. error <= 1e-6);
- the captured attention input equals LayerNorm(layer input);
for partial (0.25) and full (1.0) rotary, parallel residual on and off.
"""

import pytest
import torch
from transformers import GPTNeoXForCausalLM

from hmscale.models.neox_attention import softmax_attention
from hmscale.teacher.capture import capture_hooks, capture_layers
from hmscale.teacher.flavors import neox_config


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


def make_teacher(rotary_pct, parallel_residual, seed=0):
    torch.manual_seed(seed)
    cfg = neox_config("pythia-nano", 97, rotary_pct=rotary_pct, use_parallel_residual=parallel_residual,
                      num_hidden_layers=3, hidden_size=64, num_attention_heads=4, intermediate_size=128)
    model = GPTNeoXForCausalLM(cfg).eval()
    with torch.no_grad():  # perturb every parameter so biases and LayerNorm affines are non-trivial
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


@pytest.mark.parametrize("rotary_pct", [0.25, 1.0])
@pytest.mark.parametrize("parallel_residual", [True, False])
def test_capture_matches_forward(rotary_pct, parallel_residual):
    model = make_teacher(rotary_pct, parallel_residual)
    ids = torch.randint(0, 97, (2, 37))
    layers = model.gpt_neox.layers
    seen_in, seen_out, handles = {}, {}, []
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(
            lambda m, a, kw, i=i: seen_in.__setitem__(i, (a[0] if a else kw["hidden_states"]).detach()), with_kwargs=True))
        handles.append(layer.attention.register_forward_hook(
            lambda m, a, out, i=i: seen_out.__setitem__(i, out[0].detach())))
    with torch.no_grad(), capture_hooks(model) as cap:
        logits = model(ids).logits
    for h in handles:
        h.remove()
    assert sorted(cap.results) == [0, 1, 2]
    b, l, H, P = 2, 37, 4, 16
    for i, layer in enumerate(layers):
        c = cap.results[i]
        assert c.attn_input.shape == (b, l, H * P)
        assert c.q.shape == c.k.shape == c.v.shape == c.attn_output.shape == (b, l, H, P)
        with torch.no_grad():
            assert rel_err(c.attn_input, layer.input_layernorm(seen_in[i])) <= 1e-6
            assert rel_err(layer.attention.dense(c.merged_output()), seen_out[i]) <= 1e-6
            # q, k, v recomputed with the students' math give the model's own attention output
            assert rel_err(softmax_attention(c.q, c.k, c.v), c.attn_output) <= 1e-5
    # rotary touches exactly the first rotary_pct of each head's q/k dims
    c0 = cap.results[0]
    qkv = layers[0].attention.query_key_value(c0.attn_input).view(b, l, H, 3 * P)
    r = int(P * rotary_pct)
    assert torch.equal(c0.v, qkv[..., 2 * P:])
    assert torch.equal(c0.q[..., r:], qkv[..., r:P])
    assert not torch.allclose(c0.q[:, 1:, :, :r], qkv[:, 1:, :, :r])
    torch.testing.assert_close(c0.q[:, 0], qkv[:, 0, :, :P])  # position 0: no rotation

    # capture_layers (stops after the last chosen layer) gives the same tensors; the hooks leave logits unchanged
    part = capture_layers(model, ids, layers=[1])
    assert list(part) == [1]
    assert torch.equal(part[1].attn_output, cap.results[1].attn_output)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, logits)
    assert not any(layer.attention._forward_pre_hooks for layer in layers)


def test_capture_bf16_and_bad_layer():
    model = make_teacher(0.25, True).to(torch.bfloat16)
    ids = torch.randint(0, 97, (1, 16))
    caps = capture_layers(model, ids, layers=[-1])
    assert list(caps) == [2] and caps[2].attn_output.dtype == torch.bfloat16
    with pytest.raises(IndexError):
        capture_layers(model, ids, layers=[5])


def test_capture_refuses_incremental_decoding():
    model = make_teacher(0.25, True)
    ids = torch.randint(0, 97, (1, 8))
    with torch.no_grad():
        past = model(ids, use_cache=True).past_key_values
        with pytest.raises(RuntimeError, match="whole sequences"), capture_hooks(model, [0]):
            model(ids[:, -1:], cache=past, use_cache=True)
