"""The fused split + NeoX rotary + Hedgehog feature map of q and k (Triton; under TRITON_INTERPRET=1 on CPU) against
the plain references (``split_qkv`` + ``apply_rotary`` + ``hedgehog_feature_map_reference``) and against the two
kernels it replaces: C, B, v and the gradients of qkv, W and b, fp32 (1e-5 relative) and bf16 (2e-2); partial and
full rotary, per-batch and shared tables, head dims and feature sizes that are not powers of two (or below tl.dot's
16), several backward groups; unused outputs; inputs without gradients; the custom ops; the model's switch."""

import pytest
import torch

from hmscale.models.neox_attention import apply_rotary, rotary_cos_sin, split_qkv
from kernels import hedgehog_feature_map_reference
from kernels.feature_map import hedgehog_feature_map
from kernels.qk_feature_map import qk_feature_maps_triton
from kernels.rotary import split_qkv_rotary_triton

from ._helpers import TRITON_DEVICE, needs_triton, rel

pytestmark = needs_triton
DEVICE = TRITON_DEVICE


def _plain(qkv, h, cos, sin, w, b):
    q, k, v = split_qkv(qkv, h)
    fm = hedgehog_feature_map_reference
    return fm(apply_rotary(q, cos, sin), w, b), fm(apply_rotary(k, cos, sin), w, b), v


def _two_kernels(qkv, h, cos, sin, w, b):
    q, k, v = split_qkv_rotary_triton(qkv, h, cos, sin)
    return hedgehog_feature_map(q, w, b), hedgehog_feature_map(k, w, b), v


def _case(b, l, h, p, F, r, per_batch, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(b, l, 3 * h * p, generator=g).to(dtype)
    pos = torch.randint(0, 500, (b if per_batch else 1, l), generator=g)
    cos, sin = rotary_cos_sin(pos, r, 10000.0, dtype=dtype)
    w = torch.randn(h, F, p, generator=g) / p ** 0.5
    bias = torch.randn(h, F, generator=g) * 0.5
    grads = [torch.randn(b, l, h, n, generator=g).to(dtype) for n in (2 * F, 2 * F, p)]
    return [t.to(DEVICE) for t in (qkv, cos, sin, w, bias)], [t.to(DEVICE) for t in grads]


def _run(fn, ins, h, grads, use=(0, 1, 2)):
    qkv, cos, sin, w, b = ins
    leaves = [t.clone().requires_grad_() for t in (qkv, w, b)]
    outs = fn(leaves[0], h, cos, sin, leaves[1], leaves[2])
    loss = sum((outs[i].float() * grads[i].float()).sum() for i in use)
    return outs, torch.autograd.grad(loss, leaves)


CASES = [(2, 19, 3, 16, 24, 4, True), (1, 40, 2, 20, 8, 8, False), (2, 5, 4, 8, 8, 8, False),
         (3, 7, 1, 64, 64, 16, True)]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("b,l,h,p,F,r,per_batch", CASES)
def test_fused_matches_the_plain_references(dtype, tol, b, l, h, p, F, r, per_batch, monkeypatch):
    monkeypatch.setenv("HMSCALE_QKFM_CFG", "bwd=16,4,16")  # several backward groups even at these lengths
    ins, grads = _case(b, l, h, p, F, r, per_batch, dtype)
    ref, g_ref = _run(_plain, ins, h, grads)
    out, g = _run(qk_feature_maps_triton, ins, h, grads)
    for name, a, e in zip("CBv", out, ref):
        assert a.shape == e.shape and a.dtype == e.dtype and a.is_contiguous(), name
        assert torch.isfinite(a).all() and rel(a, e) <= tol, (name, rel(a, e))
    assert torch.equal(out[2], ref[2])  # v is copied
    for name, a, e in zip(("qkv", "W", "b"), g, g_ref):
        assert a.dtype == e.dtype and rel(a, e) <= tol, (name, rel(a, e))


def test_fp32_gradients_against_float64():
    """Against autograd of the float64 formula, not only the fp32 references."""
    ins, grads = _case(2, 11, 2, 12, 10, 6, True, torch.float32, seed=3)
    ins64 = [t.double() for t in ins]
    _, g64 = _run(_plain, ins64, 2, [t.double() for t in grads])
    out, g = _run(qk_feature_maps_triton, ins, 2, grads)
    for name, a, e in zip(("qkv", "W", "b"), g, g64):
        assert rel(a, e) <= 1e-5, (name, rel(a, e))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_fused_matches_the_two_kernels_it_replaces(dtype, tol):
    """The forward rounds rot(q), rot(k) as the split kernel stores them and runs the same map; the backward
    recomputes phi instead of reading it back rounded (in bf16 the gradients differ by about that rounding)."""
    ins, grads = _case(2, 33, 3, 32, 32, 8, True, dtype, seed=1)
    ref, g_ref = _run(_two_kernels, ins, 3, grads)
    out, g = _run(qk_feature_maps_triton, ins, 3, grads)
    for name, a, e in zip("CBv", out, ref):
        assert rel(a, e) <= (1e-6 if dtype == torch.float32 else 4e-3), (name, rel(a, e))
    for name, a, e in zip(("qkv", "W", "b"), g, g_ref):
        assert rel(a, e) <= tol, (name, rel(a, e))


def test_unused_outputs_and_inputs_without_gradients():
    """Only C used: B's and v's gradients are zeros (v's slot of dqkv is zero); qkv or W without grad: skipped."""
    ins, grads = _case(1, 9, 2, 16, 16, 4, False, torch.float32, seed=2)
    ref, g_ref = _run(_plain, ins, 2, grads, use=(0,))
    out, g = _run(qk_feature_maps_triton, ins, 2, grads, use=(0,))
    for name, a, e in zip(("qkv", "W", "b"), g, g_ref):
        assert rel(a, e) <= 1e-5, (name, rel(a, e))
    assert (g[0].view(1, 9, 2, 3, 16)[..., 2, :] == 0).all()
    qkv, cos, sin, w, b = ins
    wl, bl = w.clone().requires_grad_(), b.clone().requires_grad_()
    C, B, _ = qk_feature_maps_triton(qkv, 2, cos, sin, wl, bl)  # stage-1 style: the input has no gradient
    gw, gb = torch.autograd.grad((C * grads[0]).sum() + (B * grads[1]).sum(), (wl, bl))
    _, (_, gw_ref, gb_ref) = _run(_plain, ins, 2, grads, use=(0, 1))
    assert rel(gw, gw_ref) <= 1e-5 and rel(gb, gb_ref) <= 1e-5
    ql = qkv.clone().requires_grad_()
    C, B, v = qk_feature_maps_triton(ql, 2, cos, sin, w, b)  # frozen map
    gq = torch.autograd.grad(sum((o * gr).sum() for o, gr in zip((C, B, v), grads)), ql)[0]
    assert rel(gq, g_ref[0]) > 1e-3 and rel(gq, _run(_plain, ins, 2, grads)[1][0]) <= 1e-5


def test_bad_shapes_and_rotary_dims_are_clear_errors():
    (qkv, cos, sin, w, b), _ = _case(1, 4, 2, 8, 8, 4, False, torch.float32)
    with pytest.raises(ValueError, match="do not match"):
        qk_feature_maps_triton(qkv, 3, cos, sin, w, b)
    with pytest.raises(ValueError, match="do not match"):
        qk_feature_maps_triton(qkv, 2, cos, sin, w, b[:, :4])
    with pytest.raises(ValueError, match="rotary dims"):
        qk_feature_maps_triton(qkv, 2, cos[..., :3], sin[..., :3], w, b)


def test_custom_op_matches_the_function():
    """The kernels as the custom op a compiled block holds: the autograd Function's outputs and gradients (the same
    kernels: bitwise), and torch.library.opcheck."""
    from kernels.qk_feature_map import _QKFeatureMaps, qk_fm_fwd_op

    ins, grads = _case(2, 19, 3, 16, 24, 4, True, torch.float32)
    out, g = _run(lambda x, h, c, s, w, b: qk_fm_fwd_op(x, c, s, w, b, h), ins, 3, grads)
    ref, g_ref = _run(lambda x, h, c, s, w, b: _QKFeatureMaps.apply(x, c, s, w, b, h), ins, 3, grads)
    for a, e in zip(out + g, ref + g_ref):
        assert torch.equal(a, e)
    qkv, cos, sin, w, b = ins
    torch.library.opcheck(qk_fm_fwd_op, (qkv.clone().requires_grad_(), cos, sin, w.clone().requires_grad_(),
                                         b.clone().requires_grad_(), 3))


def test_wide_heads_bf16_and_the_fallback(monkeypatch):
    """Heads of 128 (the 1.4b shape) in bf16 take the 8-warp tiles; where the fused kernels have no tiling
    (``fused_fits``: fp32 at 128, anything wider) the two kernels run (the same results as calling them)."""
    import kernels.qk_feature_map as kq

    assert kq.fused_fits(torch.bfloat16, 128, 128) and kq.fused_fits(torch.float32, 64, 64)
    assert not kq.fused_fits(torch.float32, 128, 128) and not kq.fused_fits(torch.bfloat16, 256, 64)
    ins, grads = _case(1, 5, 1, 128, 128, 32, False, torch.bfloat16, seed=4)
    ref, g_ref = _run(_plain, ins, 1, grads)
    out, g = _run(qk_feature_maps_triton, ins, 1, grads)
    for a, e in zip(out + g, ref + g_ref):
        assert rel(a, e) <= 2e-2
    monkeypatch.setattr(kq, "fused_fits", lambda *a: False)
    ins, grads = _case(2, 7, 2, 16, 16, 4, False, torch.float32, seed=4)
    ref, g_ref = _run(_two_kernels, ins, 2, grads)
    out, g = _run(qk_feature_maps_triton, ins, 2, grads)
    for a, e in zip(out + g, ref + g_ref):
        assert torch.equal(a, e)


def test_the_mixer_switch(monkeypatch):
    """The mixer's glue: HMSCALE_QK_FM=fused calls the fused kernels, apart the two; the same values; an unknown value
    is a one-line error naming the variable."""
    import kernels.qk_feature_map as kq
    from hmscale.models.feature_map import HedgehogFeatureMap
    from hmscale.models.fused_ops import qk_feature_maps

    ins, grads = _case(2, 9, 2, 16, 16, 4, True, torch.float32, seed=5)
    qkv, cos, sin, w, b = ins
    fm = HedgehogFeatureMap(2, 16, 16).to(DEVICE)
    with torch.no_grad():
        fm.weight.copy_(w)
        fm.bias.copy_(b)
    monkeypatch.setenv("HMSCALE_SSD_BACKEND", "triton")
    calls = []
    real = kq.qk_feature_maps_triton
    monkeypatch.setattr(kq, "qk_feature_maps_triton", lambda *a: calls.append(1) or real(*a))
    out = {}
    for choice in ("fused", "apart"):
        monkeypatch.setenv("HMSCALE_QK_FM", choice)
        out[choice] = qk_feature_maps(qkv, 2, cos, sin, fm)
        assert len(calls) == 1
    for a, e in zip(out["fused"], out["apart"]):
        assert rel(a, e) <= 1e-6
    monkeypatch.setenv("HMSCALE_QK_FM", "both")
    with pytest.raises(ValueError, match="HMSCALE_QK_FM must be fused or apart"):
        qk_feature_maps(qkv, 2, cos, sin, fm)


def test_the_mixer_glue_uses_the_kernels_inside_compiled_graphs(monkeypatch):
    """HMSCALE_COMPILED_GLUE=triton on the Triton backend: the compiled glue runs the fused kernels (as the custom
    ops), forward and backward, with the eager result and gradients."""
    import kernels.qk_feature_map as kq
    from hmscale.models.feature_map import HedgehogFeatureMap
    from hmscale.models.fused_ops import qk_feature_maps

    calls = {"fwd": 0, "bwd": 0}
    for name, key in (("_forward", "fwd"), ("_backward", "bwd")):
        real = getattr(kq, name)
        monkeypatch.setattr(kq, name, lambda *a, _real=real, _key=key: calls.__setitem__(_key, calls[_key] + 1)
                            or _real(*a))
    monkeypatch.setenv("HMSCALE_SSD_BACKEND", "triton")
    monkeypatch.setenv("HMSCALE_COMPILED_GLUE", "triton")
    ins, grads = _case(2, 9, 2, 16, 12, 4, True, torch.float32, seed=6)
    qkv, cos, sin, w, b = ins
    fm = HedgehogFeatureMap(2, 16, 12).to(DEVICE)
    with torch.no_grad():
        fm.weight.copy_(w)
        fm.bias.copy_(b)

    def glue(x):
        return qk_feature_maps(x, 2, cos, sin, fm)

    torch._dynamo.reset()
    outs = []
    for f in (glue, torch.compile(glue, backend="aot_eager", fullgraph=True)):
        fm.zero_grad(set_to_none=True)
        x = qkv.clone().requires_grad_()
        out = f(x)
        sum((o * g).sum() for o, g in zip(out, grads)).backward()
        outs.append([o.detach() for o in out] + [x.grad, fm.weight.grad, fm.bias.grad])
    assert calls == {"fwd": 2, "bwd": 2}, calls
    for a, r in zip(*outs):
        torch.testing.assert_close(a, r, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("spec", ["fwd=64", "fwd=48,4", "fwd=8,4", "bwd=16,4,40", "bwd=16,4,0", "side=1,2"])
def test_bad_tile_config_is_a_clear_error(monkeypatch, spec):
    monkeypatch.setenv("HMSCALE_QKFM_CFG", spec)
    (qkv, cos, sin, w, b), _ = _case(1, 4, 2, 8, 8, 4, False, torch.float32)
    with pytest.raises(ValueError, match="HMSCALE_QKFM_CFG"):
        qk_feature_maps_triton(qkv, 2, cos, sin, w, b)
