"""Fused Hedgehog feature map (Triton; under TRITON_INTERPRET=1 on CPU) vs its plain-PyTorch reference:
output and the gradients of u, W and b on random inputs, fp32 (1e-5 relative) and bf16 (2e-2), with a head
count, feature size and head dim that are not powers of two (and below tl.dot's 16), over several backward row
groups (small tiles through HMSCALE_FM_CFG); stage 1 (u without grad); the custom ops (opcheck) and a compiled
HedgehogFeatureMap holding them; both backward forms (one kernel, or the dz kernel and two batched matmuls:
HMSCALE_FM_BWD); the tile config's and the form's errors."""

import pytest
import torch

from kernels import hedgehog_feature_map_reference
from kernels.feature_map import hedgehog_feature_map

from ._helpers import TRITON_DEVICE, fused_and_plain, needs_triton, rel

pytestmark = needs_triton
DEVICE = TRITON_DEVICE


def _inputs(lead, h, P, F, dtype):
    g = torch.Generator().manual_seed(0)
    u = torch.randn(*lead, h, P, generator=g)
    w = torch.randn(h, F, P, generator=g) / P ** 0.5
    b = torch.randn(h, F, generator=g) * 0.5
    gy = torch.randn(*lead, h, 2 * F, generator=g)
    return [t.to(DEVICE) for t in (u.to(dtype), w, b, gy.to(dtype))]


def _grads(fn, u, w, b, gy):
    leaves = [t.clone().requires_grad_() for t in (u, w, b)]
    y = fn(*leaves)
    grads = torch.autograd.grad((y.float() * gy.float()).sum(), leaves)
    return y, grads


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("lead,h,P,F", [((2, 7), 3, 16, 24), ((1, 5), 2, 20, 8), ((3,), 4, 8, 8),
                                        ((2, 3), 1, 128, 128)])
def test_fused_matches_reference(dtype, tol, lead, h, P, F):
    """(Heads of 128 in fp32: the 16-bit tiles needed 424 KiB of shared memory for the backward there and did not
    launch on an H100 / H200; fp32 has its own tiles since.)"""
    u, w, b, gy = _inputs(lead, h, P, F, dtype)
    y_ref, g_ref = _grads(hedgehog_feature_map_reference, u, w, b, gy)
    y, g = _grads(hedgehog_feature_map, u, w, b, gy)
    assert y.dtype == dtype and y.shape == (*lead, h, 2 * F)
    assert torch.isfinite(y).all()
    assert rel(y, y_ref) <= tol
    torch.testing.assert_close(y.float().sum(-1), torch.ones(y.shape[:-1], device=y.device), rtol=0, atol=tol * 2)
    for name, a, r in zip(("u", "W", "b"), g, g_ref):
        assert a.dtype == r.dtype, name
        assert rel(a, r) <= tol, (name, rel(a, r))


def test_fp32_gradients_against_float64():
    """The fused backward against autograd of the float64 formula (not just the fp32 reference)."""
    u, w, b, gy = _inputs((2, 9), 2, 12, 12, torch.float32)
    ref64 = lambda u_, w_, b_: hedgehog_feature_map_reference(u_.double(), w_.double(), b_.double())  # noqa: E731
    _, g64 = _grads(ref64, u, w, b, gy)
    _, g = _grads(hedgehog_feature_map, u, w, b, gy)
    for a, r in zip(g, g64):
        assert rel(a, r) <= 1e-5


def test_fp32_inputs_take_their_own_tiles(monkeypatch):
    from kernels.feature_map import _DEFAULT_CFG, _DEFAULT_CFG_8WARPS, _tiles

    monkeypatch.delenv("HMSCALE_FM_CFG", raising=False)
    fp32, bf16 = _tiles(torch.float32, 64, 64), _tiles(torch.bfloat16, 64, 64)
    assert fp32 == dict(_DEFAULT_CFG_8WARPS, k=(32, 32)) and bf16 == dict(_DEFAULT_CFG, k=(64, 64))
    assert _DEFAULT_CFG_8WARPS != _DEFAULT_CFG
    monkeypatch.setenv("HMSCALE_FM_CFG", "bwd=32,4,512")
    fp32 = _tiles(torch.float32, 64, 64)
    assert fp32["bwd"] == (32, 4, 512) and fp32["fwd"] == _DEFAULT_CFG_8WARPS["fwd"]


def test_which_sizes_run_the_kernels_and_their_tiles(monkeypatch):
    """16-bit heads hold a head's whole W (up to 128 x 256 padded: 4-warp tiles up to 64, an 8-warp backward at 128,
    8-warp tiles past that); past 128 x 256 (Pythia-1b: heads of 256, F = 256) the forward steps along P and the
    backward is the dz kernel and two batched matmuls; fp32 takes W in slices of P up to 256 x 256 (the whole-W fp32
    tiles spilled or did not fit the shared memory: ``benchmarks/ssd_registers.py --op fm-all``, part of ``make
    compile-check``); wider runs the reference."""
    import kernels.feature_map as kfm

    monkeypatch.delenv("HMSCALE_FM_CFG", raising=False)
    monkeypatch.delenv("HMSCALE_FM_BWD", raising=False)
    assert kfm.kernel_fits(torch.bfloat16, 128, 128) and kfm.kernel_fits(torch.bfloat16, 256, 256)
    assert not kfm.kernel_fits(torch.float16, 256, 300) and not kfm.kernel_fits(torch.bfloat16, 512, 64)
    assert kfm.kernel_fits(torch.float32, 256, 256) and not kfm.kernel_fits(torch.float32, 300, 64)
    assert kfm._tiles(torch.bfloat16, 64, 64) == dict(kfm._DEFAULT_CFG, k=(64, 64))
    assert kfm._tiles(torch.bfloat16, 80, 128) == dict(kfm._DEFAULT_CFG_128, k=(128, 128))
    assert kfm._tiles(torch.bfloat16, 64, 256) == dict(kfm._DEFAULT_CFG_8WARPS, k=(64, 64))
    assert kfm._tiles(torch.bfloat16, 256, 200) == dict(kfm._DEFAULT_CFG_WIDE, k=(64, 64))
    assert kfm._tiles(torch.float32, 128, 256) == dict(kfm._DEFAULT_CFG_8WARPS, k=(32, 32))
    assert [kfm.backward_form(d, p, f) for d, p, f in ((torch.bfloat16, 256, 256), (torch.float16, 200, 256),
                                                       (torch.bfloat16, 128, 256), (torch.float32, 256, 256))] \
        == ["gemm", "gemm", "fused", "fused"]
    calls = []
    monkeypatch.setattr(kfm, "hedgehog_feature_map_reference",
                        lambda *a: calls.append(1) or hedgehog_feature_map_reference(*a))
    lead = (2, 3) if DEVICE == "cpu" else (3, 1500)  # on a GPU: several backward row groups, a partial one last
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):  # sliced fp32; bf16 through the dz kernel
        u, w, b, gy = _inputs(lead, 2 if DEVICE == "cuda" else 1, 256, 256, dtype)
        y, g = _grads(hedgehog_feature_map, u, w, b, gy)
        y_ref, g_ref = _grads(hedgehog_feature_map_reference, u, w, b, gy)
        assert calls == [] and torch.isfinite(y).all()
        assert rel(y, y_ref) <= tol and all(rel(a, r) <= tol for a, r in zip(g, g_ref)), [rel(a, r) for a, r in
                                                                                          zip(g, g_ref)]
    u, w, b, gy = _inputs((2,), 1, 16, 300, torch.bfloat16)  # the reference itself
    y, g = _grads(hedgehog_feature_map, u, w, b, gy)
    y_ref, g_ref = _grads(hedgehog_feature_map_reference, u, w, b, gy)
    assert calls == [1] and torch.equal(y, y_ref) and all(torch.equal(a, r) for a, r in zip(g, g_ref))
    u, w, b, gy = _inputs((2, 3), 1, 64, 256, torch.bfloat16)  # 128 x 256 in 16 bits: the kernels, 8-warp tiles
    y, g = _grads(hedgehog_feature_map, u, w, b, gy)
    y_ref, g_ref = _grads(hedgehog_feature_map_reference, u, w, b, gy)
    assert calls == [1] and rel(y, y_ref) <= 2e-2 and all(rel(a, r) <= 2e-2 for a, r in zip(g, g_ref))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_p_steps_and_p_tiles_over_several_row_groups(monkeypatch, dtype, tol):
    """The sliced path at small sizes: P = 40 (padded to 64) in forward steps and backward tiles of 16 columns (the
    last ones partly or wholly past P), F = 24 padded, rows over several backward groups, stage 1 too (no du)."""
    monkeypatch.setenv("HMSCALE_FM_CFG", "fwd=16,4;bwd=16,4,32;k=16,16")
    u, w, b, gy = _inputs((3, 25), 2, 40, 24, dtype)
    y_ref, g_ref = _grads(hedgehog_feature_map_reference, u, w, b, gy)
    y, g = _grads(hedgehog_feature_map, u, w, b, gy)
    assert rel(y, y_ref) <= tol
    for name, a, r in zip(("u", "W", "b"), g, g_ref):
        assert rel(a, r) <= tol, (name, rel(a, r))
    wl, bl = w.clone().requires_grad_(), b.clone().requires_grad_()
    torch.autograd.backward(hedgehog_feature_map(u, wl, bl), gy)
    assert rel(wl.grad, g_ref[1]) <= tol and rel(bl.grad, g_ref[2]) <= tol


def test_shape_mismatch_is_a_clear_error():
    u, w, b, _ = _inputs((2,), 2, 8, 8, torch.float32)
    with pytest.raises(ValueError, match="do not match"):
        hedgehog_feature_map(u[..., :4], w, b)


def test_only_the_needed_gradients_and_empty_input():
    u, w, b, gy = _inputs((2, 3), 2, 8, 8, torch.float32)
    wl, bl = w.clone().requires_grad_(), b.clone().requires_grad_()
    y = hedgehog_feature_map(u, wl, bl)  # u without grad (stage 1: the teacher's q, k)
    (y * gy).sum().backward()
    ref_w, ref_b = w.clone().requires_grad_(), b.clone().requires_grad_()
    (hedgehog_feature_map_reference(u, ref_w, ref_b) * gy).sum().backward()
    assert rel(wl.grad, ref_w.grad) <= 1e-5 and rel(bl.grad, ref_b.grad) <= 1e-5
    assert hedgehog_feature_map(u[:0], w, b).shape == (0, 3, 2, 16)


def test_module_uses_the_backend_switch(monkeypatch):
    """HedgehogFeatureMap takes the fused path where the kernels' backend is Triton, the reference otherwise."""
    from hmscale.models.feature_map import HedgehogFeatureMap

    fm = HedgehogFeatureMap(2, 8, 8).to(DEVICE)
    with torch.no_grad():
        fm.bias.normal_()
    u = torch.randn(3, 2, 8, device=DEVICE)
    import kernels.feature_map as kfm

    fused, plain = fused_and_plain(monkeypatch, kfm, "hedgehog_feature_map", lambda: fm(u))
    assert rel(fused, plain) <= 1e-5



SMALL_TILES = "fwd=16,4;bwd=16,4,32"  # R = 75 rows: 5 forward tiles, 3 backward row groups (the last one partial)


@pytest.mark.parametrize("form", ["fused", "gemm"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("h,P,F", [(2, 8, 8), (2, 20, 8), (3, 16, 24)])
def test_several_row_groups_and_padded_sizes(monkeypatch, dtype, tol, h, P, F, form):
    """P and F below 16 or not powers of two (padded for tl.dot), rows not a multiple of BLOCK_R and spread over
    several backward programs whose partial sums torch adds; both backward forms (HMSCALE_FM_BWD)."""
    monkeypatch.setenv("HMSCALE_FM_CFG", SMALL_TILES)
    monkeypatch.setenv("HMSCALE_FM_BWD", form)
    u, w, b, gy = _inputs((3, 25), h, P, F, dtype)
    y_ref, g_ref = _grads(hedgehog_feature_map_reference, u, w, b, gy)
    y, g = _grads(hedgehog_feature_map, u, w, b, gy)
    assert y.dtype == dtype and rel(y, y_ref) <= tol
    for name, a, r in zip(("u", "W", "b"), g, g_ref):
        assert a.dtype == r.dtype and a.shape == r.shape, name
        assert rel(a, r) <= tol, (name, rel(a, r))


@pytest.mark.parametrize("form", ["fused", "gemm"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_stage1_without_the_input_gradient(monkeypatch, dtype, tol, form):
    """u without requires_grad (stage 1: the teacher's q, k): the backward skips du; W and b get the reference's
    gradients, over several row groups; both backward forms."""
    monkeypatch.setenv("HMSCALE_FM_CFG", SMALL_TILES)
    monkeypatch.setenv("HMSCALE_FM_BWD", form)
    u, w, b, gy = _inputs((5, 13), 2, 20, 12, dtype)
    got, ref = [], []
    for fn, out in ((hedgehog_feature_map, got), (hedgehog_feature_map_reference, ref)):
        wl, bl = w.clone().requires_grad_(), b.clone().requires_grad_()
        (fn(u, wl, bl).float() * gy.float()).sum().backward()
        out += [wl.grad, bl.grad]
    for a, r in zip(got, ref):
        assert rel(a, r) <= tol
    # only the weight (the bias frozen), only the input
    wl = w.clone().requires_grad_()
    (dw,) = torch.autograd.grad((hedgehog_feature_map(u, wl, b).float() * gy.float()).sum(), [wl])
    assert rel(dw, got[0]) <= tol
    ul = u.clone().requires_grad_()
    (du,) = torch.autograd.grad((hedgehog_feature_map(ul, w, b).float() * gy.float()).sum(), [ul])
    _, g_ref = _grads(hedgehog_feature_map_reference, u, w, b, gy)
    assert rel(du, g_ref[0]) <= tol


def _run_op(fn, u, w, b, gy):
    leaves = [t.clone().requires_grad_() for t in (u, w, b)]
    y = fn(*leaves)
    return y, torch.autograd.grad((y.float() * gy.float()).sum(), leaves)


@pytest.mark.parametrize("form", ["fused", "gemm"])
def test_custom_op_matches_the_function(monkeypatch, form):
    """The kernels as the custom ops a compiled block holds: the autograd Function's outputs and gradients (the
    same kernels: bitwise), and torch.library.opcheck (schema, fake shapes, autograd, AOT dispatch); both backward
    forms."""
    from kernels.feature_map import _HedgehogFeatureMap, fm_bwd_op, fm_fwd_op

    monkeypatch.setenv("HMSCALE_FM_CFG", SMALL_TILES)
    monkeypatch.setenv("HMSCALE_FM_BWD", form)
    u, w, b, gy = _inputs((2, 21), 3, 20, 8, torch.float32)
    y, grads = _run_op(fm_fwd_op, u, w, b, gy)
    y_ref, grads_ref = _run_op(_HedgehogFeatureMap.apply, u, w, b, gy)
    assert torch.equal(y, y_ref)
    for g, gr in zip(grads, grads_ref):
        assert torch.equal(g, gr)
    torch.library.opcheck(fm_fwd_op, tuple(t.clone().requires_grad_() for t in (u, w, b)))
    torch.library.opcheck(fm_fwd_op, (u, w.clone().requires_grad_(), b.clone().requires_grad_()))  # stage 1
    phi = fm_fwd_op(u, w, b)
    for need_u, need_w in ((True, True), (False, True), (True, False)):
        torch.library.opcheck(fm_bwd_op, (gy, u, w, phi, b.dtype, need_u, need_w),
                              test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("form", ["fused", "gemm"])
def test_module_uses_the_kernel_inside_compiled_graphs(monkeypatch, form):
    """HMSCALE_COMPILED_GLUE=triton on the Triton backend: a compiled HedgehogFeatureMap runs the kernels (as the
    custom op), forward and backward (either form), with the eager module's output and gradients."""
    import kernels.feature_map as kfm
    from hmscale.models.feature_map import HedgehogFeatureMap

    calls = {"fwd": 0, "bwd": 0}
    for name, key in (("_forward", "fwd"), ("_backward", "bwd")):
        real = getattr(kfm, name)
        monkeypatch.setattr(kfm, name, lambda *a, _real=real, _key=key: calls.__setitem__(_key, calls[_key] + 1)
                            or _real(*a))
    monkeypatch.setenv("HMSCALE_SSD_BACKEND", "triton")
    monkeypatch.setenv("HMSCALE_COMPILED_GLUE", "triton")
    monkeypatch.setenv("HMSCALE_FM_BWD", form)
    fm = HedgehogFeatureMap(2, 8, 12).to(DEVICE)
    with torch.no_grad():
        fm.bias.normal_()
        fm.weight.add_(0.1 * torch.randn_like(fm.weight))
    u, _, _, gy = _inputs((3, 5), 2, 8, 12, torch.float32)
    torch._dynamo.reset()
    compiled = torch.compile(fm, backend="aot_eager", fullgraph=True)
    outs = []
    for m in (fm, compiled):
        fm.zero_grad(set_to_none=True)
        ul = u.clone().requires_grad_()
        y = m(ul)
        (y * gy).sum().backward()
        outs.append((y.detach(), ul.grad, fm.weight.grad, fm.bias.grad))
    assert calls == {"fwd": 2, "bwd": 2}, calls
    for a, r in zip(*outs):
        torch.testing.assert_close(a, r, rtol=1e-6, atol=1e-7)


def test_too_wide_heads_trace_the_reference_in_compiled_graphs(monkeypatch):
    """Heads the kernels do not take (feature maps past 256 padded): a compiled HedgehogFeatureMap traces the reference
    in one graph (fullgraph) with the eager module's output and input gradient."""
    from hmscale.models.feature_map import HedgehogFeatureMap

    monkeypatch.setenv("HMSCALE_SSD_BACKEND", "triton")
    monkeypatch.setenv("HMSCALE_COMPILED_GLUE", "triton")
    fm = HedgehogFeatureMap(2, 16, 300).to(DEVICE)
    with torch.no_grad():
        fm.bias.normal_()
    u, _, _, gy = _inputs((3, 2), 2, 16, 300, torch.float32)
    torch._dynamo.reset()
    outs = []
    for m in (fm, torch.compile(fm, backend="aot_eager", fullgraph=True)):
        ul = u.clone().requires_grad_()
        y = m(ul)
        (y * gy).sum().backward()
        outs.append((y.detach(), ul.grad))
    for a, r in zip(*outs):
        torch.testing.assert_close(a, r, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("spec", ["fwd=64", "fwd=a,4", "fwd=48,4", "fwd=8,4", "fwd=64,3", "bwd=16,4,40",
                                  "bwd=16,4,0", "bwd=64,8", "side=1,2", "bwd=16,4,32;fwd=64,4,1",
                                  "k=16", "k=8,16", "k=16,32", "k=24,16"])
def test_bad_tile_config_is_a_clear_error(monkeypatch, spec):
    monkeypatch.setenv("HMSCALE_FM_CFG", spec)
    u, w, b, _ = _inputs((2,), 2, 8, 8, torch.float32)
    with pytest.raises(ValueError, match="HMSCALE_FM_CFG"):
        hedgehog_feature_map(u, w, b)


def test_bad_backward_form_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HMSCALE_FM_BWD", "cublas")
    u, w, b, gy = _inputs((2,), 2, 8, 8, torch.float32)
    y = hedgehog_feature_map(u.clone().requires_grad_(), w, b)
    with pytest.raises(ValueError, match="HMSCALE_FM_BWD='cublas': choose auto, fused or gemm"):
        y.backward(gy)
