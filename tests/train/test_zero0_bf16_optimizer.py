"""ZeRO 0 with bf16 trains as ZeRO 1 with bf16 does (one rank, tp=1).

With bf16, ZeRO 0 gets DeepSpeed's FP16_UnfusedOptimizer (ZeRO 1: DeepSpeedZeroOptimizer). Its constructor took one
optimizer step with zero gradients to allocate Adam's state (``initialize_optimizer_states``): Adam's step counter
started at 1, so the first real update was 0.735 times ZeRO 1's (bias corrections one step late) and weight decay
shrank the fp32 master weights once before training. Step 0's loss was equal, step 1's not (4.5979 against ZeRO 1's
4.6039 and fp32's 4.6042, with tests/parallel/test_tp_stage2_end_to_end.py's bf16 settings at tp=1). ``build_engine`` now
builds the wrapper without that step (``engine._no_warmup_optimizer_step``).

Tolerance: both optimizers hold fp32 master weights, take bf16 gradients to fp32 and run the same torch Adam, so the
updates are the same arithmetic; the one computation done differently is the clipping norm (ZeRO 1: our foreach fp64
reduction over the flat gradient buffer; ZeRO 0: DeepSpeed's per-tensor fp32 norms summed in Python floats), an
fp32 rounding apart (~1e-7 relative). Through the clipping coefficient that moves a master weight by an fp32 ulp or
so and, rarely, the bf16 rounding of a weight. Measured here (4 steps): losses and norms <= 1.8e-7 relative apart,
master weights <= 1.2e-7 (0.0 without clipping). 1e-5 relative on losses and norms and 1e-5 absolute on the master
weights leave a margin of 50x or more above that and stay far below the bug: 3.3e-3 relative on the losses and norms,
1.9e-2 on the master weights, after the same 4 steps (1.3e-3 on the reported step-1 loss).
"""

import math
import os

import numpy as np
import pytest
import torch
from torch import nn

from hmscale.train.engine import OptimSpec, build_engine, init_distributed

os.environ.setdefault("HMSCALE_NO_PROGRESS", "1")

REL = 1e-5  # see the module docstring
VOCAB = 64


class Tiny(nn.Module):
    """Embedding, a residual tanh layer, a LayerNorm and an LM head: weights, biases, norm parameters."""

    def __init__(self, d=32):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.mix = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB)

    def forward(self, x):
        h = self.emb(x[:, :-1])
        h = h + torch.tanh(self.mix(h))
        logits = self.head(self.norm(h)).float()
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), x[:, 1:].reshape(-1))


def _engine(stage, adam, clip, weight_decay=0.1, steps=4):
    init_distributed()
    torch.manual_seed(0)
    spec = OptimSpec(lr=1e-2, micro_batch_size=4, total_steps=steps, zero_stage=stage, bf16=True, grad_clip=clip,
                     weight_decay=weight_decay, adam=adam)
    return build_engine(Tiny(), spec, dp_world=1)


def _masters(engine) -> torch.Tensor:
    """The fp32 master weights, flat, in parameter order."""
    opt = engine.optimizer
    if hasattr(opt, "fp32_groups"):  # FP16_UnfusedOptimizer (ZeRO 0)
        return torch.cat([p.detach().reshape(-1) for g in opt.fp32_groups for p in g])
    return torch.cat([p.detach().reshape(-1) for p in opt.single_partition_of_fp32_groups])  # ZeRO 1, one rank


def _adam_steps(engine) -> set[int]:
    return {int(s["step"]) for s in engine.optimizer.optimizer.state.values()}


def _train(engine, steps=4):
    g = torch.Generator().manual_seed(1)
    losses, norms = [], []
    for _ in range(steps):
        loss = engine(torch.randint(0, VOCAB, (4, 17), generator=g))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
        norms.append(float(engine.get_global_grad_norm()))
    return losses, norms


def test_zero0_bf16_takes_no_optimizer_step_before_training():
    """DeepSpeed's bf16 wrapper of ZeRO 0 is built without its zero-gradient step: no Adam state, master weights
    untouched by weight decay (they are the bf16 weights, exactly); after one step Adam has counted one step."""
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    engine = _engine(0, "foreach", clip=1.0)
    assert isinstance(engine.optimizer, FP16_UnfusedOptimizer)
    assert _adam_steps(engine) == set()  # it was {1}
    bf16 = torch.cat([p.detach().float().reshape(-1) for p in engine.module.parameters()])
    assert torch.equal(_masters(engine), bf16)  # with weight decay 0.1 at lr 1e-2 they were 0.999 of them
    _train(engine, steps=1)
    assert _adam_steps(engine) == {1}  # it was {2}; ZeRO 1's and fp32's Adam count 1


@pytest.mark.parametrize("adam", ["foreach", "fused"])  # the JSON's torch Adam, or torch's AdamW handed to DeepSpeed
@pytest.mark.parametrize("clip", [1.0, 0.3])  # the norms are ~0.8: clipping off, then on at every step
def test_zero0_and_zero1_agree_in_bf16(adam, clip):
    z0, z1 = _engine(0, adam, clip), _engine(1, adam, clip)
    l0, n0 = _train(z0)
    l1, n1 = _train(z1)
    assert l0[0] == l1[0]  # the same bf16 weights and batch: step 0 was always equal
    for a, b in zip(l0 + n0, l1 + n1):
        assert math.isclose(a, b, rel_tol=REL), (l0, l1, n0, n1)
    assert (clip < min(n1)) == (clip == 0.3)  # the clipping acts where it should
    diff = (_masters(z0) - _masters(z1)).abs().max().item()
    assert diff <= REL, diff
    assert _adam_steps(z0) == _adam_steps(z1) == {4}


def test_stage2_losses_agree_between_zero0_and_zero1_in_bf16(tmp_path):
    """The reported symptom, through the recipe: tests/parallel/test_tp_stage2_end_to_end.py's bf16 stage-2 settings at tp=1
    (clipping at 0.05 active, one warmup step) on dist_job's tiny student, ZeRO 0 against ZeRO 1."""
    from transformers import GPTNeoXForCausalLM

    from hmscale.config import build_config
    from hmscale.models.convert import to_hedgehog
    from hmscale.teacher.flavors import neox_config
    from hmscale.train.data import ArraySource
    from hmscale.train.stage2 import run_stage2

    tokens = np.random.default_rng(1).integers(0, 96, size=(64, 32))
    losses = {}
    for z in (0, 1):
        torch.manual_seed(0)
        student = to_hedgehog(GPTNeoXForCausalLM(neox_config("pythia-nano", vocab_size=96)).eval())
        with torch.no_grad():  # a non-trivial phi, as after stage 1
            for fm in student.feature_maps:
                fm.weight.add_(0.05 * torch.randn_like(fm.weight))
        cfg = build_config({}, ["stage2.steps=3", "stage2.micro_batch_size=4", "stage2.warmup_steps=1",
                                "stage2.lr=3e-3", "stage2.grad_clip=0.05", "parallel.checkpoint_every=100",
                                "parallel.bf16=true", f"parallel.zero_stage={z}"])
        losses[z] = run_stage2(cfg, tmp_path / f"z{z}", student=student, source=ArraySource(tokens), resume=False,
                               export=False)["losses"]
    assert len(losses[0]) == 3 and losses[0][0] == losses[1][0]
    for a, b in zip(losses[0], losses[1]):
        assert math.isclose(a, b, rel_tol=REL), losses  # step 1 was 4.5979 against 4.6039 (1.3e-3 apart)
