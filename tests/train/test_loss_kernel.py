"""Stage 2's cross-entropy on the Triton backend (kernels.next_token_cross_entropy_sum, under TRITON_INTERPRET=1
on CPU) gives the per-sequence checkpointed path's loss and logits gradient (fp32, 1e-6 / 1e-5 relative); KD
keeps the per-sequence path."""

import os

import pytest
import torch

from hmscale.train import stage2

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                reason="needs TRITON_INTERPRET=1 or a GPU")


def _loss_and_grad(monkeypatch, backend, ce_weight=1.0, kd_weight=0.0):
    monkeypatch.setenv("HMSCALE_SSD_BACKEND", backend)
    dev = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 11, 40, generator=g) * 3).to(dev).requires_grad_()
    ids = torch.randint(0, 40, (3, 11), generator=g).to(dev)
    batch = {}
    if kd_weight:
        batch = {"topk_ids": torch.randint(0, 40, (3, 11, 4), generator=g).to(dev),
                 "topk_logprobs": torch.log_softmax(torch.randn(3, 11, 4, generator=g), -1).to(dev)}
    loss, extras = stage2.causal_lm_losses(logits, ids, batch, kd_weight, ce_weight=ce_weight)
    (grad,) = torch.autograd.grad(loss, logits)
    return loss.detach(), extras["ce"], grad


@pytest.mark.parametrize("ce_weight", [1.0, 0.5])
def test_kernel_path_equals_the_per_sequence_path(monkeypatch, ce_weight):
    calls = []
    real = stage2.kernels.next_token_cross_entropy_sum
    monkeypatch.setattr(stage2.kernels, "next_token_cross_entropy_sum", lambda *a: calls.append(1) or real(*a))
    loss, ce, grad = _loss_and_grad(monkeypatch, "triton", ce_weight)
    assert calls == [1]
    loss_ref, ce_ref, grad_ref = _loss_and_grad(monkeypatch, "torch", ce_weight)
    assert calls == [1]  # the torch backend kept the per-sequence path
    torch.testing.assert_close(loss, loss_ref, rtol=1e-6, atol=0)
    torch.testing.assert_close(ce, ce_ref, rtol=1e-6, atol=0)
    torch.testing.assert_close(grad, grad_ref, rtol=1e-5, atol=1e-8)
    assert grad[:, -1].abs().max() == 0 and grad.abs().sum() > 0


def test_kd_keeps_the_per_sequence_path(monkeypatch):
    monkeypatch.setattr(stage2.kernels, "next_token_cross_entropy_sum", lambda *a: pytest.fail("kernel used with KD"))
    loss, _, _ = _loss_and_grad(monkeypatch, "triton", kd_weight=0.5)
    assert torch.isfinite(loss)
