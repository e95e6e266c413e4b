"""Fused Hedgehog feature map (Triton; under TRITON_INTERPRET=1 on CPU) vs its plain-PyTorch reference:
output and the gradients of u, W and b on random inputs, fp32 (1e-5 relative) and bf16 (2e-2), with a head
count, feature size and head dim that are not powers of two."""

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
@pytest.mark.parametrize("lead,h,P,F", [((2, 7), 3, 16, 24), ((1, 5), 2, 20, 8), ((3,), 4, 8, 8)])
def test_fused_matches_reference(dtype, tol, lead, h, P, F):
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

