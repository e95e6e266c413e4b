"""Stage 2's loss on the Triton backend (kernels.next_token_loss_sums, under TRITON_INTERPRET=1 on CPU) gives the
per-sequence checkpointed path's loss, CE, KD and logits gradient (fp32; 1e-6 / 1e-5 relative): cross-entropy
alone, with the cached top-k KD term and with the live teacher's logits, at two temperatures; validation on both
paths; a vocabulary-parallel head refuses the kernel."""

import os

import pytest
import torch

from hmscale.train import stage2
from hmscale.train.engine import TrainingError

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                reason="needs TRITON_INTERPRET=1 or a GPU")
DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


def _inputs(kd):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 11, 40, generator=g) * 3).to(DEV)
    ids = torch.randint(0, 40, (3, 11), generator=g).to(DEV)
    batch = {}
    if kd:
        batch = {"topk_ids": torch.randint(0, 40, (3, 11, 4), generator=g).to(DEV),
                 "topk_logprobs": torch.log_softmax(torch.randn(3, 11, 4, generator=g), -1).to(DEV)}
    return logits, ids, batch


def _loss_and_grad(monkeypatch, backend, ce_weight=1.0, kd_weight=0.0, temperature=1.0, **kw):
    monkeypatch.setenv("HMSCALE_SSD_BACKEND", backend)
    logits, ids, batch = _inputs(kd_weight > 0)
    logits.requires_grad_()
    loss, extras = stage2.causal_lm_losses(logits, ids, batch, kd_weight, temperature, ce_weight=ce_weight, **kw)
    (grad,) = torch.autograd.grad(loss, logits)
    return loss.detach(), extras, grad


@pytest.mark.parametrize("ce_weight, kd_weight, temperature", [(1.0, 0.0, 1.0), (0.5, 0.0, 1.0), (1.0, 0.5, 1.0),
                                                                 (0.9, 0.3, 2.0)])
def test_kernel_path_equals_the_per_sequence_path(monkeypatch, ce_weight, kd_weight, temperature):
    calls = []
    real = stage2.kernels.next_token_loss_sums
    monkeypatch.setattr(stage2.kernels, "next_token_loss_sums", lambda *a, **k: calls.append(1) or real(*a, **k))
    loss, extras, grad = _loss_and_grad(monkeypatch, "triton", ce_weight, kd_weight, temperature)
    assert calls == [1]
    loss_ref, extras_ref, grad_ref = _loss_and_grad(monkeypatch, "torch", ce_weight, kd_weight, temperature)
    assert calls == [1]  # the torch backend kept the per-sequence path
    torch.testing.assert_close(loss, loss_ref, rtol=1e-6, atol=0)
    assert extras.keys() == extras_ref.keys() == ({"ce", "kd"} if kd_weight else {"ce"})
    for k in extras:
        torch.testing.assert_close(extras[k], extras_ref[k], rtol=1e-6, atol=0)
    torch.testing.assert_close(grad, grad_ref, rtol=1e-5, atol=1e-8)
    assert grad[:, -1].abs().max() == 0 and grad.abs().sum() > 0


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_live_teacher_kd_equals_the_per_sequence_path(monkeypatch, temperature):
    calls = []
    real = stage2.kernels.next_token_loss_sums
    monkeypatch.setattr(stage2.kernels, "next_token_loss_sums", lambda *a, **k: calls.append(1) or real(*a, **k))
    logits, ids, _ = _inputs(False)
    teacher = (torch.randn(3, 11, 44, generator=torch.Generator().manual_seed(4)) * 2).to(DEV)  # wider vocabulary
    got = {}
    for backend in ("triton", "torch"):
        monkeypatch.setenv("HMSCALE_SSD_BACKEND", backend)
        z = logits.clone().requires_grad_()
        loss, extras = stage2.causal_lm_losses(z, ids, {}, 0.5, temperature, teacher_logits=teacher)
        got[backend] = (loss.detach(), extras, torch.autograd.grad(loss, z)[0])
    assert calls == [1]
    (loss, extras, grad), (loss_ref, extras_ref, grad_ref) = got["triton"], got["torch"]
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=0)
    torch.testing.assert_close(extras["kd"], extras_ref["kd"], rtol=1e-5, atol=0)
    torch.testing.assert_close(grad, grad_ref, rtol=1e-5, atol=1e-8)


def test_vocab_parallel_head_refuses_the_kernel():
    logits, ids, _ = _inputs(False)
    with pytest.raises(TrainingError, match="vocabulary-parallel"):
        stage2.causal_lm_losses(logits, ids, {}, 0.0, vocab_shard=object(), fused_ce=True)


def test_validation_loss_equal_on_both_paths(monkeypatch):
    from types import SimpleNamespace

    lm = torch.nn.Sequential(torch.nn.Embedding(40, 16), torch.nn.Linear(16, 40)).to(DEV)

    def engine(input_ids):
        return SimpleNamespace(logits=lm(input_ids))

    engine.module = lm
    layout = SimpleNamespace(dp_size=1, dp_rank=0, tp_size=1, device=DEV)
    val = torch.randint(0, 40, (5, 9), generator=torch.Generator().manual_seed(5)).numpy()
    calls = []
    real = stage2.kernels.next_token_loss_sums
    monkeypatch.setattr(stage2.kernels, "next_token_loss_sums", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = {}
    for backend in ("triton", "torch"):
        monkeypatch.setenv("HMSCALE_SSD_BACKEND", backend)
        got[backend] = stage2.validation_loss(engine, val, layout, micro_batch_size=2, max_sequences=5)
    assert calls == [1, 1, 1]  # three validation batches on the Triton backend
    assert got["triton"]["val_loss"] == pytest.approx(got["torch"]["val_loss"], rel=1e-6)
    assert lm.training  # restored
