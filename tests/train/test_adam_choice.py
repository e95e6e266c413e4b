"""hmscale.train.engine.resolve_adam / fused_adam: which Adam steps the ZeRO partitions.

torch's fused AdamW (built by the engine and handed to DeepSpeed) gives the losses of torch's foreach Adam (as
DeepSpeed builds it from the JSON) under ZeRO 1, 2 and 3, fp32, clipping and param groups with their own lr; and
the choice follows the device, the JSON's optimizer type and its offload setting."""

import math

import pytest
import torch
from torch import nn

from hmscale.train.engine import OptimSpec, TrainingError, build_engine, ds_config_for, init_distributed, resolve_adam


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(12, 12), nn.Linear(12, 1)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))).pow(2).mean()


def _train(stage, adam, steps=6):
    init_distributed()
    torch.manual_seed(0)
    model = Net()
    groups = [{"params": list(model.a.parameters()), "lr": 2e-2}, {"params": list(model.b.parameters()), "lr": 5e-3}]
    spec = OptimSpec(lr=2e-2, micro_batch_size=4, total_steps=steps, warmup_steps=2, zero_stage=stage,
                     grad_clip=0.5, weight_decay=0.01, adam=adam)
    engine = build_engine(model, spec, dp_world=1, params=groups)
    base = getattr(engine.optimizer, "optimizer", engine.optimizer)
    x = torch.randn(4, 12, generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(steps):  # one batch over and over: the loss must fall
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses, base


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fused_adam_gives_the_foreach_losses(stage):
    fused, opt_f = _train(stage, "fused")
    ref, opt_r = _train(stage, "foreach")
    assert all(gr.get("fused") for gr in opt_f.param_groups) and not any(gr.get("fused") for gr in opt_r.param_groups)
    assert isinstance(opt_f, torch.optim.AdamW) and opt_f.param_groups[0]["betas"] == (0.9, 0.95)  # the JSON's
    assert fused[-1] < fused[0]
    for a, b in zip(fused, ref):
        assert math.isclose(a, b, rel_tol=1e-5), (fused, ref)


def _resolve(adam, stage=2, cuda=True, monkeypatch=None, **conf_edits):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    spec = OptimSpec(lr=1e-3, micro_batch_size=2, zero_stage=stage, adam=adam)
    conf = ds_config_for(spec, 1)
    for k, v in conf_edits.items():
        conf[k] = v
    return resolve_adam(spec, conf)


def test_auto_choices(monkeypatch):
    assert _resolve("auto", cuda=True, monkeypatch=monkeypatch) == "fused"
    assert _resolve("auto", cuda=False, monkeypatch=monkeypatch) == "foreach"
    offload = {"stage": 3, "offload_optimizer": {"device": "cpu"}}
    assert _resolve("auto", cuda=True, monkeypatch=monkeypatch, zero_optimization=offload) == "foreach"  # JSON's torch_adam
    lamb = {"type": "Lamb", "params": {}}
    assert _resolve("auto", cuda=True, monkeypatch=monkeypatch, optimizer=lamb) == "deepspeed"
    assert _resolve("foreach", cuda=True, monkeypatch=monkeypatch) == "foreach"


def test_choices_follow_the_engine_device_not_the_host(monkeypatch):
    """A CPU engine on a GPU host (parallel.use_gpu=false) steps and offloads as on a CPU machine: foreach Adam, no
    pinned offload buffers; on_gpu=None keeps the host's answer."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    offload = ds_config_for(OptimSpec(lr=1e-3, micro_batch_size=2, ds_config="ds_configs/zero3_offload.json"), 1)
    assert offload["zero_optimization"]["offload_optimizer"].get("pin_memory") is not False
    for on_gpu, adam, pinned in ((False, "foreach", False), (True, "fused", None), (None, "fused", None)):
        spec = OptimSpec(lr=1e-3, micro_batch_size=2, zero_stage=2, on_gpu=on_gpu)
        assert resolve_adam(spec, ds_config_for(spec, 1)) == adam, on_gpu
        spec = OptimSpec(lr=1e-3, micro_batch_size=2, ds_config="ds_configs/zero3_offload.json", on_gpu=on_gpu)
        zero = ds_config_for(spec, 1)["zero_optimization"]
        assert (zero["offload_optimizer"].get("pin_memory") is False) == (pinned is False), on_gpu
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    spec = OptimSpec(lr=1e-3, micro_batch_size=2, zero_stage=2, on_gpu=True)
    assert resolve_adam(spec, ds_config_for(spec, 1)) == "fused"


@pytest.mark.parametrize("edits, message", [
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}, "offloads the optimizer"),
    ({"optimizer": {"type": "Lamb", "params": {}}}, "not Adam/AdamW"),
])
def test_fused_refuses_what_it_cannot_step(monkeypatch, edits, message):
    with pytest.raises(TrainingError, match=message):
        _resolve("fused", monkeypatch=monkeypatch, **edits)


def test_unknown_choice_is_refused(monkeypatch):
    with pytest.raises(TrainingError, match="parallel.adam"):
        _resolve("lion", monkeypatch=monkeypatch)
