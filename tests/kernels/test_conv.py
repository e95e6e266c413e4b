"""Triton causal depthwise conv (under TRITON_INTERPRET=1 on CPU) vs its plain-PyTorch reference: y, the
carried state, and the gradients of x, prev, weight and bias (also through the state), on random inputs;
fp32 (1e-5 relative) and bf16 (2e-2); channel counts that are not multiples of the tile, short sequences."""

import pytest
import torch

from kernels import causal_depthwise_conv_reference
from kernels.conv import causal_depthwise_conv_triton

from ._helpers import TRITON_DEVICE, fused_and_plain, needs_triton, rel

pytestmark = needs_triton
DEVICE = TRITON_DEVICE


def _inputs(b, l, c, W, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, l, c, generator=g).to(dtype)
    prev = torch.randn(b, W - 1, c, generator=g).to(dtype)
    w = torch.randn(c, W, generator=g)
    bias = torch.randn(c, generator=g)
    gy = torch.randn(b, l, c, generator=g).to(dtype)
    gs = torch.randn(b, W - 1, c, generator=g).to(dtype)
    return [t.to(DEVICE) for t in (x, prev, w, bias, gy, gs)]


def _run(fn, x, prev, w, bias, gy, gs, with_state_grad):
    leaves = [t.clone().requires_grad_() for t in (x, prev, w, bias)]
    y, state = fn(*leaves)
    loss = (y.float() * gy.float()).sum()
    if with_state_grad:
        loss = loss + (state.float() * gs.float()).sum()
    return y, state, torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("b,l,c,W", [(2, 45, 200, 4), (1, 70, 64, 3), (2, 2, 130, 4), (1, 33, 16, 2)])
@pytest.mark.parametrize("with_state_grad", [False, True])
def test_triton_conv_matches_reference(dtype, tol, b, l, c, W, with_state_grad):
    ins = _inputs(b, l, c, W, dtype)
    y_ref, s_ref, g_ref = _run(causal_depthwise_conv_reference, *ins, with_state_grad)
    y, s, g = _run(causal_depthwise_conv_triton, *ins, with_state_grad)
    assert y.dtype == dtype and y.shape == (b, l, c) and s.shape == (b, W - 1, c)
    assert torch.isfinite(y).all()
    assert rel(y, y_ref) <= tol
    assert torch.equal(s, s_ref)  # the state is a copy of inputs
    for name, a, r in zip(("x", "prev", "weight", "bias"), g, g_ref):
        assert a.shape == r.shape and a.dtype == r.dtype, name
        assert rel(a, r) <= tol, (name, rel(a, r))


@pytest.mark.parametrize("cfg", ["bwd=16,64,4,32", "bwd=8,32,4,16;fwd=16,32,4"])
@pytest.mark.parametrize("b,l,c,W", [(2, 75, 70, 4), (1, 40, 33, 6), (1, 3, 20, 9)])
def test_row_groups_and_tap_groups(monkeypatch, cfg, b, l, c, W):
    """Several row groups per sequence (their partial weight sums added), more than four taps (a second walk of
    the rows) and a sequence shorter than the carried rows: gradients equal the reference's (fp32, 1e-5)."""
    monkeypatch.setenv("HMSCALE_CONV_CFG", cfg)
    ins = _inputs(b, l, c, W, torch.float32, seed=W)
    _, _, g_ref = _run(causal_depthwise_conv_reference, *ins, True)
    y, _, g = _run(causal_depthwise_conv_triton, *ins, True)
    assert torch.isfinite(y).all()
    for name, a, r in zip(("x", "prev", "weight", "bias"), g, g_ref):
        assert rel(a, r) <= 1e-5, (name, rel(a, r))


def test_int64_offsets_give_the_same_result(monkeypatch):
    """Sequences too long for int32 offsets take the backward's int64 variant (forced here by a low limit)."""
    import kernels.conv as kconv

    ins = _inputs(2, 45, 200, 4, torch.float32)
    y32, _, g32 = _run(causal_depthwise_conv_triton, *ins, True)
    monkeypatch.setattr(kconv, "_INT32_OFFSETS", 0)
    y64, _, g64 = _run(causal_depthwise_conv_triton, *ins, True)
    assert torch.equal(y32, y64) and all(torch.equal(a, b) for a, b in zip(g32, g64))


@pytest.mark.parametrize("cfg", ["bwd=16,64,4,24", "fwd=16,64", "fwd=24,64,4", "bwd=0,64,4,32", "fwd=16,64,3",
                                 "bwd=a,b,c,d", "nope=1,2,3"])
def test_bad_tile_config_is_a_clear_error(monkeypatch, cfg):
    monkeypatch.setenv("HMSCALE_CONV_CFG", cfg)
    ins = _inputs(1, 8, 16, 4, torch.float32)
    with pytest.raises(ValueError, match="HMSCALE_CONV_CFG"):
        _run(causal_depthwise_conv_triton, *ins, False)


def test_bad_shapes_are_a_clear_error():
    x, prev, w, bias, _, _ = _inputs(1, 8, 16, 4, torch.float32)
    with pytest.raises(ValueError, match="do not match"):
        causal_depthwise_conv_triton(x, prev[:, :2], w, bias)


def test_module_uses_the_backend_switch(monkeypatch):
    """The mixer's conv module takes the Triton kernel where the kernels' backend is Triton, else the CPU
    autograd function; both give the same output."""
    import kernels.conv as kconv
    from hmscale.models.hedgemamba import CausalDepthwiseConv

    conv = CausalDepthwiseConv(24, 4).to(DEVICE)
    with torch.no_grad():
        conv.weight.normal_()
        conv.bias.normal_()
    x = torch.randn(2, 9, 24, device=DEVICE)
    (y_fused, s_fused), (y_plain, s_plain) = fused_and_plain(monkeypatch, kconv, "causal_depthwise_conv_triton",
                                                             lambda: conv(x))
    assert rel(y_fused, y_plain) <= 1e-5 and torch.equal(s_fused, s_plain)


@pytest.fixture(scope="module")
def custom_op_opcheck():
    """torch.library.opcheck of the conv custom op on the inputs below (~60 % of each case's time under the
    interpreter): it does not depend on with_state_grad, so it runs once for both cases, and each asserts it."""
    from kernels.conv import conv_fwd_op

    x, prev, w, bias, _, _ = _inputs(2, 45, 200, 4, torch.float32)
    leaves = [t.clone().requires_grad_() for t in (x, prev, w, bias)]
    try:
        torch.library.opcheck(conv_fwd_op, tuple(leaves))
    except Exception as err:  # noqa: BLE001 - handed to each test that asserts it
        return err
    return None


@pytest.mark.xdist_group("conv_custom_op")  # both cases on one xdist worker: one opcheck between them
@pytest.mark.parametrize("with_state_grad", [False, True])
def test_custom_op_matches_the_function(with_state_grad, custom_op_opcheck):
    """The kernels as the custom op a compiled block holds: the autograd Function's outputs and gradients
    (the same kernels: bitwise), and torch.library.opcheck (schema, fake shapes, autograd, AOT dispatch)."""
    from kernels.conv import _CausalConvTriton, conv_fwd_op

    x, prev, w, bias, gy, gs = _inputs(2, 45, 200, 4, torch.float32)
    y, state, grads = _run(conv_fwd_op, x, prev, w, bias, gy, gs, with_state_grad)
    y_ref, state_ref, grads_ref = _run(_CausalConvTriton.apply, x, prev, w, bias, gy, gs, with_state_grad)
    assert torch.equal(y, y_ref) and torch.equal(state, state_ref)
    for g, gr in zip(grads, grads_ref):
        assert torch.equal(g, gr)
    if custom_op_opcheck is not None:  # torch.library.opcheck(conv_fwd_op, (x, prev, w, bias)) failed
        raise custom_op_opcheck


def test_custom_op_with_an_unused_state_adds_no_state_gradient(monkeypatch):
    """In training the conv's state output is unused: its gradient must reach the op's backward as None (as in the
    eager Function), not as zeros that a compiled backward copies dx through [dprev, dx] to add (a full pass over
    the qkv-wide dx per layer: `add_cat_clone_slice` in the compiled 160m profile, ~48 us a layer on an H100)."""
    import kernels.conv as kconv

    seen = []
    real = kconv._add_state_grad
    monkeypatch.setattr(kconv, "_add_state_grad", lambda *a: seen.append(a[2]) or real(*a))
    x, prev, w, bias, gy, gs = _inputs(2, 45, 200, 4, torch.float32)
    _run(kconv.conv_fwd_op, x, prev, w, bias, gy, gs, with_state_grad=False)
    assert seen == []
    _run(kconv.conv_fwd_op, x, prev, w, bias, gy, gs, with_state_grad=True)  # a used state still adds its gradient
    assert len(seen) == 1 and torch.equal(seen[0], gs)
