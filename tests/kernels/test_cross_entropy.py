"""Triton next-token cross-entropy (under TRITON_INTERPRET=1 on CPU, or on a GPU) vs ``F.cross_entropy`` in fp32:
loss and logits gradient, fp32 (1e-5 relative) and bf16 logits (loss 1e-5, gradient 1e-2 against the fp32
reference's gradient cast to bf16), a vocabulary that is not a multiple of the block, ignored rows, large logits."""

import pytest
import torch

from kernels import cross_entropy_reference
from kernels.cross_entropy import _BLOCK_V, cross_entropy_sum_triton, next_token_cross_entropy_sum

from ._helpers import TRITON_DEVICE, needs_triton, rel

pytestmark = needs_triton


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("vocab", [97, _BLOCK_V + 301])
def test_matches_reference(dtype, tol, vocab):
    g = torch.Generator().manual_seed(0)
    rows = 13
    z = (torch.randn(rows, vocab, generator=g) * 4 + 30).to(dtype).to(TRITON_DEVICE)  # large: needs the max shift
    t = torch.randint(0, vocab, (rows,), generator=g)
    t[[2, 7]] = -100
    t[5] = vocab - 1  # the last column (the block tail)
    t = t.to(TRITON_DEVICE)
    outs = []
    for fn in (cross_entropy_sum_triton, cross_entropy_reference):
        zl = z.clone().requires_grad_()
        loss = fn(zl, t)
        (dz,) = torch.autograd.grad(loss * 0.37, zl)
        outs.append((loss, dz))
    (loss, dz), (loss_ref, dz_ref) = outs
    assert loss.dtype == torch.float32 and dz.dtype == dtype and dz.shape == z.shape
    assert rel(loss, loss_ref) <= 1e-5
    assert rel(dz, dz_ref) <= tol
    assert dz[2].abs().max() == 0 and dz[7].abs().max() == 0  # ignored rows
    assert torch.isfinite(dz).all() and dz[0].abs().max() > 0


def test_next_token_form_equals_the_shifted_reference():
    g = torch.Generator().manual_seed(1)
    b, l, V = 2, 9, 50
    logits = torch.randn(b, l, V, generator=g, dtype=torch.float64).float().to(TRITON_DEVICE)
    ids = torch.randint(0, V, (b, l), generator=g).to(TRITON_DEVICE)
    outs = []
    for use_kernel in (True, False):
        zl = logits.clone().requires_grad_()
        if use_kernel:
            loss = next_token_cross_entropy_sum(zl, ids)
        else:
            loss = cross_entropy_reference(zl[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))
        outs.append((loss, torch.autograd.grad(loss, zl)[0]))
    (loss, dz), (loss_ref, dz_ref) = outs
    assert rel(loss, loss_ref) <= 1e-6 and rel(dz, dz_ref) <= 1e-5
    assert dz[:, -1].abs().max() == 0  # the last position predicts nothing


def test_shape_errors_are_clear():
    with pytest.raises(ValueError, match=r"must be \(rows, V\)"):
        cross_entropy_sum_triton(torch.ones(2, 3, 4), torch.zeros(2, dtype=torch.long))
