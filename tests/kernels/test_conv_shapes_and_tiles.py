"""The Triton causal conv's shape check covers prev's batch and channel dims: a prev of another batch size or
width was accepted and the kernel read past it (on the GPU, other memory or an illegal address; the reference's
concatenation raises). Also the tile edges and W > 4 against the reference, forward and backward."""

import pytest
import torch

from kernels import causal_depthwise_conv_reference
from kernels.conv import causal_depthwise_conv_triton

from ._helpers import TRITON_DEVICE, needs_triton, rel

pytestmark = needs_triton


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(TRITON_DEVICE)


@pytest.mark.parametrize("prev_shape", [(1, 2, 4), (5, 2, 4), (3, 2, 2), (3, 2, 6)])
def test_prev_of_another_batch_or_width_is_a_clear_error(prev_shape):
    x, w, b = _rand(3, 5, 4, seed=0), _rand(4, 3, seed=1), _rand(4, seed=2)
    prev = _rand(*prev_shape, seed=3)
    with pytest.raises(RuntimeError):  # the reference cannot concatenate them
        causal_depthwise_conv_reference(x, prev, w, b)
    with pytest.raises(ValueError, match="prev"):
        causal_depthwise_conv_triton(x, prev, w, b)


def test_x_that_is_not_3d_is_a_clear_error():
    w, b = _rand(4, 3, seed=1), _rand(4, seed=2)
    with pytest.raises(ValueError, match="causal_depthwise_conv"):
        causal_depthwise_conv_triton(_rand(2, 3, 5, 4, seed=0), _rand(2, 2, 4, seed=3), w, b)


@pytest.mark.parametrize("b,l,c,W", [(1, 1, 3, 2), (2, 1, 5, 6), (1, 33, 129, 5), (2, 31, 7, 9), (2, 2, 3, 7)])
def test_tile_edges_and_long_filters_match_the_reference(b, l, c, W):
    """l of 1, 31, 33 (forward tile 32), c of 129 (channel tile 128), W > 4 (two or three tap walks), l < W - 1;
    fp32, forward (y and the state) and every gradient within 1e-5 relative."""
    x, prev, w, bias = _rand(b, l, c, seed=0), _rand(b, W - 1, c, seed=1), _rand(c, W, seed=2), _rand(c, seed=3)
    gy, gs = _rand(b, l, c, seed=4), _rand(b, W - 1, c, seed=5)
    outs = []
    for fn in (causal_depthwise_conv_triton, causal_depthwise_conv_reference):
        leaves = [t.clone().requires_grad_() for t in (x, prev, w, bias)]
        y, s = fn(*leaves)
        outs.append((y, s, torch.autograd.grad((y * gy).sum() + (s * gs).sum(), leaves)))
    (y, s, g), (y_ref, s_ref, g_ref) = outs
    assert rel(y, y_ref) <= 1e-5 and torch.equal(s, s_ref)
    for a, e in zip(g, g_ref):
        assert rel(a, e) <= 1e-5
