"""fused_ops against the plain-PyTorch code they replace: outputs and every gradient, random inputs."""

import pytest
import torch

from hmscale.models.fused_ops import causal_depthwise_conv, split_qkv_rotary
from hmscale.models.hedgemamba import CausalDepthwiseConv
from hmscale.models.neox_attention import apply_rotary, rotary_cos_sin, split_qkv


def _reference_split_rotary(qkv, h, cos, sin):
    q, k, v = split_qkv(qkv, h)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("p,r", [(16, 4), (16, 16), (8, 2)])
def test_split_qkv_rotary_matches_reference(dtype, tol, p, r):
    torch.manual_seed(0)
    b, l, h = 2, 7, 3
    qkv = torch.randn(b, l, 3 * h * p, dtype=dtype, requires_grad=True)
    positions = torch.arange(l)[None, :] + 5
    cos, sin = rotary_cos_sin(positions, r, 10000.0, dtype=dtype)
    outs = split_qkv_rotary(qkv, h, cos, sin)
    qkv_ref = qkv.detach().clone().requires_grad_(True)
    refs = _reference_split_rotary(qkv_ref, h, cos, sin)
    for o, ref in zip(outs, refs):
        assert o.shape == ref.shape == (b, l, h, p)
        torch.testing.assert_close(o.float(), ref.float(), atol=tol, rtol=tol)
    grads = [torch.randn_like(o) for o in outs]
    torch.autograd.backward(outs, grads)
    torch.autograd.backward(refs, grads)
    torch.testing.assert_close(qkv.grad.float(), qkv_ref.grad.float(), atol=tol, rtol=tol)
    # some outputs unused: the missing gradients count as zero
    qkv.grad = None
    q, _, _ = split_qkv_rotary(qkv, h, cos, sin)
    q.sum().backward()
    qkv_ref.grad = None
    _reference_split_rotary(qkv_ref, h, cos, sin)[0].sum().backward()
    torch.testing.assert_close(qkv.grad.float(), qkv_ref.grad.float(), atol=tol, rtol=tol)


def _reference_conv(module, x, prev):
    """The module's own loop (the document-aware path, without documents)."""
    W, l = module.width, x.shape[1]
    xp = torch.cat([prev, x], dim=1)
    w = module.weight.to(x.dtype)
    y = xp[:, W - 1:] * w[:, W - 1]
    for j in range(W - 1):
        y = y + xp[:, j:j + l] * w[:, j]
    return y + module.bias.to(x.dtype), xp[:, -(W - 1):]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("width", [2, 4])
def test_causal_depthwise_conv_matches_reference(dtype, tol, width):
    torch.manual_seed(1)
    b, l, c = 2, 9, 6
    conv = CausalDepthwiseConv(c, width)
    with torch.no_grad():
        conv.weight.normal_()
        conv.bias.normal_()
    x = torch.randn(b, l, c, dtype=dtype, requires_grad=True)
    prev = torch.randn(b, width - 1, c, dtype=dtype, requires_grad=True)
    y, state = causal_depthwise_conv(x, prev, conv.weight, conv.bias)
    g, gs = torch.randn_like(y), torch.randn_like(state)
    torch.autograd.backward([y, state], [g, gs])
    got = [x.grad, prev.grad, conv.weight.grad, conv.bias.grad]
    for t in (x, prev, conv.weight, conv.bias):
        t.grad = None
    y_ref, state_ref = _reference_conv(conv, x, prev)
    torch.autograd.backward([y_ref, state_ref], [g, gs])
    want = [x.grad, prev.grad, conv.weight.grad, conv.bias.grad]
    torch.testing.assert_close(y.float(), y_ref.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(state, state_ref)
    for a, e in zip(got, want):
        torch.testing.assert_close(a.float(), e.float(), atol=tol * 4, rtol=tol)


def test_conv_module_uses_the_same_math_with_and_without_documents():
    torch.manual_seed(2)
    conv = CausalDepthwiseConv(5, 4)
    with torch.no_grad():
        conv.weight.normal_()
    x = torch.randn(2, 8, 5)
    fast, st_fast = conv(x)
    slow, st_slow = conv(x, seq_idx=torch.zeros(2, 8, dtype=torch.long))  # one document: same result, loop path
    torch.testing.assert_close(fast, slow)
    torch.testing.assert_close(st_fast, st_slow)
