"""Triton output gate ``y * 2 sigmoid(z)`` (under TRITON_INTERPRET=1 on CPU) vs its reference: output and both
gradients, fp32 (1e-6 relative) and bf16 (1e-2), a size that is not a multiple of the block."""

import pytest
import torch

from kernels import sigmoid_gate_reference
from kernels.gate import sigmoid_gate_triton

from ._helpers import TRITON_DEVICE, needs_triton, rel

pytestmark = needs_triton


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_triton_gate_matches_reference(dtype, tol):
    g = torch.Generator().manual_seed(0)
    y = torch.randn(2, 37, 3, 24, generator=g).to(dtype).to(TRITON_DEVICE)
    z = (torch.randn(2, 37, 72, generator=g) * 2).to(dtype).to(TRITON_DEVICE)
    gout = torch.randn(2, 37, 3, 24, generator=g).to(dtype).to(TRITON_DEVICE)
    outs = []
    for fn in (sigmoid_gate_triton, sigmoid_gate_reference):
        yl, zl = y.clone().requires_grad_(), z.clone().requires_grad_()
        out = fn(yl, zl)
        dy, dz = torch.autograd.grad((out.float() * gout.float()).sum(), (yl, zl))
        outs.append((out, dy, dz))
    (o, dy, dz), (o_ref, dy_ref, dz_ref) = outs
    assert o.shape == y.shape and o.dtype == dtype and dz.shape == z.shape
    for a, e in ((o, o_ref), (dy, dy_ref), (dz, dz_ref)):
        assert a.dtype == e.dtype and rel(a, e) <= tol


def test_size_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match="differ in size"):
        sigmoid_gate_triton(torch.ones(2, 3), torch.ones(5))
