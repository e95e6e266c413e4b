"""Scaling plan and sweep: what a plan refusal names, the GPU counts the layout search tries, partly
measured throughput, sweep.json's budget rule, sweep_error.txt, NaN in results.json, the `scale run` error prefix."""

import json
import math
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hmscale.cli import app
from scaling.budget import BudgetRule
from scaling.planner import PlanSettings, choose_layout, min_teacher_tp, plan_size, teacher_forward_memory
from scaling.registry import get_size
from scaling.sweep import run_sweep, summarize
from tests.scaling.test_sweep import identity_recipe

QUIET = dict(engine="local", plots=False, log=lambda *a: None)


def _one_line(res):
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert res.exit_code == 2 and len(lines) == 1, res.output
    return lines[0]


# --------------------------------------------------------------------------- 1. which part does not fit, what to change


def test_teacher_forward_refusal_names_the_part_and_the_fix():
    """`scale plan --sizes 12b --max-tp 1 --gpu-mem 40` said only "teacher forward does not fit 1 GPUs of 40 GB". It is
    right by the planner's model: 23.7 GB of weights plus, for a batch of 8 x 2048 tokens, 12 GB of captured tensors
    (36 layers x 2 tensors, bf16) and 4 GB of logits and working set, over the 34.2 GB planned of a 40 GB GPU. The
    line now says so and names what to change; a teacher batch of 4 (cache.batch_size) fits."""
    s = PlanSettings(gpu_mem_gb=40, max_tp=1)
    with pytest.raises(ValueError) as err:
        min_teacher_tp("pythia-12b", s)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("plan: the pythia-12b teacher forward (the cache pass) needs 39.8 GB")
    for says in ("weights 23.7 GB", "captured tensors 12.1 GB", "of the 34.2 GB planned of a 40 GB GPU",
                 "--teacher-batch", "cache.batch_size", "--token-fraction", "--gpu-mem"):
        assert says in msg, (says, msg)
    line = _one_line(CliRunner().invoke(app, ["scale", "plan", "--sizes", "12b", "--max-tp", "1", "--gpu-mem", "40"]))
    assert line.startswith("hmscale: error: plan: the pythia-12b teacher forward") and "--teacher-batch" in line
    ok = CliRunner().invoke(app, ["scale", "plan", "--sizes", "12b", "--max-tp", "1", "--gpu-mem", "40",
                                  "--teacher-batch", "4"])
    assert ok.exit_code == 0, ok.output
    assert teacher_forward_memory("pythia-12b", 1, PlanSettings(gpu_mem_gb=40, max_tp=1, teacher_micro_batch=4))["total"] < s.usable_bytes


def test_the_sweeps_plan_follows_cache_batch_size():
    from hmscale.config import build_config

    cfg = build_config({"cache": {"batch_size": 3}})
    assert PlanSettings.from_run_config(cfg).teacher_micro_batch == 3


def test_training_state_refusal_names_the_part_and_the_fix():
    with pytest.raises(ValueError) as err:
        choose_layout("pythia-12b", PlanSettings(gpu_mem_gb=4, max_gpus=4))
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("plan: the pythia-12b stage-2 training state does not fit 4 GPUs of 4 GB")
    assert "--micro-batch" in msg and "stage2.micro_batch_size" in msg and "--gpu-mem" in msg


# --------------------------------------------------------------------------- 2. GPU counts tried


def test_gpu_counts_are_every_count_of_a_node_then_whole_nodes_then_the_cap():
    from scaling.planner import _gpu_counts

    assert _gpu_counts(5) == [1, 2, 3, 4, 5]
    assert _gpu_counts(8) == list(range(1, 9))
    assert _gpu_counts(12) == [*range(1, 9), 12]
    assert _gpu_counts(24) == [*range(1, 9), 16, 24]
    assert _gpu_counts(30) == [*range(1, 9), 16, 24, 30]


def test_a_cap_that_is_not_a_whole_node_is_usable():
    """pythia-6.9b on 20 GB GPUs without tp fits ZeRO-3 over 9 GPUs: max_gpus=12 said "does not fit in 12 GPUs" (the
    search went 8 -> 16 and stopped), though 12 GPUs hold it."""
    s = PlanSettings(gpu_mem_gb=20, max_tp=1, micro_batch=1, max_gpus=12)
    lay = choose_layout("pythia-6.9b", s)
    assert lay.gpus == 12 and lay.zero_stage == 3
    assert choose_layout("pythia-6.9b", PlanSettings(gpu_mem_gb=20, max_tp=1, micro_batch=1)).gpus == 16  # whole nodes


# --------------------------------------------------------------------------- 3. partly measured throughput


def test_a_size_measured_for_some_stages_is_marked_per_stage():
    from rich.console import Console

    from scaling.cli import plan_table

    part = plan_size("pythia-1b", PlanSettings(throughput={"pythia-1b": {"stage2": 25000}}))
    assert part.throughput_source == "partial" and part.measured_stages == "stage2"
    full = plan_size("pythia-1b", PlanSettings(throughput={"*": {"cache": 1e5, "stage1": 1e5, "stage2": 2.5e4}}))
    assert full.throughput_source == "measured" and full.measured_stages == "cache,stage1,stage2"
    none = plan_size("pythia-1b", PlanSettings())
    assert none.throughput_source == "model" and none.measured_stages == ""
    console = Console(width=250, record=True)
    console.print(plan_table([part, full, none]))
    lines = [ln for ln in console.export_text().splitlines() if "pythia-1b" in ln]
    assert len(lines) == 3
    cells = [[c.strip() for c in ln.split("│")] for ln in lines]
    hours = [c[-3] for c in cells]
    total = [c[-2] for c in cells]
    assert hours[0].count("*") == 2 and hours[0].split("/")[2][-1] != "*"  # cache and stage 1 modelled, stage 2 not
    assert "*" not in hours[1] and not total[1].endswith("*")
    assert hours[2].count("*") == 3 and total[0].endswith("*") and total[2].endswith("*")


def test_plan_footnote_explains_the_mark():
    res = CliRunner().invoke(app, ["scale", "plan", "--sizes", "70m"])
    assert res.exit_code == 0 and "* from the FLOP model" in res.output, res.output


# --------------------------------------------------------------------------- 4. sweep.json records the budget rule


def test_sweep_json_records_the_budget_rule_and_a_changed_one_is_refused(tmp_path):
    out = tmp_path / "scale"
    run_sweep(["70m"], out, rule=BudgetRule(fraction=1e-9, split=(0.2, 0.8)), recipe=identity_recipe, **QUIET)
    rec = json.loads((out / "sweep.json").read_text())
    assert rec["budget_rule"]["fraction"] == 1e-9 and rec["budget_rule"]["split"] == [0.2, 0.8]
    for rule, says in ((BudgetRule(fraction=2e-9, split=(0.2, 0.8)), "budget.total_tokens: 300 -> 600"),
                       (BudgetRule(fraction=1e-9, split=(0.1, 0.9)), "budget.split: [0.2, 0.8] -> [0.1, 0.9]")):
        with pytest.raises(ValueError, match=f"holds a finished run of a different config \\({re.escape(says)}\\)"):
            run_sweep(["70m"], out, rule=rule, recipe=identity_recipe, **QUIET)
    assert json.loads((out / "sweep.json").read_text()) == rec  # a refused invocation leaves the record


# --------------------------------------------------------------------------- 5. sweep_error.txt atomically


def failing_recipe(cfg, log=print):
    raise RuntimeError("boom")


def test_sweep_error_is_written_atomically(tmp_path, monkeypatch):
    import scaling.sweep as sweep

    written = []
    real = sweep.atomic_write_text

    def spy(path, text):
        written.append(Path(path).name)
        return real(path, text)

    monkeypatch.setattr(sweep, "atomic_write_text", spy)
    rows = run_sweep(["nano"], tmp_path / "scale", overrides=["budget.total_tokens=20000"], recipe=failing_recipe, **QUIET)
    assert rows[0]["status"] == "failed" and written == ["sweep_error.txt"]
    text = (tmp_path / "scale" / "runs" / "pythia-nano" / "sweep_error.txt").read_text()
    assert "RuntimeError: boom" in text


# --------------------------------------------------------------------------- 6. standard JSON for the r_* columns


def nan_recipe(cfg, log=print):
    results = identity_recipe(cfg, log)
    results.update(extra_metric=float("nan"), extra_inf=float("inf"), extra_count=3)
    return results


def _strict(text):
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))


def test_non_finite_recipe_numbers_are_null_in_results_json(tmp_path):
    out = tmp_path / "scale"
    rows = run_sweep(["nano"], out, overrides=["budget.total_tokens=20000"], recipe=nan_recipe, **QUIET)
    assert rows[0]["r_extra_metric"] is None and rows[0]["r_extra_inf"] is None and rows[0]["r_extra_count"] == 3
    table = _strict((out / "results.json").read_text())
    assert table[0]["r_extra_metric"] is None and table[0]["r_extra_count"] == 3
    row = summarize(get_size("nano"), None, {"x": math.nan, "y": 2.5, "stage1_tokens": 1, "stage2_tokens": 1})
    assert row["r_x"] is None and row["r_y"] == 2.5


# --------------------------------------------------------------------------- 7. one error prefix


def test_scale_run_errors_carry_the_cli_prefix(tmp_path, capsys):
    from ray_jobs.scaling import main as job_main

    line = _one_line(CliRunner().invoke(app, ["scale", "run", "--sizes", "13b", "--out", str(tmp_path), "--local"]))
    assert line.startswith("hmscale: error: ") and "unknown size" in line
    assert job_main(["--sizes", "nano", "--out", str(tmp_path), "--local", "--num-cpus", "0"]) == 2
    assert capsys.readouterr().err.startswith("hmscale: error: --num-cpus")
