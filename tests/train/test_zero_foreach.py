"""hmscale.train.zero_foreach: the foreach gradient norm and overflow check give DeepSpeed's own results.

One-process gloo engines on CPU (fp32), ZeRO-1 and ZeRO-2, a model with many small tensors (as the HedgeMamba
student has), clipping active."""

import math

import pytest
import torch
from torch import nn

from hmscale.train.engine import OptimSpec, build_engine, init_distributed
from hmscale.train import zero_foreach
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


# --------------------------------------------------------------------------- one norm decides the overflow check


@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("stage", [1, 2])
def test_overflow_by_norm_matches_deepspeed_and_keeps_the_norm_for_the_step(stage, bad):
    engine = _engine(stage, True)
    _backward_with(engine, bad)
    opt = engine.optimizer
    assert opt.has_overflow.__func__ is zero_foreach.has_overflow_by_norm
    theirs = type(opt).has_overflow(opt)  # DeepSpeed's: the flag's own all-reduce and .item()
    ours = opt.has_overflow()
    assert ours == theirs == (bad is not None)
    if bad is None:  # the step's norm call gets the norm the check computed, on the host
        stashed = opt.scaled_global_norm()
        assert stashed.device.type == "cpu"
        recomputed = type(opt).scaled_global_norm(opt)
        assert math.isclose(float(stashed), float(recomputed), rel_tol=1e-6) and float(stashed) > 0
    assert opt._hm_norm_stash is None  # consumed, or never kept for an overflowing step


def test_the_step_computes_the_norm_once(monkeypatch):
    """One norm per parameter group per step (DeepSpeed's step used to ask the device twice: the overflow flag,
    then the clipping norm's validity)."""
    engine = _engine(2, True)
    calls = []
    real = zero_foreach._sum_of_squares
    monkeypatch.setattr(zero_foreach, "_sum_of_squares", lambda ts: calls.append(len(ts)) or real(ts))
    for x in _batches(3):
        engine.backward(engine(x))
        engine.step()
    assert len(calls) == 3 and len(set(calls)) == 1 and calls[0] > 10  # all the partition's tensors, once a step


def test_a_stale_norm_is_not_reused():
    """A norm kept by an overflow check is used only for the gradient lists it saw."""
    engine = _engine(2, True)
    opt = engine.optimizer
    _backward_with(engine, None)
    assert opt.has_overflow() is False and opt._hm_norm_stash is not None
    engine.step()  # consumes it
    engine.backward(engine(_batches(2)[1]))
    opt._hm_norm_stash = (tuple(opt.averaged_gradients.get(i) for i in range(len(opt.bit16_groups))), torch.tensor(123.0))
    assert float(opt.scaled_global_norm()) == 123.0  # same lists: reused
    opt._hm_norm_stash = ((object(),), torch.tensor(123.0))  # another step's lists
    assert float(opt.scaled_global_norm()) != 123.0


def test_one_flat_view_only_for_exactly_tiled_storage():
    buf = torch.randn(30)
    parts = [buf[20:30], buf[0:12], buf[12:20].view(2, 4)]  # adjacent, out of order
    flat = zero_foreach._one_flat_view(parts)
    assert flat is not None and flat.data_ptr() == buf.data_ptr() and flat.numel() == 30
    assert math.isclose(float(zero_foreach._sum_of_squares(parts)), float(buf.double().pow(2).sum()), rel_tol=1e-6)
    assert zero_foreach._one_flat_view([buf[0:10], buf[11:20]]) is None  # a gap
    assert zero_foreach._one_flat_view([buf[0:10], buf[5:20]]) is None  # an overlap
    assert zero_foreach._one_flat_view([buf[0:10], torch.randn(5)]) is None  # another storage
    assert zero_foreach._one_flat_view([buf.view(5, 6).t()]) is None  # not contiguous
    gapped = [buf[0:10], buf[11:20]]
    assert math.isclose(float(zero_foreach._sum_of_squares(gapped)),
                        float(buf[0:10].double().pow(2).sum() + buf[11:20].double().pow(2).sum()), rel_tol=1e-6)


@pytest.mark.parametrize("stage", [1, 2])
def test_the_partition_gradients_are_one_flat_view(stage):
    """The one-reduction path is the one real engines take (ZeRO-1/2 keep the partition's gradients contiguous)."""
    engine = _engine(stage, True)
    _backward_with(engine, None)
    opt = engine.optimizer
    kept = zero_foreach._norm_inputs(opt, opt.averaged_gradients[0], opt.params_in_partition[0])
    assert len(kept) == len(opt.params_in_partition[0]) and zero_foreach._one_flat_view(kept) is not None


def test_the_norm_decides_only_where_it_counts_every_gradient():
    engine = _engine(2, True)
    opt = engine.optimizer
    assert zero_foreach._norm_can_decide_overflow(opt)
    opt.bit16_groups[0][0].ds_pipe_replicated = True  # counted on one pipeline stage only: the norm cannot decide
    assert not zero_foreach._norm_can_decide_overflow(opt)
    opt._hm_norm_decides_overflow = False
    _backward_with(engine, float("nan"))
    assert opt.has_overflow() is True and opt._hm_norm_stash is None  # DeepSpeed's own flag
