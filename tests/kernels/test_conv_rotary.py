"""The fused causal conv + qkv split + NeoX rotary (Triton, under TRITON_INTERPRET=1 on CPU) against the plain
composition (`causal_depthwise_conv_reference` from zero history, `split_qkv`, `apply_rotary`): q, k, v and the
gradients of qkv, the conv weight and bias, on random inputs. fp32 within 1e-5 relative; bf16 against the fp32
composition of the same (rounded) inputs within 1e-2. Several row tiles and backward programs (the weight
gradient's partial sums), sequences that start inside a tile, widths 2 and 4, per-batch and shared rotary tables,
a head dim that is not a power of two; the custom ops pass torch.library.opcheck."""

import pytest
import torch

from hmscale.models.neox_attention import apply_rotary, rotary_cos_sin, split_qkv
from kernels.conv_rotary import conv_rotary_fwd_op, conv_split_rotary_triton
from kernels.reference import causal_depthwise_conv_reference

from ._helpers import TRITON_DEVICE, needs_triton, rel

pytestmark = needs_triton
DEVICE = TRITON_DEVICE


def _plain(qkv, weight, bias, h, cos, sin):
    W = weight.shape[1]
    c, _ = causal_depthwise_conv_reference(qkv, qkv.new_zeros(qkv.shape[0], W - 1, qkv.shape[2]), weight, bias)
    q, k, v = split_qkv(c, h)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v


def _case(b, l, h, p, r, W, per_batch, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    c3 = 3 * h * p
    qkv = torch.randn(b, l, c3, generator=g)
    weight = torch.randn(c3, W, generator=g) / W ** 0.5
    bias = torch.randn(c3, generator=g) * 0.1
    pos = torch.randint(0, 500, (b if per_batch else 1, l), generator=g)
    cos, sin = rotary_cos_sin(pos, r, 10000.0, dtype=torch.float32)
    grads = [torch.randn(b, l, h, p, generator=g) for _ in range(3)]
    cast = lambda t: t.to(dtype).to(DEVICE)  # noqa: E731
    return [cast(t) for t in (qkv, weight, bias, cos, sin)], [cast(t) for t in grads]


def _run(fn, ins, h, grads):
    qkv, weight, bias, cos, sin = ins
    leaves = [t.clone().requires_grad_() for t in (qkv, weight, bias)]
    outs = fn(leaves[0], leaves[1], leaves[2], h, cos, sin)
    loss = sum((o.float() * gr.float()).sum() for o, gr in zip(outs, grads))
    return outs, torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("b,l,h,p,r,W,per_batch", [
    (2, 70, 2, 24, 8, 4, True),     # 140 rows: 5 row tiles, 2 backward programs; P=24 (not a power of two)
    (3, 21, 3, 16, 16, 2, False),   # full rotary, width 2, sequences starting inside a tile
    (1, 9, 1, 64, 16, 4, False),    # a sequence shorter than the tile
])
def test_matches_the_plain_composition(dtype, tol, b, l, h, p, r, W, per_batch):
    ins, grads = _case(b, l, h, p, r, W, per_batch, dtype)
    outs, gs = _run(conv_split_rotary_triton, ins, h, grads)
    # the reference in fp32 on the same (rounded) inputs: the kernel computes in fp32 too
    ref_outs, ref_gs = _run(_plain, [t.float() for t in ins], h, [g.float() for g in grads])
    for name, o, ro in zip("qkv", outs, ref_outs):
        assert o.shape == ro.shape and o.dtype == dtype and o.is_contiguous()
        assert rel(o.float(), ro) < tol, name
    for name, g, rg in zip(("dqkv", "dweight", "dbias"), gs, ref_gs):
        assert g.dtype == dtype
        assert rel(g.float(), rg) < tol, (name, rel(g.float(), rg))


def test_bad_shapes_are_refused():
    (qkv, weight, bias, cos, sin), _ = _case(1, 8, 2, 16, 8, 4, False, torch.float32)
    with pytest.raises(ValueError, match="rotary dims"):
        conv_split_rotary_triton(qkv, weight, bias, 2, cos[..., :3], sin[..., :3])
    with pytest.raises(ValueError, match="weight"):
        conv_split_rotary_triton(qkv, weight[:-1], bias, 2, cos, sin)


def test_custom_ops_pass_opcheck():
    """Schema, fake shapes and dtypes, autograd registration and AOT dispatch agree with the kernels."""
    (qkv, weight, bias, cos, sin), _ = _case(1, 40, 2, 16, 8, 4, True, torch.float32)
    leaves = [t.clone().requires_grad_() for t in (qkv, weight, bias)]
    torch.library.opcheck(conv_rotary_fwd_op, (*leaves, cos, sin, 2))
