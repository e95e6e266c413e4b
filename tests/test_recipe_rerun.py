"""A run directory's identity: training settings must match on a rerun; evaluation settings may change (the
eval stage is then redone, the trained stages kept)."""

import json

import pytest

from hmscale.config import build_config
from hmscale.recipe import RecipeError, _load_results, _training_hash


def _write(run_dir, cfg, eval_cfg):
    stages = {"prepare": {"seconds": 1.0}, "stage1": {"seconds": 2.0}, "stage2": {"seconds": 3.0},
              "eval": {"seconds": 0.5, "eval_hash": eval_cfg.hash("eval")}}
    (run_dir / "results.json").write_text(json.dumps({"config_hash": _training_hash(cfg), "stages": stages}))


def test_changed_eval_settings_redo_only_the_eval(tmp_path):
    cfg = build_config({})
    _write(tmp_path, cfg, cfg)
    assert "eval" in _load_results(tmp_path, cfg)["stages"]
    longer = build_config({}, ["eval.context_length=2048"])
    stages = _load_results(tmp_path, longer)["stages"]
    assert "eval" not in stages and set(stages) == {"prepare", "stage1", "stage2"}


def test_changed_training_settings_are_another_run(tmp_path):
    cfg = build_config({})
    _write(tmp_path, cfg, cfg)
    with pytest.raises(RecipeError, match="holds a run of a different config"):
        _load_results(tmp_path, build_config({}, ["stage2.lr=3e-4"]))


def test_runs_keyed_by_the_whole_config_still_resume(tmp_path):
    cfg = build_config({})
    (tmp_path / "results.json").write_text(json.dumps({"config_hash": cfg.hash(), "stages": {"stage1": {}}}))
    assert "stage1" in _load_results(tmp_path, cfg)["stages"]
