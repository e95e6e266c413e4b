"""A run directory's identity: training settings must match on a rerun; evaluation settings may change (the
eval stage is then redone, the trained stages kept)."""

import json

import pytest

from hmscale.config import build_config
from hmscale.recipe import RecipeError, _load_results
from hmscale.run_identity import eval_hash, training_hash


def _write(run_dir, cfg, eval_cfg):
    stages = {"prepare": {"seconds": 1.0}, "stage1": {"seconds": 2.0}, "stage2": {"seconds": 3.0},
              "eval": {"seconds": 0.5, "eval_hash": eval_hash(eval_cfg)}}
    (run_dir / "results.json").write_text(json.dumps({"config_hash": training_hash(cfg), "stages": stages}))


def test_changed_eval_settings_redo_only_the_eval(tmp_path):
    cfg = build_config({})
    _write(tmp_path, cfg, cfg)
    assert "eval" in _load_results(tmp_path, cfg)["stages"]
    assert "eval" in _load_results(tmp_path, build_config({}, [f"output_dir={tmp_path}/moved"]))["stages"]
    assert "eval" in _load_results(tmp_path, build_config({}, ["eval.tasks=[hellaswag]"]))["stages"]  # not read there
    longer = build_config({}, ["eval.context_length=2048"])
    stages = _load_results(tmp_path, longer)["stages"]
    assert "eval" not in stages and set(stages) == {"prepare", "stage1", "stage2"}


def test_changed_training_settings_are_another_run(tmp_path):
    from hmscale.config import save_resolved

    cfg = build_config({})
    _write(tmp_path, cfg, cfg)
    save_resolved(cfg, tmp_path)
    with pytest.raises(RecipeError, match=r"holds a run of a different config \(stage2.lr: 0.001 -> 0.0003\); choose"):
        _load_results(tmp_path, build_config({}, ["stage2.lr=3e-4", "eval.context_length=512"]))
    (tmp_path / "config.yaml").unlink()  # without the saved config: refused, saying why
    with pytest.raises(RecipeError, match="config.yaml is missing or unreadable"):
        _load_results(tmp_path, build_config({}, ["stage2.lr=3e-4"]))


def test_a_run_hashed_with_its_eval_settings_resumes_when_the_training_settings_match(tmp_path):
    from hmscale.config import save_resolved

    cfg = build_config({})
    save_resolved(cfg, tmp_path)
    (tmp_path / "results.json").write_text(json.dumps({"config_hash": cfg.hash(), "stages": {"stage1": {}}}))
    res = _load_results(tmp_path, build_config({}, ["eval.context_length=2048"]))
    assert "stage1" in res["stages"] and res["config_hash"] == training_hash(cfg)
    # adopted on disk at once: a rerun after config.yaml is rewritten (and the run killed) still resumes
    save_resolved(build_config({}, ["eval.context_length=2048"]), tmp_path)
    assert "stage1" in _load_results(tmp_path, build_config({}, ["eval.context_length=2048"]))["stages"]


def test_a_config_yaml_rewritten_by_another_command_is_not_taken_for_the_run(tmp_path):
    """`hmscale stage2 -s ...` rewrites config.yaml in the run directory: a whole-config hash of another config must
    still be refused, not adopted because config.yaml now matches."""
    from hmscale.config import save_resolved

    made = build_config({})
    (tmp_path / "results.json").write_text(json.dumps({"config_hash": made.hash(), "stages": {"stage1": {}}}))
    other = build_config({}, ["stage2.lr=3e-4"])
    save_resolved(other, tmp_path)
    with pytest.raises(RecipeError, match="holds a run of a different config"):
        _load_results(tmp_path, other)


def test_a_field_added_to_the_schema_does_not_orphan_existing_runs(tmp_path):
    """A run keyed (and config.yaml saved) before a field existed: its key no longer matches the current hash, but its
    saved tree vouches for it and the settings match, so it resumes (and is re-keyed)."""
    import yaml

    from hmscale.config import save_resolved

    cfg = build_config({})
    save_resolved(cfg, tmp_path)
    tree = yaml.safe_load((tmp_path / "config.yaml").read_text())
    del tree["data"]["revision"]  # as an hmscale without data.revision saved it
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(tree))
    import hashlib

    old_key = hashlib.sha256(json.dumps({k: v for k, v in tree.items() if k not in ("eval", "output_dir")},
                                        sort_keys=True).encode()).hexdigest()[:16]
    assert old_key != training_hash(cfg)
    (tmp_path / "results.json").write_text(json.dumps({"config_hash": old_key, "stages": {"stage2": {}}}))
    res = _load_results(tmp_path, cfg)
    assert "stage2" in res["stages"] and res["config_hash"] == training_hash(cfg)
    with pytest.raises(RecipeError, match=r"\(stage2.lr: 0.001 -> 0.0003\)"):  # a real change is still refused
        (tmp_path / "results.json").write_text(json.dumps({"config_hash": old_key, "stages": {}}))
        _load_results(tmp_path, build_config({}, ["stage2.lr=3e-4"]))


def test_where_things_are_kept_and_how_the_work_is_placed_are_not_the_run(tmp_path):
    """A run moved with its caches, resumed by the other engine or with other checkpoint / retry settings is the same
    run; the run directory's config.yaml then describes the new placement."""
    from hmscale.config import save_resolved

    cfg = build_config({})
    _write(tmp_path, cfg, cfg)
    save_resolved(cfg, tmp_path)
    moved = build_config({}, [f"data.cache_dir={tmp_path}/d", f"cache.root={tmp_path}/t", "parallel.engine=local",
                              "parallel.ray_address=ray://head:10001", "parallel.checkpoint_every=7",
                              "parallel.keep_checkpoints=5", "parallel.max_failures=0", "cache.workers=5",
                              "cache.engine=ray", "cache.max_retries=1", "cache.allow_exceed_disk=true"])
    assert training_hash(moved) == training_hash(cfg)
    assert set(_load_results(tmp_path, moved)["stages"]) == {"prepare", "stage1", "stage2", "eval"}
    with pytest.raises(RecipeError, match=r"\(parallel.num_workers: 1 -> 2\)"):  # the data-parallel layout is part of it
        _load_results(tmp_path, build_config({}, ["parallel.num_workers=2"]))


def test_a_run_keyed_before_placement_left_the_key_resumes(tmp_path):
    """Runs keyed on 2026-12-05 (every setting but eval and output_dir) resume and are re-keyed."""
    from hmscale.config import save_resolved
    from hmscale.data.cachedir import stable_hash

    cfg = build_config({})
    save_resolved(cfg, tmp_path)
    tree = cfg.model_dump(mode="json")
    old_key = stable_hash({k: v for k, v in tree.items() if k not in ("eval", "output_dir")})
    assert old_key != training_hash(cfg)
    (tmp_path / "results.json").write_text(json.dumps({"config_hash": old_key, "stages": {"stage1": {}}}))
    res = _load_results(tmp_path, build_config({}, ["parallel.engine=local"]))
    assert "stage1" in res["stages"] and res["config_hash"] == training_hash(cfg)


def test_stage_commands_refuse_a_directory_holding_another_run(tmp_path, capsys):
    """`hmscale stage1 / stage2` keep no results.json: config.yaml (saved with absolute paths, as run_distill saves
    it) says which run the directory holds, and a command with other training settings stops before any work (and
    leaves config.yaml as it was); the same settings with a relative ds_config path pass."""
    from hmscale.cli import main
    from hmscale.config import save_resolved
    from hmscale.run_identity import saved_config_mismatch

    run = ["-s", f"output_dir={tmp_path}", "-s", "parallel.ds_config=ds_configs/zero2.json"]
    cfg = build_config({}, run[1::2]).with_absolute_paths()
    assert saved_config_mismatch(tmp_path, cfg) is None  # nothing there yet
    save_resolved(cfg, tmp_path)
    before = (tmp_path / "config.yaml").read_text()
    assert saved_config_mismatch(tmp_path, build_config({}, [f"output_dir={tmp_path}", "eval.max_sequences=3",
                                                             "parallel.ds_config=ds_configs/zero2.json"])
                                 .with_absolute_paths()) is None
    assert main(["stage1", *run, "-s", "stage1.lr=0.5"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "(stage1.lr: 0.01 -> 0.5); choose another output_dir" in err
    assert (tmp_path / "config.yaml").read_text() == before


def test_run_refuses_a_directory_the_stage_commands_trained_with_other_settings(tmp_path):
    """No results.json (stage commands, or a recipe run killed before its first record), but a config.yaml of other
    training settings: `hmscale run` must not take the models there for its own."""
    from hmscale.config import save_resolved

    save_resolved(build_config({}, ["seed=1"]), tmp_path)
    with pytest.raises(RecipeError, match=r"holds a run of a different config \(seed: 1 -> 2\)"):
        _load_results(tmp_path, build_config({}, ["seed=2"]))
    assert _load_results(tmp_path, build_config({}, ["seed=1"]))["stages"] == {}


def test_one_stage1_serves_several_stage2_ablations(tmp_path):
    """`hmscale stage2 --stage1-from RUN`: a new run starts from RUN's finished stage 1 when every training setting but
    stage2.* matches; its student, summary and metrics come along, its checkpoints do not."""
    import pytest

    from hmscale.config import save_resolved
    from hmscale.recipe import RecipeError, adopt_stage1

    base = build_config({}, [f"output_dir={tmp_path}/base", "stage1.lr=0.02"]).with_absolute_paths()
    save_resolved(base, tmp_path / "base")
    s1 = tmp_path / "base" / "stage1"
    (s1 / "student").mkdir(parents=True)
    (s1 / "checkpoints" / "step_00000004").mkdir(parents=True)
    (s1 / "student" / "feature_maps.safetensors").write_bytes(b"\x01\x02 weights")
    (s1 / "checkpoints" / "step_00000004" / "meta.json").write_text("{}")
    (s1 / "summary.json").write_text(json.dumps({"stage": "stage1", "done": False}))
    abl = build_config({}, [f"output_dir={tmp_path}/abl", "stage1.lr=0.02", "stage2.lr=5e-4"]).with_absolute_paths()
    with pytest.raises(RecipeError, match="holds no finished stage 1"):
        adopt_stage1(tmp_path / "base", abl)
    (s1 / "summary.json").write_text(json.dumps({"stage": "stage1", "done": True, "final_loss": 0.5}))
    assert "stage 1 from" in adopt_stage1(tmp_path / "base", abl)
    got = tmp_path / "abl" / "stage1"
    assert (got / "student" / "feature_maps.safetensors").read_bytes() == b"\x01\x02 weights"
    assert json.loads((got / "summary.json").read_text())["final_loss"] == 0.5 and not (got / "checkpoints").exists()
    assert not (tmp_path / "abl" / ".stage1.adopting").exists()
    assert "already in" in adopt_stage1(tmp_path / "base", abl)  # a rerun keeps it
    other = build_config({}, [f"output_dir={tmp_path}/other", "stage1.lr=0.05"]).with_absolute_paths()
    with pytest.raises(RecipeError, match=r"trained with other settings \(stage1.lr: 0.02 -> 0.05\); only stage2"):
        adopt_stage1(tmp_path / "base", other)
    mine = build_config({}, [f"output_dir={tmp_path}/abl", "stage1.lr=0.02", "stage2.lr=1e-4"]).with_absolute_paths()
    (got / "summary.json").write_text(json.dumps({"stage": "stage1", "done": True, "final_loss": 0.7}))
    with pytest.raises(RecipeError, match="already holds a stage 1 of its own"):
        adopt_stage1(tmp_path / "base", mine)
