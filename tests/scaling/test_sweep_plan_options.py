"""Scaling sweep and planner options and inputs are checked (each test failed before its fix)."""

import json

import pytest

from scaling.budget import BudgetRule
from scaling.planner import PlanSettings
from scaling.sweep import run_sweep, size_config
from tests.scaling.test_sweep import calls, identity_recipe


def test_split_applies_when_the_total_is_set(tmp_path):
    """`scale run --split 20/80 -s budget.total_tokens=4096` trained 10/90: the rule's split was only applied when
    the rule also chose the total, so --split was dropped without a word (and a finished 10/90 run was skipped as
    'finished earlier with these settings')."""
    cfg = size_config("nano", tmp_path, overrides=["budget.total_tokens=4096"], rule=BudgetRule(split=(0.2, 0.8)))
    assert tuple(cfg.budget.split) == (0.2, 0.8)
    # an explicit budget.split (override or config) still wins over the rule
    cfg = size_config("nano", tmp_path, overrides=["budget.total_tokens=4096", "budget.split=[0.3,0.7]"],
                      rule=BudgetRule(split=(0.2, 0.8)))
    assert tuple(cfg.budget.split) == (0.3, 0.7)
    cfg = size_config("nano", tmp_path, base_tree={"budget": {"total_tokens": 4096, "split": [0.3, 0.7]}},
                      rule=BudgetRule(split=(0.2, 0.8)))
    assert tuple(cfg.budget.split) == (0.3, 0.7)
    # the default rule leaves the config's default split as it was (no change of identity for existing sweeps)
    assert tuple(size_config("nano", tmp_path, overrides=["budget.total_tokens=4096"]).budget.split) == (0.1, 0.9)


def test_split_change_on_a_finished_sweep_is_refused(tmp_path):
    out = tmp_path / "scale"
    kw = dict(overrides=["budget.total_tokens=20000"], engine="local", recipe=identity_recipe, plots=False,
              log=lambda *a: None)
    assert run_sweep(["nano"], out, **kw)[0]["status"] == "done"
    with pytest.raises(ValueError, match=r"budget.split: \[0.1, 0.9\] -> \[0.2, 0.8\]"):
        run_sweep(["nano"], out, rule=BudgetRule(split=(0.2, 0.8)), **kw)
    assert calls(out, "pythia-nano") == 1


@pytest.mark.parametrize("resources, says", [
    ({"*": 2}, "resources: '\\*' must map to"),
    ({"nano": {"num_cpus": 2}, "13b": {"num_gpus": 1}}, "unknown size '13b'"),
])
def test_bad_resources_are_one_line(tmp_path, resources, says):
    """`--resources '{"*": 2}'` ended in a TypeError traceback."""
    with pytest.raises(ValueError, match=says):
        run_sweep(["nano"], tmp_path / "scale", overrides=["budget.total_tokens=20000"], engine="local",
                  recipe=identity_recipe, plots=False, log=lambda *a: None, resources=resources)
    assert calls(tmp_path / "scale", "pythia-nano") == 0


def test_resources_take_short_size_names(tmp_path):
    """`--resources '{"nano": {"num_cpus": 2}}'` was ignored silently (only "pythia-nano" matched), although every
    other option takes the short names."""
    rows = run_sweep(["nano"], tmp_path / "scale", overrides=["budget.total_tokens=20000"], engine="local",
                     recipe=identity_recipe, plots=False, log=lambda *a: None, resources={"nano": {"num_cpus": 2}})
    assert rows[0]["num_cpus"] == 2
    assert json.loads((tmp_path / "scale" / "results.json").read_text())[0]["num_cpus"] == 2


@pytest.mark.parametrize("kw, says", [
    ({"micro_batch": 0}, "micro_batch"), ({"micro_batch": -1}, "micro_batch"), ({"seq_len": -5}, "seq_len"),
    ({"lora_rank": -16}, "lora_rank"), ({"topk": -5}, "topk"), ({"token_fraction": 2.0}, "token_fraction"),
    ({"token_fraction": 0.0}, "token_fraction"), ({"max_tp": 0}, "max_tp"),
])
def test_plan_settings_out_of_range_are_refused(kw, says):
    """`scale plan --micro-batch -1` planned 7.3 GB/GPU (negative activations), `--lora-rank -16` a smaller student,
    `--topk -5` a top-k cache, `--token-fraction 2` twice the cache: numbers the recipe's config would refuse."""
    with pytest.raises(ValueError, match=says):
        PlanSettings(**kw)


def test_cli_plan_refuses_negative_micro_batch():
    from typer.testing import CliRunner

    from hmscale.cli import app

    res = CliRunner().invoke(app, ["scale", "plan", "--sizes", "1b", "--micro-batch", "-1"])
    assert res.exit_code == 2 and "micro_batch" in res.output and "Traceback" not in res.output


@pytest.mark.parametrize("name, text, says", [
    ("list.json", '[{"size": "pythia-70m"}]', "holds a JSON list, not an object"),  # the plan's own --json output
    ("flat.json", '{"70m": 5000}', "70m: 5000 is not {stage: tokens/s}"),
    ("cols.csv", "size,tokens\n70m,5\n", "no column 'tokens_per_s'"),
    ("zero.json", '{"70m": {"stage2": 0}}', "70m stage2: 0 is not a positive number"),
    ("neg.json", '{"70m": {"stage2": -5}}', "70m stage2: -5 is not a positive number"),
    ("word.json", '{"70m": {"stage2": "fast"}}', "70m stage2: 'fast' is not a positive number"),
    ("size.json", '{"13b": {"stage2": 5}}', "size.json: unknown size '13b'"),
])
def test_bad_throughput_tables_are_one_line_naming_the_file(tmp_path, name, text, says):
    """Before: TypeError / KeyError / ZeroDivisionError tracebacks, negative GPU-hours for -5 tokens/s, and errors that
    did not name the file."""
    from scaling.planner import load_throughput

    p = tmp_path / name
    p.write_text(text)
    with pytest.raises(ValueError) as err:
        load_throughput(p)
    msg = str(err.value)
    assert says in msg and str(p) in msg and "\n" not in msg


def test_cli_plan_bad_throughput_is_one_line(tmp_path):
    from typer.testing import CliRunner

    from hmscale.cli import app

    p = tmp_path / "plan.json"
    p.write_text('[{"size": "pythia-70m"}]')
    res = CliRunner().invoke(app, ["scale", "plan", "--sizes", "70m", "--throughput", str(p)])
    assert res.exit_code == 2 and "holds a JSON list" in res.output
    assert res.exception is None or isinstance(res.exception, SystemExit)


def test_good_throughput_tables_still_load(tmp_path):
    from pathlib import Path

    from scaling.planner import load_throughput

    calib = next((Path(__file__).resolve().parents[2] / "scaling" / "calibration").glob("train_throughput*.json"))
    assert load_throughput(calib)["pythia-1b"]["stage2"] > 0
    c = tmp_path / "t.csv"
    c.write_text("size,stage,tokens_per_s\n70m,stage2,25000\n*,cache,1e5\n")
    assert load_throughput(c) == {"pythia-70m": {"stage2": 25000.0}, "*": {"cache": 100000.0}}


def test_adding_a_size_alone_says_the_table_leaves_out_the_others(tmp_path):
    """Adding a size to a finished sweep with `--sizes mini` alone rewrote results.csv and the plots with that one
    size, without a word about the finished sizes left out; now a log line names them and the command that keeps them."""
    out = tmp_path / "scale"
    kw = dict(overrides=["budget.total_tokens=20000"], engine="local", recipe=identity_recipe, plots=False)
    run_sweep(["nano"], out, log=lambda *a: None, **kw)
    lines = []
    rows = run_sweep(["micro"], out, log=lambda *a: lines.append(" ".join(map(str, a))), **kw)
    assert [r["size"] for r in rows] == ["pythia-micro"]
    note = [ln for ln in lines if "also holds finished" in ln]
    assert len(note) == 1 and "pythia-nano" in note[0] and "--sizes pythia-nano,pythia-micro" in note[0]
    lines.clear()
    rows = run_sweep(["nano", "micro"], out, log=lambda *a: lines.append(" ".join(map(str, a))), **kw)
    assert [r["status"] for r in rows] == ["skipped", "skipped"] and not any("also holds" in ln for ln in lines)


def test_cli_resources_that_are_not_json_and_a_budget_fraction_without_effect(tmp_path, capsys, monkeypatch):
    import scaling.sweep
    from ray_jobs import scaling as cli

    assert cli.main(["--sizes", "nano", "--out", str(tmp_path), "--resources", "notjson"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hmscale: error: --resources: not valid JSON (Expecting value)") and err.count("\n") == 1
    monkeypatch.setattr(scaling.sweep, "run_sweep", lambda *a, **k: [])  # (the note comes before any work)
    assert cli.main(["--sizes", "nano", "--out", str(tmp_path), "--budget-fraction", "0.1",
                     "-s", "budget.total_tokens=4096"]) == 0
    assert "--budget-fraction has no effect: budget.total_tokens is set" in capsys.readouterr().err
