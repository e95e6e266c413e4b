"""stage1.transfer=mixer: stage 1 aligns the whole HedgeMamba mixer (feature maps, conv, dt/A/D, gate) with each
layer's softmax attention output, layer-local; stage 2 starts from exactly that model."""

import os

import numpy as np
import pytest
import torch

from hmscale.config import build_config
from hmscale.train.data import ArraySource
from hmscale.train.engine import TrainingError

os.environ.setdefault("HMSCALE_NO_PROGRESS", "1")

VOCAB, L = 96, 32
COMMON = ["stage1.source=online", "stage1.transfer=mixer", "stage1.micro_batch_size=4", "stage1.steps=8",
          "stage1.lr=0.02", "stage1.warmup_steps=1", "parallel.zero_stage=1"]


def tiny_teacher(seed=0):
    """A random pythia-nano with peaked attention (its q/k/v projections scaled up): a random model's attention
    is nearly uniform, which linear attention matches from the start."""
    from transformers import GPTNeoXForCausalLM

    from hmscale.teacher.flavors import neox_config

    torch.manual_seed(seed)
    model = GPTNeoXForCausalLM(neox_config("pythia-nano", vocab_size=VOCAB)).eval()
    with torch.no_grad():
        for layer in model.gpt_neox.layers:
            layer.attention.query_key_value.weight.mul_(4.0)
    return model


def toks(n=48):
    return np.random.default_rng(1).integers(0, VOCAB, size=(n, L))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from hmscale.train.stage1 import run_stage1

    run_dir = tmp_path_factory.mktemp("mixer")
    teacher = tiny_teacher()
    res = run_stage1(build_config({}, COMMON), run_dir, teacher=teacher, source=ArraySource(toks()))
    return run_dir, teacher, res


def test_mixer_transfer_trains_the_recurrent_parts_only(trained):
    from hmscale.models.convert import to_mixer_student
    from hmscale.models.hedgemamba import HedgeMambaForCausalLM, param_kind
    from hmscale.train.stage1 import load_stage1_student

    run_dir, teacher, res = trained
    assert np.mean(res["losses"][-3:]) < 0.8 * res["losses"][0]  # the layer-local cosine loss falls
    loaded = load_stage1_student(run_dir, teacher)
    assert isinstance(loaded, HedgeMambaForCausalLM)
    init = dict(to_mixer_student(teacher).named_parameters())
    moved = set()
    for name, p in loaded.named_parameters():
        if param_kind(name) == "teacher":  # embeddings, LayerNorms, qkv/dense, MLPs, head: the teacher's
            assert torch.equal(p, init[name]), name
        elif not torch.equal(p, init[name]):
            moved.add(name.split(".")[-2] if name.split(".")[-1] in ("weight", "bias") else name.split(".")[-1])
    assert {"feature_map", "conv", "dt_proj", "z_proj", "A_scale"} <= moved, moved
    # the in-memory result of stage 1 is the exported model
    ids = torch.as_tensor(toks(2))
    with torch.no_grad():
        a, b = res["student_model"](input_ids=ids).logits, loaded(input_ids=ids).logits
    assert torch.allclose(a, b, rtol=0, atol=1e-6)


def test_stage2_starts_from_the_stage1_mixers(trained):
    from hmscale.train.stage1 import load_stage1_student
    from hmscale.train.stage2 import build_stage2_model

    run_dir, teacher, _ = trained
    cfg = build_config({}, COMMON)
    model = build_stage2_model(cfg, run_dir, teacher=teacher)
    ref = load_stage1_student(run_dir, teacher)
    ids = torch.as_tensor(toks(2))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)
    assert all(p.requires_grad for p in model.parameters())  # stage 2 trains everything again
    with pytest.raises(TrainingError, match="stage2.components: the stage-1 mixers were trained with gate=True"):
        build_stage2_model(build_config({}, COMMON + ["stage2.components.gate=false"]), run_dir, teacher=teacher)


def test_live_teacher_targets_equal_the_captured_attention_output():
    """Without cached targets the mixer transfer recomputes the teacher's attention output from the layer input:
    the same loss as with the captured output (what a cache holds)."""
    from hmscale.models.convert import to_hedgehog, to_mixer_student
    from hmscale.teacher.capture import capture_layers
    from hmscale.train.stage1 import Stage1Trainable

    teacher = tiny_teacher(1)
    model = to_mixer_student(teacher)
    with torch.no_grad():  # off the identity init, so the loss is not ~0 on both sides for a trivial reason
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn_like(p))
    module = Stage1Trainable(to_hedgehog(teacher), [0, 1], {0: 1, 1: 1}, 1, mixer_model=model)
    ids = torch.as_tensor(toks(3))
    caps = capture_layers(teacher, ids, qkv=False)
    inputs = {l: caps[l].attn_input for l in (0, 1)}
    live, per_live = module(inputs, {})
    cached, per_cached = module(inputs, {l: caps[l].attn_output for l in (0, 1)})
    assert float(live) > 1e-3
    assert torch.allclose(live, cached, rtol=1e-5, atol=1e-7) and torch.allclose(per_live, per_cached, rtol=1e-5)


@pytest.mark.slow
def test_mixer_transfer_zero3_matches_zero1(launch_job, tmp_path):
    """ZeRO-3 partitions the mixers (their frozen teacher projections too): 2 data-parallel workers give ZeRO-1's
    per-layer losses, and the export gathers the partitioned recurrent parts whole (the same mixers as ZeRO-1's).
    Persistence threshold 0: every parameter is partitioned (by default DeepSpeed keeps parameters this small
    whole on every rank, which would hide a missing gather)."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    ds = json.loads((Path(__file__).resolve().parents[2] / "ds_configs" / "zero3.json").read_text())
    ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    (tmp_path / "zero3_all.json").write_text(json.dumps(ds))
    common = ["stage1.steps=5", "stage1.micro_batch_size=2", "stage1.lr=0.05", "stage1.warmup_steps=1",
              "stage1.source=online", "stage1.transfer=mixer", "parallel.checkpoint_every=100",
              "parallel.num_workers=2"]
    runs = [{"overrides": common + ["parallel.zero_stage=1"], "run_dir": str(tmp_path / "z1"), "stage": "stage1"},
            {"overrides": common + ["parallel.zero_stage=3", f"parallel.ds_config={tmp_path / 'zero3_all.json'}"],
             "run_dir": str(tmp_path / "z3"), "stage": "stage1"}]
    z1, z3 = launch_job({"runs": runs}, world=2)
    assert len(z1) == len(z3) == 5 and z1[-1] != z1[0]
    for a, b in zip(z1, z3):
        for x, y in zip(a, b):
            assert abs(x - y) <= 1e-4 * abs(x) + 1e-9, (z1, z3)
    a = load_file(str(tmp_path / "z1" / "stage1" / "student" / "mixers.safetensors"))
    b = load_file(str(tmp_path / "z3" / "stage1" / "student" / "mixers.safetensors"))
    assert sorted(a) == sorted(b) and any(k.endswith("A_scale") for k in a)
    for k in a:
        assert a[k].shape == b[k].shape and (a[k] - b[k]).abs().max() <= 1e-4 * a[k].abs().max() + 1e-6, k
