"""The config tree: YAML in, dotted overrides, cross-field validation with one-line errors."""

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
