"""Triton next-token loss (under TRITON_INTERPRET=1 on CPU, or on a GPU) vs plain PyTorch: cross-entropy against
``F.cross_entropy`` in fp32 (loss and logits gradient; fp32 1e-5 relative, bf16 logits 1e-2 for the gradient), a
vocabulary that is not a multiple of the block, ignored rows, large logits; the cached top-k KD term at two
temperatures against a float64 log-softmax reference (1e-5)."""

import pytest
import torch

from kernels import cross_entropy_reference
from kernels.cross_entropy import _BLOCK_V, cross_entropy_sum_triton, next_token_loss_sums

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
            loss, kd = next_token_loss_sums(zl, ids)
            assert kd == 0
        else:
            loss = cross_entropy_reference(zl[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))
        outs.append((loss, torch.autograd.grad(loss, zl)[0]))
    (loss, dz), (loss_ref, dz_ref) = outs
    assert rel(loss, loss_ref) <= 1e-6 and rel(dz, dz_ref) <= 1e-5
    assert dz[:, -1].abs().max() == 0  # the last position predicts nothing


def test_shape_errors_are_clear():
    with pytest.raises(ValueError, match=r"must be \(rows, V\)"):
        cross_entropy_sum_triton(torch.ones(2, 3, 4), torch.zeros(2, dtype=torch.long))


def _kd_reference(logits, ids, topk_ids, topk_lp, T):
    """float64: CE and -T^2 sum_k softmax(tlp / T)_k log_softmax(z / T)[i_k] over positions t < l-1."""
    z = logits[:, :-1].double()
    ce = torch.nn.functional.cross_entropy(z.reshape(-1, z.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum")
    p = torch.softmax(topk_lp[:, :-1].double() / T, -1)
    s_lp = torch.log_softmax(z / T, -1).gather(-1, topk_ids[:, :-1])
    return ce, -(p * s_lp).sum() * T * T


@pytest.mark.parametrize("T", [1.0, 2.0])
def test_kd_term_matches_the_reference(T):
    g = torch.Generator().manual_seed(2)
    b, l, V, k = 2, 7, _BLOCK_V + 45, 5
    logits = (torch.randn(b, l, V, generator=g) * 3).to(TRITON_DEVICE)
    ids = torch.randint(0, V, (b, l), generator=g).to(TRITON_DEVICE)
    topk_ids = torch.randint(0, V, (b, l, k), generator=g)
    topk_ids[0, 1, 1] = topk_ids[0, 1, 0]  # a repeated id adds up
    topk_ids = topk_ids.to(TRITON_DEVICE)
    topk_lp = torch.log_softmax(torch.randn(b, l, k, generator=g) * 2, -1).to(TRITON_DEVICE)
    zl = logits.clone().requires_grad_()
    ce, kd = next_token_loss_sums(zl, ids, topk_ids, topk_lp, temperature=T)
    ref = logits.double().requires_grad_()
    _check_against_reference(zl, ce, kd, ref, _kd_reference(ref, ids, topk_ids, topk_lp, T), kd_tol=1e-5)


def _check_against_reference(z, ce, kd, ref, ref_sums, kd_tol, w_ce=0.7, w_kd=0.4):
    """Loss sums and the gradient of w_ce * ce + w_kd * kd against the float64 reference's; the last position's
    gradient is zero."""
    ce_ref, kd_ref = ref_sums
    (dz,) = torch.autograd.grad(w_ce * ce + w_kd * kd, z)
    (dz_ref,) = torch.autograd.grad(w_ce * ce_ref + w_kd * kd_ref, ref)
    assert rel(ce.double(), ce_ref) <= 1e-5 and rel(kd.double(), kd_ref) <= kd_tol and kd > 0
    assert rel(dz.double(), dz_ref) <= 1e-5
    assert dz[:, -1].abs().max() == 0


def test_kd_gradient_alone():
    """Only the KD output used (the CE output's gradient is None in backward)."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(1, 5, 33, generator=g).to(TRITON_DEVICE).requires_grad_()
    ids = torch.randint(0, 33, (1, 5), generator=g).to(TRITON_DEVICE)
    tk = torch.randint(0, 33, (1, 5, 3), generator=g).to(TRITON_DEVICE)
    tlp = torch.log_softmax(torch.randn(1, 5, 3, generator=g), -1).to(TRITON_DEVICE)
    _, kd = next_token_loss_sums(logits, ids, tk, tlp, temperature=1.5)
    (dz,) = torch.autograd.grad(kd, logits)
    ref = logits.detach().double().requires_grad_()
    (dz_ref,) = torch.autograd.grad(_kd_reference(ref, ids, tk, tlp, 1.5)[1], ref)
    assert rel(dz.double(), dz_ref) <= 1e-5


def test_topk_shape_errors_are_clear():
    z, ids = torch.ones(1, 4, 8), torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="both topk_ids and topk_logprobs"):
        next_token_loss_sums(z, ids, torch.zeros(1, 4, 2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"must both be \(b, l, k\)"):
        next_token_loss_sums(z, ids, torch.zeros(1, 3, 2, dtype=torch.long), torch.zeros(1, 3, 2))


def _online_reference(logits, ids, teacher, T):
    z = logits[:, :-1].double()
    V = z.shape[-1]
    ce = torch.nn.functional.cross_entropy(z.reshape(-1, V), ids[:, 1:].reshape(-1), reduction="sum")
    t_lp = torch.log_softmax(teacher[:, :-1, :V].double() / T, -1)
    s_lp = torch.log_softmax(z / T, -1)
    return ce, (t_lp.exp() * (t_lp - s_lp)).sum() * T * T


@pytest.mark.parametrize("T", [1.0, 2.0])
def test_live_teacher_kl_matches_the_reference(T):
    """Full-vocabulary KL against the live teacher's logits, a teacher vocabulary wider than the student's (its
    first V columns read in place), in bf16 like the teacher's forward."""
    g = torch.Generator().manual_seed(6)
    b, l, V = 2, 6, _BLOCK_V + 77
    logits = (torch.randn(b, l, V, generator=g) * 3).to(TRITON_DEVICE)
    ids = torch.randint(0, V, (b, l), generator=g).to(TRITON_DEVICE)
    teacher = (torch.randn(b, l, V + 9, generator=g) * 3).to(torch.bfloat16).to(TRITON_DEVICE)
    zl = logits.clone().requires_grad_()
    ce, kd = next_token_loss_sums(zl, ids, teacher_logits=teacher, temperature=T)
    ref = logits.double().requires_grad_()
    _check_against_reference(zl, ce, kd, ref, _online_reference(ref, ids, teacher, T), kd_tol=1e-4)


def test_kl_of_a_teacher_equal_to_the_student_is_zero():
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(1, 4, 50, generator=g).to(TRITON_DEVICE).requires_grad_()
    ids = torch.randint(0, 50, (1, 4), generator=g).to(TRITON_DEVICE)
    _, kd = next_token_loss_sums(logits, ids, teacher_logits=logits.detach(), temperature=1.3)
    (dz,) = torch.autograd.grad(kd, logits)
    assert abs(float(kd)) < 1e-5 and dz.abs().max() < 1e-6


def test_teacher_errors_are_clear():
    z, ids = torch.ones(1, 4, 8), torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="not both"):
        next_token_loss_sums(z, ids, torch.zeros(1, 4, 2, dtype=torch.long), torch.zeros(1, 4, 2), teacher_logits=z)
    with pytest.raises(ValueError, match=r"must be \(b, l, >= V\)"):
        next_token_loss_sums(z, ids, teacher_logits=torch.ones(1, 4, 7))
