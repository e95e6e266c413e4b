"""hmscale.train.zero_foreach: the foreach gradient norm and overflow check give DeepSpeed's own results.

One-process gloo engines on CPU (fp32), ZeRO-1 and ZeRO-2, a model with many small tensors (as the HedgeMamba
student has), clipping active."""

import math

import pytest
import torch
from torch import nn

from hmscale.train.engine import OptimSpec, build_engine, init_distributed
from hmscale.train.zero_foreach import grad_norm_foreach


class Many(nn.Module):
    """Linear layers with per-feature scales: 3 tensors per layer, some of shape (4,)."""

    def __init__(self, layers=6, d=16):
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))
        self.scales = nn.ParameterList(nn.Parameter(torch.ones(d) + 0.1 * torch.randn(d)) for _ in range(layers))
        self.tiny = nn.Parameter(torch.randn(4))

    def forward(self, x):
        for lin, s in zip(self.lins, self.scales):
            x = torch.tanh(lin(x)) * s
        return (x.sum(-1) * self.tiny.sum()).pow(2).mean()


def _engine(stage, foreach, seed=0):
    init_distributed()
    torch.manual_seed(seed)
    model = Many()
    spec = OptimSpec(lr=3e-2, micro_batch_size=4, total_steps=20, zero_stage=stage, grad_clip=0.05, adam="foreach")
    return build_engine(model, spec, dp_world=1, foreach_grad_checks=foreach)


def _batches(n):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, 16, generator=g) for _ in range(n)]


def _train(engine, batches):
    losses, norms = [], []
    for x in batches:
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
        norms.append(float(engine.get_global_grad_norm()))
    return losses, norms


@pytest.mark.parametrize("stage", [1, 2])
def test_same_losses_and_norms_as_deepspeed(stage):
    fast = _engine(stage, True)
    assert fast.optimizer.get_grad_norm_direct.__func__ is grad_norm_foreach  # installed
    slow = _engine(stage, False)
    assert type(slow.optimizer).get_grad_norm_direct is slow.optimizer.get_grad_norm_direct.__func__
    batches = _batches(6)
    lf, nf = _train(fast, batches)
    ls, ns = _train(slow, batches)
    assert min(ns) > 0.05  # clipping acts on every step, so the norm's value matters
    for a, b in zip(nf + lf, ns + ls):
        assert math.isclose(a, b, rel_tol=1e-6), (nf, ns, lf, ls)
    assert lf[-1] != lf[0]


def _backward_with(engine, bad):
    """One backward; the gradient of one element of one small tensor replaced by ``bad`` (None: unchanged)."""
    p = engine.module.tiny
    hook = None
    if bad is not None:
        mask = torch.tensor([False, True, False, False])
        hook = p.register_hook(lambda g: torch.where(mask, torch.full_like(g, bad), g))
    engine.backward(engine(_batches(1)[0]))
    if hook is not None:
        hook.remove()


@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("stage", [1, 2])
def test_overflow_and_norm_decisions_match_deepspeed(stage, bad):
    engine = _engine(stage, True)
    _backward_with(engine, bad)
    opt = engine.optimizer
    ours = bool(opt.has_overflow_partitioned_grads_serial())
    theirs = bool(type(opt).has_overflow_partitioned_grads_serial(opt))
    assert ours == theirs == (bad is not None)
    grads, params = opt.averaged_gradients[0], opt.params_in_partition[0]
    n_ours = float(opt.get_grad_norm_direct(grads, params))
    n_theirs = float(type(opt).get_grad_norm_direct(opt, grads, params))
    if bad is None:
        assert n_ours > 0 and math.isclose(n_ours, n_theirs, rel_tol=1e-6)
    else:
        assert n_ours == n_theirs == -1.0  # DeepSpeed's invalid-norm sentinel


@pytest.mark.parametrize("stage", [1, 2])
def test_a_nan_gradient_skips_the_step(stage):
    engine = _engine(stage, True)
    before = [q.detach().clone() for q in engine.module.parameters()]
    _backward_with(engine, float("nan"))
    engine.step()
    assert engine.optimizer.overflow
    assert all(torch.equal(a, q.detach()) for a, q in zip(before, engine.module.parameters()))


def test_foreach_norms_propagate_non_finite_values():
    """What the overflow check relies on: the max-abs norm of a tensor with a NaN or an inf is not finite."""
    ok = torch.randn(7)
    for bad in (float("nan"), float("inf"), -float("inf")):
        t = torch.randn(7, dtype=torch.bfloat16)
        t[3] = bad
        peak = torch._foreach_norm([ok, t], float("inf"))
        assert torch.isfinite(peak[0]) and not torch.isfinite(peak[1].float())
