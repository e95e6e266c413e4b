"""report.md and the printed results table name the stage-1 model after the transfer that made it."""

import pytest

from hmscale.config import build_config


@pytest.mark.parametrize("transfer,label", [("attention", "Hedgehog (stage 1)"), ("mixer", "stage 1 (mixer transfer)")])
def test_stage1_model_is_named_by_its_transfer(tmp_path, capsys, transfer, label):
    from hmscale.cli import print_results
    from hmscale.recipe import write_report

    results = {"teacher_ppl": 10.0, "hedgehog_ppl": 20.0, "hedgemamba_ppl": 10.5, "stage1_transfer": transfer,
               "eval_tokens": 1000, "stages": {"stage1": {"seconds": 1.0, "tokens": 10}}}
    report = write_report(tmp_path, results, build_config({}, [f"stage1.transfer={transfer}"])).read_text()
    assert f"| {label} | 20.000 | 2.000 |" in report
    print_results(results)
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith(label))
    assert row.split()[-2:] == ["20.000", "2.000"]
    other = "Hedgehog (stage 1)" if transfer == "mixer" else "stage 1 (mixer transfer)"
    assert other not in report


def test_long_context_table_in_report_and_printout(tmp_path, capsys):
    from hmscale.cli import print_results
    from hmscale.recipe import write_report

    lc = {"length": 1024, "train_seq_len": 256, "rows": 5, "rows_from": "documents",
          "buckets": [[1, 256], [256, 512], [512, 1024]],
          "ppl": {"hedgehog": [45.0, 44.0, 43.0], "hedgemamba": [39.0, 35.0, 33.5], "teacher": [40.0, 50.0, 60.0]}}
    results = {"teacher_ppl": 10.0, "hedgehog_ppl": 20.0, "hedgemamba_ppl": 10.5, "stage1_transfer": "attention",
               "eval_tokens": 1000, "stages": {}, "long_context": lc}
    report = write_report(tmp_path, results, build_config({})).read_text()
    assert "5 rows of 1,024 tokens (documents)" in report and "| model | 1-255 | 256-511 * | 512-1023 * |" in report
    assert "| HedgeMamba (stage 2) | 39.00 | 35.00 | 33.50 |" in report
    assert "![long context](long_context.png)" in report and (tmp_path / "long_context.png").stat().st_size > 1000
    print_results(results)
    out = capsys.readouterr().out
    assert "| teacher | 40.00 | 50.00 | 60.00 |" in out
    rows = [line.split(" | ")[0] for line in out.splitlines() if line.startswith("| ") and "model" not in line and "---" not in line]
    assert rows == ["| teacher", "| Hedgehog (stage 1)", "| HedgeMamba (stage 2)"]  # not JSON's sorted key order


def test_a_submitted_job_prints_the_same_table_as_hmscale_run(monkeypatch, capsys):
    # the Ray job `hmscale submit` starts ends its log with the table `hmscale run` prints, not a dict
    import hmscale.recipe
    from hmscale.cli import print_results
    from ray_jobs import run_recipe

    results = {"teacher_ppl": 10.0, "hedgehog_ppl": 20.0, "hedgemamba_ppl": 10.5, "stage1_transfer": "attention"}
    monkeypatch.setattr(hmscale.recipe, "run_recipe", lambda cfg, **kw: results)
    assert run_recipe.main(["-s", "output_dir=/tmp/hmscale-table-test"]) == 0
    job = capsys.readouterr().out
    print_results(results)
    assert job == capsys.readouterr().out
    assert any(line.startswith("HedgeMamba (stage 2)") and line.split()[-2:] == ["10.500", "1.050"]
               for line in job.splitlines())
