"""The planner sizes what the run config trains; the size registry's hints name real groups."""

import pytest
import torch
from transformers import GPTNeoXForCausalLM

from hmscale.config import build_config
from hmscale.teacher.flavors import neox_config
from scaling.planner import PlanSettings, choose_layout, student_param_breakdown, train_memory
from scaling.registry import resolve_sizes


@pytest.mark.parametrize("components", [{}, {"gate": False}, {"conv": False, "ssm": False}])
def test_mixers_only_stage2_counts_the_mixers_as_trainable(components):
    """stage2.trainable=mixers trains the blocks' sequence mixers only (in_proj, out_proj, feature maps, conv, gate,
    dt/A/D): the plan's trainable count (and so its gradient and Adam memory) is the real model's."""
    convert = pytest.importorskip("hmscale.models.convert")
    from hmscale.train.stage2 import freeze_all_but_mixers, freeze_embeddings

    torch.manual_seed(0)
    model = convert.to_hedgemamba(convert.to_hedgehog(GPTNeoXForCausalLM(neox_config("pythia-micro"))),
                                  components=dict(components))
    freeze_embeddings(model)
    freeze_all_but_mixers(model)
    parts = student_param_breakdown("pythia-micro", PlanSettings(trainable="mixers", **components))
    assert parts["total"] == sum(p.numel() for p in model.parameters())
    assert parts["trainable"] == sum(p.numel() for p in model.parameters() if p.requires_grad)


def test_plan_settings_follow_the_configs_trainable_choice():
    cfg = build_config({"stage2": {"trainable": "mixers"}})
    s = PlanSettings.from_run_config(cfg)
    assert s.trainable == "mixers"
    full = train_memory("pythia-6.9b", settings=PlanSettings.from_run_config(build_config({})))
    mixers = train_memory("pythia-6.9b", settings=s)
    assert mixers["params"] == full["params"] and mixers["optimizer"] < full["optimizer"] / 2
    # fewer trainable weights: the layout needs no more GPUs than full fine-tuning's, and here fewer
    big = PlanSettings(gpu_mem_gb=80)
    assert choose_layout("pythia-6.9b", PlanSettings(gpu_mem_gb=80, trainable="mixers")).gpus < choose_layout(
        "pythia-6.9b", big).gpus
    with pytest.raises(ValueError, match="trainable"):
        PlanSettings(trainable="everything")


def test_no_sizes_hint_names_groups_that_exist():
    """The hint lists groups; following it (--sizes <group>) gives that group, not a single size of that name."""
    with pytest.raises(ValueError) as err:
        resolve_sizes("")
    hint = str(err.value).split("group (", 1)[1].split(")", 1)[0]
    from scaling.registry import GROUPS

    for group in (g.strip() for g in hint.split(",")):
        assert group in GROUPS, (group, str(err.value))


def test_sweep_lays_out_a_mixers_only_size_for_what_it_trains(tmp_path):
    """`hmscale scale run -s stage2.trainable=mixers -s parallel.use_gpu=true`: the plan put into the size's config
    is the one for the weights that train (before: the full fine-tuning layout, twice the GPUs here)."""
    from scaling.sweep import size_config

    full = size_config("6.9b", tmp_path, overrides=["parallel.use_gpu=true"])
    mixers = size_config("6.9b", tmp_path, overrides=["parallel.use_gpu=true", "stage2.trainable=mixers"])
    assert mixers.parallel.num_workers < full.parallel.num_workers


def test_pythia_6_9b_count_is_the_published_one():
    # EleutherAI/pythia-6.9b's config.json has vocab_size 50432 (the registry had the default 50304: 1,048,576 short)
    from scaling.planner import count_params
    from hmscale.teacher.flavors import PYTHIA

    assert count_params("pythia-6.9b") == PYTHIA["pythia-6.9b"].published_params == 6_857_302_016
