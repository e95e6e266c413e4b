"""Triton split + NeoX partial rotary (under TRITON_INTERPRET=1 on CPU) vs the model's plain version
(`neox_attention.split_qkv` + `apply_rotary`): q, k, v and the qkv gradient, fp32 (1e-5 relative) and bf16
(2e-2), per-batch and shared rotary tables, partial and full rotary, a head dim that is not a power of two."""

import pytest
import torch

from hmscale.models.neox_attention import apply_rotary, rotary_cos_sin, split_qkv
from kernels.rotary import split_qkv_rotary_triton

from ._helpers import TRITON_DEVICE, fused_and_plain, needs_triton, rel

pytestmark = needs_triton
DEVICE = TRITON_DEVICE


def _plain(qkv, h, cos, sin):
    q, k, v = split_qkv(qkv, h)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v


def _case(b, l, h, p, r, per_batch, dtype):
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(b, l, 3 * h * p, generator=g).to(dtype).to(DEVICE)
    pos = torch.randint(0, 500, (b if per_batch else 1, l), generator=g).to(DEVICE)
    cos, sin = rotary_cos_sin(pos, r, 10000.0, dtype=dtype)
    grads = [torch.randn(b, l, h, p, generator=g).to(dtype).to(DEVICE) for _ in range(3)]
    return qkv, cos, sin, grads


def _run(fn, qkv, h, cos, sin, grads):
    leaf = qkv.clone().requires_grad_()
    outs = fn(leaf, h, cos, sin)
    loss = sum((o.float() * gr.float()).sum() for o, gr in zip(outs, grads))
    return outs, torch.autograd.grad(loss, leaf)[0]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("b,l,h,p,r,per_batch", [(2, 19, 3, 16, 4, True), (1, 40, 2, 20, 8, False),
                                                 (2, 5, 4, 8, 8, False), (3, 7, 1, 64, 16, True)])
def test_triton_split_rotary_matches_plain(dtype, tol, b, l, h, p, r, per_batch):
    qkv, cos, sin, grads = _case(b, l, h, p, r, per_batch, dtype)
    ref, g_ref = _run(_plain, qkv, h, cos, sin, grads)
    out, g = _run(split_qkv_rotary_triton, qkv, h, cos, sin, grads)
    for name, a, e in zip("qkv", out, ref):
        assert a.shape == e.shape and a.dtype == e.dtype and a.is_contiguous(), name
        assert rel(a, e) <= tol, (name, rel(a, e))
    assert torch.equal(out[2], ref[2])  # v is copied, not computed
    assert g.dtype == g_ref.dtype and rel(g, g_ref) <= tol


def test_bad_rotary_dims_are_a_clear_error():
    qkv, cos, sin, _ = _case(1, 4, 2, 8, 4, False, torch.float32)
    with pytest.raises(ValueError, match="rotary dims"):
        split_qkv_rotary_triton(qkv, 2, cos[..., :3], sin[..., :3])


def test_model_split_uses_the_backend_switch(monkeypatch):
    import kernels.rotary as krot
    from hmscale.models.fused_ops import split_qkv_rotary

    qkv, cos, sin, _ = _case(2, 6, 2, 16, 4, False, torch.float32)
    fused, plain = fused_and_plain(monkeypatch, krot, "split_qkv_rotary_triton",
                                   lambda: split_qkv_rotary(qkv, 2, cos, sin))
    for a, e in zip(fused, plain):
        assert rel(a, e) <= 1e-6


def test_custom_op_matches_the_function():
    """The kernels as the custom op a compiled block holds: the autograd Function's outputs and qkv gradient
    (the same kernels: bitwise), and torch.library.opcheck."""
    from kernels.rotary import _SplitQKVRotaryTriton, split_rotary_fwd_op

    qkv, cos, sin, grads = _case(2, 19, 3, 16, 4, True, torch.float32)
    out, g = _run(lambda x, h, c, s: split_rotary_fwd_op(x, c, s, h), qkv, 3, cos, sin, grads)
    ref, g_ref = _run(lambda x, h, c, s: _SplitQKVRotaryTriton.apply(x, c, s, h), qkv, 3, cos, sin, grads)
    for a, e in zip(out, ref):
        assert torch.equal(a, e)
    assert torch.equal(g, g_ref)
    torch.library.opcheck(split_rotary_fwd_op, (qkv.clone().requires_grad_(), cos, sin, 3))
