"""`hmscale eval` of a run whose stage-1 export is gone: a traceback (TrainingError was not among the errors the command
reports in one line), and its advice (`run hmscale stage1 first`) was a dead end where stage 1 had finished (it skips
a finished stage)."""

import json

import pytest


def test_eval_reports_a_training_error_in_one_line(tmp_path, monkeypatch, capsys):
    import hmscale.recipe as recipe
    from hmscale import cli
    from hmscale.config import build_config, save_resolved
    from hmscale.train.engine import TrainingError

    run = tmp_path / "run"
    run.mkdir()
    save_resolved(build_config({}, [f"output_dir={run}"]), run)

    def evaluate_run(*a, **k):
        raise TrainingError("no stage-1 student under 'x'; the reason")

    monkeypatch.setattr(recipe, "evaluate_run", evaluate_run)
    code = cli.main(["eval", str(run)])
    err = capsys.readouterr().err
    assert code != 0 and "no stage-1 student under 'x'; the reason" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("finished", [False, True])
def test_a_missing_stage1_export_says_what_to_do(tmp_path, finished):
    from hmscale.train.engine import TrainingError
    from hmscale.train.stage1 import load_stage1_student

    (tmp_path / "stage1").mkdir()
    if finished:
        (tmp_path / "stage1" / "summary.json").write_text(json.dumps({"done": True}))
    with pytest.raises(TrainingError) as err:
        load_stage1_student(tmp_path)
    msg = str(err.value)
    if finished:
        assert "finished there" in msg and "is gone" in msg and "hmscale stage1` first" not in msg
    else:
        assert "run `hmscale stage1` first" in msg
