"""The config tree: YAML in, dotted overrides, cross-field validation with one-line errors."""

import re
import subprocess
import sys

import pytest
import yaml

from hmscale.config import ConfigError, build_config, load_config, save_resolved


def test_defaults_are_the_demo():
    cfg = build_config()
    assert cfg.teacher.name_or_path is None and cfg.teacher.flavor == "pythia-micro"
    assert cfg.data.source == "embedded"
    assert cfg.budget.stage1_tokens + cfg.budget.stage2_tokens == cfg.budget.total_tokens


def test_yaml_and_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump({"stage2": {"lr": 1e-3}, "budget": {"total_tokens": 1000}}))
    cfg = load_config(p, ["stage2.lr=3e-4", "parallel.num_workers=2", "stage2.components.gate=false"])
    assert cfg.stage2.lr == 3e-4 and cfg.budget.total_tokens == 1000
    assert cfg.parallel.num_workers == 2 and cfg.stage2.components.gate is False


def test_resolved_config_round_trips(tmp_path):
    cfg = build_config(overrides=["seed=7", "budget.split=[0.25,0.75]"])
    path = save_resolved(cfg, tmp_path / "run")
    again = load_config(path)
    assert again == cfg and again.hash() == cfg.hash()


@pytest.mark.parametrize(
    "overrides, field",
    [
        (["stage2.lrr=1"], "stage2.lrr"),
        (["parallel.tp=3", "parallel.num_workers=3"], "parallel.tp"),
        (["budget.total_tokens=-5"], "budget.total_tokens"),
        (["data.source=files", "data.paths=[/no/such/file.txt]"], "data.paths"),
        (["budget.split=[0.5,0.6]"], "budget.split"),
        (["budget.split=[.nan,1.0]"], "budget.split"),
        (["parallel.tp=2", "parallel.num_workers=2", "parallel.zero_stage=3"], "parallel.zero_stage"),
        (["parallel.cuda_graphs=true"], "parallel.cuda_graphs"),
        (["parallel.cuda_graphs=true", "parallel.use_gpu=true", "parallel.compile=true", "parallel.zero_stage=0"],
         "parallel.cuda_graphs"),
        (["parallel.cuda_graphs=true", "parallel.use_gpu=true"], "parallel.cuda_graphs"),  # ZeRO-2, the default
        (["stage1.epochs=4", "stage1.steps=100"], "stage1.epochs"),
        (["stage1.epochs=0"], "stage1.epochs"),
        (["stage2.epochs=2", "stage2.steps=100"], "stage2.epochs"),
        (["stage1.transfer=both"], "stage1.transfer"),
        (["stage2.epochs=0"], "stage2.epochs"),
        (["stage2.ce_weight=0"], "stage2.ce_weight"),
        (["stage2.kd_source=teacher"], "stage2.kd_source"),
        (["stage2.kd_weight=1"], "stage2.kd_weight"),  # from the cache, which holds no top-k
        (["cache.capture.layers=[0,9]"], "cache.capture.layers"),  # pythia-micro has 4 layers
        (["cache.capture.layers=none"], "cache.capture.layers"),
    ],
)
def test_bad_configs_name_the_field(overrides, field):
    with pytest.raises(ConfigError) as err:
        build_config(overrides=overrides)
    msg = str(err.value)
    assert msg.startswith(field) and "\n" not in msg


def test_cuda_graphs_with_zero0_on_gpu_is_accepted():
    cfg = build_config(overrides=["parallel.cuda_graphs=true", "parallel.use_gpu=true", "parallel.zero_stage=0"])
    assert cfg.parallel.cuda_graphs and cfg.parallel.zero_stage == 0


def test_cli_bad_config_is_one_line_exit_2():
    r = subprocess.run(
        [sys.executable, "-m", "hmscale.cli", "check", "-s", "parallel.tp=3", "-s", "parallel.num_workers=3"],
        capture_output=True, text=True,
    )
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "parallel.tp" in lines[0] and "Traceback" not in r.stderr


def test_missing_config_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("/no/such.yaml")


def test_kd_from_the_cache_with_its_topk_or_online_is_accepted():
    assert build_config(overrides=["stage2.kd_weight=1", "cache.capture.topk=8"]).stage2.kd_weight == 1
    assert build_config(overrides=["stage2.kd_weight=1", "stage2.kd_source=online"]).stage2.kd_source == "online"
    # cache.enabled=false with KD from the cache: the top-k would come from a cache the config turned off (it was
    # built anyway); refused, naming both ways out
    with pytest.raises(ConfigError, match=r"cache.enabled: false, but stage2.kd_weight > 0 with kd_source=cache .*"
                                          r"enable the cache, or set stage2.kd_source=online"):
        build_config(overrides=["stage2.kd_weight=1", "cache.capture.topk=8", "cache.enabled=false"])
    assert build_config(overrides=["stage2.kd_weight=1", "stage2.kd_source=online", "cache.enabled=false"])


def test_the_distill_job_refuses_a_stage1_cache_without_attn_input_before_any_work(capsys, monkeypatch):
    import ray_jobs.distill as distill

    monkeypatch.setattr(distill, "run_distill", lambda *a, **k: pytest.fail("ran"))
    assert distill.main(["-s", "cache.capture.tensors=[attn_output]", "--run-dir", "/tmp/x"]) == 2
    assert "lacks attn_input" in capsys.readouterr().err


def test_a_union_field_says_each_form_it_takes():
    with pytest.raises(ConfigError, match=r"cache.capture.layers: Input should be a valid list, or Input should be "
                                          r"'all' \(got 'none'\)"):
        build_config(overrides=["cache.capture.layers=none"])


@pytest.mark.parametrize("override", ["stage2.steps=true", "stage2.lr=false", "seed=true", "data.max_tokens=true",
                                      "budget.split=[true,false]", "cache.capture.layers=[true]"])
def test_a_boolean_is_not_a_number(override):
    field = override.split("=")[0]
    with pytest.raises(ConfigError) as err:
        build_config(overrides=[override])
    assert str(err.value).startswith(f"{field}: a boolean where a number is expected")
    assert build_config(overrides=["cache.enabled=false"]).cache.enabled is False  # a boolean field takes one


@pytest.mark.parametrize("override, says", [
    ("=3", "the key before '=' must be section.field"),
    ("stage2.=3", "the key before '=' must be section.field"),
    ("data.dataset=[a", "the value is not valid YAML"),
])
def test_malformed_overrides_are_named(override, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        build_config(overrides=[override])


def test_config_paths_that_are_not_yaml_files(tmp_path):
    with pytest.raises(ConfigError, match="is a directory; pass a YAML file"):
        load_config(tmp_path)
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes(b"output_dir: caf\xe9\n")
    with pytest.raises(ConfigError, match="cannot be read as UTF-8"):
        load_config(bad)
    # `-s stage2.lr 3e-4` makes 3e-4 the config path: the message says how an override is written
    with pytest.raises(ConfigError, match=r"an override needs '=': -s stage2.lr=3e-4"):
        load_config("3e-4", ["stage2.lr"])


def test_a_ds_config_files_zero_stage_is_the_one_checked(tmp_path, monkeypatch):
    """`parallel.ds_config` decides the ZeRO stage DeepSpeed runs: a ZeRO-3 file under the default zero_stage=2 is
    ZeRO 3 for the config's own checks (tp, reduce-overhead); a file path relative to the repository works from any
    directory, and the absolute config points at that file; a file that is not JSON is one line."""
    import json

    monkeypatch.chdir(tmp_path)  # not the repository: ds_configs/ is found in the repository
    cfg = build_config({}, ["parallel.ds_config=ds_configs/zero3_offload.json"])
    assert cfg.parallel.zero_stage == 2 and cfg.parallel.zero == 3
    assert cfg.with_absolute_paths().parallel.ds_config.endswith("/ds_configs/zero3_offload.json")
    with open(cfg.with_absolute_paths().parallel.ds_config) as f:
        assert json.load(f)["zero_optimization"]["stage"] == 3
    with pytest.raises(ConfigError, match=r"tensor parallelism supports ZeRO 0, 1 or 2 \(parallel.ds_config "
                                          r"zero3_offload.json sets ZeRO 3\)"):
        build_config({}, ["parallel.ds_config=ds_configs/zero3_offload.json", "parallel.tp=2", "parallel.num_workers=2"])
    (tmp_path / "mine.json").write_text(json.dumps({"zero_optimization": {"stage": 1}, "train_batch_size": "auto"}))
    assert build_config({}, ["parallel.ds_config=mine.json", "parallel.zero_stage=3"]).parallel.zero == 1
    (tmp_path / "auto.json").write_text(json.dumps({"zero_optimization": {"stage": "auto"}}))
    assert build_config({}, ["parallel.ds_config=auto.json", "parallel.zero_stage=1"]).parallel.zero == 1
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"parallel.ds_config: .*bad.json' is not valid JSON"):
        build_config({}, ["parallel.ds_config=bad.json"])


def test_tp_must_divide_a_local_teachers_mlp_width_before_any_work(tmp_path):
    """A custom teacher whose MLP width tp does not divide was refused by the workers, after stage 1 had run."""
    import json

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_neox", "num_attention_heads": 4,
                                                     "num_hidden_layers": 2, "hidden_size": 64,
                                                     "intermediate_size": 250}))
    with pytest.raises(ConfigError, match=r"parallel.tp: 4 does not divide the teacher's MLP width 250"):
        build_config({}, [f"teacher.name_or_path={tmp_path}", "parallel.tp=4", "parallel.num_workers=4"])
    assert build_config({}, [f"teacher.name_or_path={tmp_path}", "parallel.tp=2", "parallel.num_workers=2"])


def test_a_short_list_and_an_empty_value_are_named_plainly():
    """`budget.split=[1]` said "budget.split.1: Field required"; `output_dir=` (null) "Input should be a valid string"
    without the value given: both say what was given."""
    with pytest.raises(ConfigError) as err:
        build_config({}, ["budget.split=[1]"])
    assert str(err.value) == "budget.split: too few values, item 1 is missing (got [1])"
    for override, field in (("output_dir=", "output_dir"), ("stage2.lr=", "stage2.lr")):
        with pytest.raises(ConfigError) as err:
            build_config({}, [override])
        assert str(err.value).startswith(f"{field}: ") and "got an empty value, null" in str(err.value)
    assert build_config({}, ["cache.max_tokens="]).cache.max_tokens is None  # (where null is a value: taken)


def test_settings_this_config_never_uses_are_named():
    """A KD temperature without a KD term, pretraining settings with a loaded teacher: accepted (ablations override
    them wholesale), but `hmscale check` and `hmscale run` name them instead of ignoring them silently."""
    from hmscale.config import unused_settings

    assert unused_settings(build_config({}, [])) == []
    (line,) = unused_settings(build_config({}, ["stage2.kd_temperature=2"]))
    assert line.startswith("stage2.kd_temperature=2 has no effect with stage2.kd_weight=0")
    assert unused_settings(build_config({}, ["stage2.kd_temperature=2", "stage2.kd_weight=1",
                                             "cache.capture.topk=8"])) == []
    over = ["teacher.name_or_path=EleutherAI/pythia-160m", "teacher.pretrain_steps=10", "teacher.pretrain_lr=1e-3"]
    (line,) = unused_settings(build_config({}, over))
    assert line.startswith("teacher.pretrain_steps, teacher.pretrain_lr have no effect with teacher.name_or_path")
    assert unused_settings(build_config({}, ["teacher.pretrain_steps=10"])) == []  # the flavour teacher uses them
