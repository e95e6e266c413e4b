"""The paper's ablation switches: each does what its name says and nothing else."""

import json
import os

import numpy as np
import pytest
import torch

from hmscale.config import build_config
from hmscale.train.data import ArraySource

os.environ.setdefault("HMSCALE_NO_PROGRESS", "1")

VOCAB, L = 96, 32


def _teacher(seed=0):
    from transformers import GPTNeoXForCausalLM

    from hmscale.teacher.flavors import neox_config

    torch.manual_seed(seed)
    return GPTNeoXForCausalLM(neox_config("pythia-nano", vocab_size=VOCAB)).eval()


def _tokens(n=16):
    return np.random.default_rng(1).integers(0, VOCAB, size=(n, L))


def _trained_student(teacher):
    """A Hedgehog student whose feature maps are not at their init (as after stage 1)."""
    from hmscale.models.convert import to_hedgehog

    student = to_hedgehog(teacher).eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for fm in student.feature_maps:
            fm.weight.add_(0.1 * torch.randn(fm.weight.shape, generator=gen))
            fm.bias.add_(0.1 * torch.randn(fm.bias.shape, generator=gen))
    return student


# ---------------------------------------------------------------- budget.split


def test_stage2_share_of_nothing_is_no_step():
    from hmscale.train.common import stage_steps

    assert stage_steps(build_config({}, ["budget.split=[1.0,0.0]"]), "stage2", 256) == 0
    assert stage_steps(build_config({}, ["budget.split=[1.0,0.0]", "stage2.epochs=3"]), "stage2", 256) == 0
    assert stage_steps(build_config({}, ["budget.split=[1.0,0.0]", "stage2.steps=5"]), "stage2", 256) == 5  # explicit wins
    assert stage_steps(build_config({}, ["budget.split=[0.9999,0.0001]"]), "stage2", 10**6) == 1  # a positive share: >= 1 step


def test_split_100_0_exports_the_converted_stage1_model(tmp_path):
    """budget.split=[1.0, 0.0] (the paper's 100/0, fidelity's split_100_0: "no stage 2") exported a model fine-tuned
    for one step; it must be the converted stage-1 model itself (logits equal to the student's)."""
    from hmscale.models import HedgeMambaForCausalLM
    from hmscale.train.engine import read_metrics
    from hmscale.train.stage2 import run_stage2

    teacher = _teacher()
    student = _trained_student(teacher)
    cfg = build_config({}, ["budget.split=[1.0,0.0]", "stage2.micro_batch_size=4", "stage2.warmup_steps=0",
                            "stage2.lr=1e-2", "parallel.zero_stage=0"])
    res = run_stage2(cfg, tmp_path, student=student, source=ArraySource(_tokens()))
    assert res["done"] and res["total_steps"] == 0 and res["tokens"] == 0
    assert not [r for r in read_metrics(tmp_path / "stage2" / "metrics.jsonl") if r.get("kind") == "train"]
    model = HedgeMambaForCausalLM.from_pretrained(tmp_path / "stage2" / "hf").eval()
    x = torch.as_tensor(_tokens(2))
    with torch.no_grad():
        diff = (model(input_ids=x).logits - student(input_ids=x).logits).abs().max().item()
    assert diff < 1e-5, diff


def test_split_0_100_trains_no_stage1_step_and_exports_the_initial_feature_maps(tmp_path):
    """budget.split=[0.0, 1.0] (the paper's 0/100: no stage 1) made one stage-1 step; the exported student must hold
    the feature maps as initialised (Hedgehog's identity-like init), the rest of the run going on from there."""
    from hmscale.models.convert import to_hedgehog
    from hmscale.train.stage1 import load_stage1_student, run_stage1

    teacher = _teacher()
    cfg = build_config({}, ["budget.split=[0.0,1.0]", "stage1.source=online", "stage1.micro_batch_size=4",
                            "parallel.zero_stage=0"])
    res = run_stage1(cfg, tmp_path, teacher=teacher, source=ArraySource(_tokens()))
    assert res["total_steps"] == 0 and res["tokens"] == 0
    got = load_stage1_student(tmp_path, teacher)
    want = to_hedgehog(teacher)
    for a, b in zip(got.feature_maps, want.feature_maps):
        assert torch.equal(a.weight, b.weight) and torch.equal(a.bias, b.bias)


# ---------------------------------------------------------------- exact init through stage 2, every switch


@pytest.mark.parametrize("extra", [
    [],
    ["stage2.lora_rank=4"],
    ["stage2.trainable=mixers"],
    ["stage2.components.gate=false", "stage2.components.conv=false", "stage2.components.ssm=false"],
    ["stage2.components.conv_width=2", "stage2.lora_rank=2",
     "stage2.lora_targets=[in_proj,out_proj,z_proj,dt_proj,dense_h_to_4h,lm_head]"],
    ["stage1.feature_dim=4", "stage2.components.gate=false"],
    ["stage1.feature_dim=24", "stage2.components.ssm=false"],
    ["stage1.transfer=mixer"],
    ["stage1.transfer=mixer", "stage2.components.conv=false", "stage2.lora_rank=4"],
    ["parallel.zero_stage=3", "stage2.lora_rank=4"],
])
def test_stage2_starts_from_the_stage1_model_with_every_switch(tmp_path, extra):
    """The stage-2 model as stage 2 builds, freezes, wraps (LoRA), shards (ZeRO) and exports it, before any step
    (budget 100/0), computes the stage-1 model's logits (fp32): for every combination with the normaliser on."""
    from hmscale.models import HedgeMambaForCausalLM
    from hmscale.models.convert import to_hedgehog, to_mixer_student
    from hmscale.train.stage2 import run_stage2

    cfg = build_config({}, ["budget.split=[1.0,0.0]", "stage2.micro_batch_size=4", "parallel.zero_stage=0", *extra])
    teacher = _teacher()
    gen = torch.Generator().manual_seed(5)
    if cfg.stage1.transfer == "mixer":  # the stage-1 HedgeMamba, its recurrent parts moved off their init
        student = to_mixer_student(teacher, cfg.stage2.components, cfg.stage1.feature_dim).eval()
        moved = [p for p in student.parameters() if p.requires_grad]
    else:
        student = to_hedgehog(teacher, feature_dim=cfg.stage1.feature_dim).eval()
        moved = list(student.feature_maps.parameters())
    with torch.no_grad():
        for p in moved:
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    x = torch.as_tensor(_tokens(2))
    with torch.no_grad():
        want = student(input_ids=x).logits.clone()
    run_stage2(cfg, tmp_path, student=student, teacher=teacher, source=ArraySource(_tokens()))
    model = HedgeMambaForCausalLM.from_pretrained(tmp_path / "stage2" / "hf").eval()
    assert model.config.feature_dim == (cfg.stage1.feature_dim or 16)
    assert all(model.config.to_dict()[k] == v for k, v in cfg.stage2.components.model_dump().items())
    with torch.no_grad():
        diff = (model(input_ids=x).logits - want).abs().max().item()
    assert diff < 1e-5, diff


# ---------------------------------------------------------------- LoRA targets


def test_lora_target_names_are_the_models_linear_layers_for_every_component_set():
    import itertools

    from hmscale.config import ComponentsConfig, lora_target_names
    from hmscale.models.convert import to_hedgehog, to_hedgemamba
    from hmscale.models.lora import lora_targets_available

    student = to_hedgehog(_teacher())
    for gate, conv, ssm in itertools.product([True, False], repeat=3):
        comp = ComponentsConfig(gate=gate, conv=conv, ssm=ssm)
        assert lora_target_names(comp) == lora_targets_available(to_hedgemamba(student, comp)), comp


@pytest.mark.parametrize("extra, says", [
    (["stage2.lora_targets=[qkv]"], r"\['qkv'\] match no linear layer"),
    (["stage2.lora_targets=[in_proj,z_proj]", "stage2.components.gate=false"], r"\['z_proj'\] match no linear"),
    (["stage2.lora_targets=[dt_proj]", "stage2.components.ssm=false"], r"\['dt_proj'\] match no linear"),
])
def test_a_lora_target_that_the_model_lacks_stops_before_stage1(extra, says):
    """A misspelt target, or the gate's / SSM's layer with that component off, used to stop only when stage 2 began,
    after stage 1 had trained into a run directory that the corrected setting could no longer use."""
    from hmscale.config import ConfigError

    with pytest.raises(ConfigError, match="stage2.lora_targets: " + says):
        build_config({}, ["stage2.lora_rank=4", *extra])
    with pytest.raises(ConfigError, match="stage2.lora_rank=0 adds no adapters"):  # (without LoRA, a target setting
        build_config({}, ["stage2.lora_rank=0", *extra])                     # is refused as lora_alpha is)


# ---------------------------------------------------------------- --stage1-from


def _finished_stage1(run_dir, cfg, transfer_components=None):
    from hmscale.config import save_resolved

    save_resolved(cfg, run_dir)
    s1 = run_dir / "stage1"
    (s1 / "student").mkdir(parents=True)
    meta = {"transfer": cfg.stage1.transfer}
    if transfer_components is not None:
        meta["components"] = transfer_components
    (s1 / "student" / "student.json").write_text(json.dumps(meta))
    (s1 / "summary.json").write_text(json.dumps({"stage": "stage1", "done": True}))


def test_stage1_from_a_mixer_transfer_refuses_other_components_at_once(tmp_path):
    """stage1.transfer=mixer trains the mixers of stage2.components: a --stage1-from ablation of those components
    was accepted, then failed only at stage 2's start (after the data, the teacher and its cache); other stage2.*
    settings still adopt it, and with the attention transfer the components may differ."""
    from hmscale.recipe import RecipeError, adopt_stage1

    base = build_config({}, [f"output_dir={tmp_path}/base", "stage1.transfer=mixer"]).with_absolute_paths()
    _finished_stage1(tmp_path / "base", base, base.stage2.components.model_dump())
    no_gate = build_config({}, [f"output_dir={tmp_path}/no_gate", "stage1.transfer=mixer",
                                "stage2.components.gate=false"]).with_absolute_paths()
    with pytest.raises(RecipeError, match=r"stage1.transfer=mixer.*stage2.components.gate: True -> False"):
        adopt_stage1(tmp_path / "base", no_gate)
    assert not (tmp_path / "no_gate" / "stage1").exists()
    lr = build_config({}, [f"output_dir={tmp_path}/lr", "stage1.transfer=mixer", "stage2.lr=5e-4"]).with_absolute_paths()
    assert "stage 1 from" in adopt_stage1(tmp_path / "base", lr)

    att = build_config({}, [f"output_dir={tmp_path}/att"]).with_absolute_paths()
    _finished_stage1(tmp_path / "att", att)
    att_no_gate = build_config({}, [f"output_dir={tmp_path}/att_no_gate",
                                    "stage2.components.gate=false"]).with_absolute_paths()
    assert "stage 1 from" in adopt_stage1(tmp_path / "att", att_no_gate)


# ---------------------------------------------------------------- benchmarks/fidelity.py


def _fidelity():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "fidelity.py"
    spec = importlib.util.spec_from_file_location("fidelity_walk", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("argv, says", [
    (["--only", "no-gate"], "--only: no ablation named 'no-gate'; choose from hedgemamba, split_0_100"),
    (["--only"], "--only: give at least one name"),
    (["--only", "e2", "--variant", "e1:stage2.epochs=1"], "no ablation named 'e2'"),
])
def test_fidelity_only_names_an_unknown_ablation(tmp_path, capsys, argv, says):
    """A misspelt --only name ran no ablation at all (after the data and the teacher's pretraining) and printed a
    table with the teacher alone; now one usage error before any work."""
    fid = _fidelity()
    with pytest.raises(SystemExit) as exc:
        fid.main(["--smoke", "--out", str(tmp_path / "fid"), *argv])
    assert exc.value.code == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "fid").exists()


def test_lora_adapters_on_added_layers_train_at_the_added_parts_lr():
    """stage2.new_params_lr_scale is the lr multiplier of what HedgeMamba adds (gate z_proj, dt_proj, ...): LoRA
    adapters wrapping z_proj / dt_proj went to the teacher weights' group (the scale silently not applied to them)."""
    from types import SimpleNamespace

    from hmscale.models.convert import to_hedgehog, to_hedgemamba
    from hmscale.train.stage2 import apply_stage2_lora, freeze_embeddings, param_groups

    model = to_hedgemamba(to_hedgehog(_teacher()))
    freeze_embeddings(model)
    apply_stage2_lora(model, SimpleNamespace(lora_targets=["in_proj", "z_proj", "dt_proj", "lm_head"], lora_rank=2,
                                             lora_alpha=4.0))
    groups = {g["name"]: {id(p) for p in g["params"]} for g in param_groups(model, 1e-3, 20.0, 3.0)}
    group_of = {n: next(k for k, ids in groups.items() if id(p) in ids)
                for n, p in model.named_parameters() if p.requires_grad}
    for name, group in group_of.items():
        if ".z_proj.lora_" in name or ".dt_proj.lora_" in name or ".conv." in name or "A_log" in name:
            assert group == "new", name
        elif ".in_proj.lora_" in name or name.startswith("lm_head.lora_"):
            assert group == "base", name
        elif ".feature_map." in name:
            assert group == "feature_map", name
    assert any(".z_proj.lora_A" in n for n in group_of) and any(".dt_proj.lora_B" in n for n in group_of)
    assert sum(len(ids) for ids in groups.values()) == len(group_of)
