"""A new user following README.md on a CPU machine: command-line errors and exit codes. Each test failed before its
fix. CLI tests go through `hmscale.cli.main`, as the console script does."""

from __future__ import annotations

import os

import pytest

from hmscale.cli import main
from hmscale.config import ConfigError, build_config

TINY = [
    "teacher.flavor=pythia-nano", "tokenizer.vocab_size=300", "data.seq_len=32", "data.max_documents=12",
    "data.sequences_per_shard=8", "teacher.pretrain_steps=3", "budget.total_tokens=1024", "eval.max_sequences=2",
    "stage1.micro_batch_size=2", "stage2.micro_batch_size=2", "parallel.engine=local",
]


def _sets(overrides):
    return [a for o in overrides for a in ("-s", o)]


@pytest.mark.parametrize("argv, names", [
    (["eval", "--limit", "0"], "--limit"),
    (["generate", "runs/demo/model", "--temperature", "-1"], "--temperature"),
    (["run", "--foo"], "--foo"),
    (["bogus"], "bogus"),
    (["scale", "plan", "--gpu-mem", "lots"], "--gpu-mem"),
])
def test_a_bad_command_line_option_is_one_line_like_every_other_error(capsys, argv, names):
    # README: "A bad value stops with one line that names the field and what to change (exit code 2)". A bad option
    # (out of its range, unknown, not a number) printed typer's five-line box instead, its message wrapped at 80
    # columns ("Input should be greater than or equal to" / "0"), with box-drawing characters in batch logs
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert err.startswith("hmscale: error: ") and err.count("\n") == 1, err
    assert names in err and "--help" in err and "╭" not in err and not out


def test_help_and_no_arguments_still_print_the_help(capsys):
    assert main(["--help"]) == 0
    assert "Usage: hmscale" in capsys.readouterr().out
    assert main(["generate", "--help"]) == 0
    assert "--max-new-tokens" in capsys.readouterr().out
    assert main([]) == 2  # (no_args_is_help: the help, and click's usage exit code, as before)
    out, err = capsys.readouterr()
    assert "Usage: hmscale" in out + err and "hmscale: error" not in out + err


def test_check_still_exits_0_and_a_failing_command_its_own_code(capsys, tmp_path):
    assert main(["check", "-s", "seed=1"]) == 0
    assert main(["cache", "verify", str(tmp_path)]) == 1  # (not a cache: exit 1, as documented)
    assert main(["check", "-s", "seed=-1"]) == 2


@pytest.mark.parametrize("targets", ["[in_proj]", "[in_proj, out_proj, dense_h_to_4h]"])
def test_lora_targets_without_a_lora_rank_are_refused_as_lora_alpha_is(targets, capsys):
    # README: "a setting whose switch is off, such as `stage2.lora_alpha` with `lora_rank=0`, is refused". A LoLCATs
    # user naming the layers to adapt but forgetting the rank got a full fine-tune of every weight, silently
    with pytest.raises(ConfigError, match=r"^stage2\.lora_targets: .* stage2\.lora_rank=0 adds no adapters; set "
                                          r"stage2\.lora_rank > 0 \(e\.g\. 8\) or remove the lora_targets setting$"):
        build_config({}, [f"stage2.lora_targets={targets}"])
    assert main(["check", "-s", f"stage2.lora_targets={targets}"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert build_config({}, [f"stage2.lora_targets={targets}", "stage2.lora_rank=8"]).stage2.lora_rank == 8
    assert build_config({}, ["stage2.lora_targets=[in_proj, out_proj]"]).stage2.lora_rank == 0  # (the default)


@pytest.fixture
def hub_bars_restored():
    """The run below may turn transformers' progress bars off in this process: turn them back on afterwards."""
    before = os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS")
    yield
    from transformers.utils import logging as hf_logging

    hf_logging.enable_progress_bar()
    if before is None:
        os.environ.pop("HF_HUB_DISABLE_PROGRESS_BARS", None)
    else:
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = before


def test_a_tiny_run_warns_about_warmup_naming_the_stage_and_keeps_batch_logs_free_of_bars(
        tmp_path, monkeypatch, capsys, hub_bars_restored):
    # with stage2.warmup_steps=1 set (as the tests' tiny overrides do), a run still warned "warmup_steps=10 is longer
    # than the stage's 1 steps ... lower warmup_steps": stage 1's, unnamed. And with HMSCALE_NO_PROGRESS=1 (README: "logs of
    # batch jobs") transformers' "Loading weights" / "Writing model shards" bars still filled stderr
    from transformers.utils import logging as hf_logging

    hf_logging.enable_progress_bar()
    monkeypatch.setenv("HMSCALE_NO_PROGRESS", "1")
    overrides = TINY + [f"data.cache_dir={tmp_path / 'data'}", f"cache.root={tmp_path / 'tc'}",
                        f"output_dir={tmp_path / 'run'}"]
    assert main(["run", *_sets(overrides)]) == 0
    err = capsys.readouterr().err
    assert "stage1.warmup_steps=10 is longer than stage 1's 1 steps" in err, err
    assert "lower stage1.warmup_steps" in err and "lr=0.01" in err
    assert "stage2.warmup_steps=20 is longer than stage 2's" in err
    assert "Loading weights" not in err and "Writing model shards" not in err and "it/s]" not in err


@pytest.mark.parametrize("command, code", [("verify", 1), ("rm", 2)])
def test_cache_verify_and_rm_of_a_mistyped_directory_say_it_does_not_exist(tmp_path, capsys, command, code):
    # `hmscale cache verify .cache/hmscale/teacher/v1-typo` answered "... has no manifest.json; it is not a teacher
    # cache (build one with `hmscale cache CONFIG`)": as if the directory were there, and a build the fix
    missing = tmp_path / "v1-typo"
    assert main(["cache", command, str(missing)]) == code
    err = capsys.readouterr().err
    assert f"{missing} does not exist or is not a directory" in err and "manifest" not in err
    assert "hmscale cache list ROOT" in err
    assert main(["cache", command, str(tmp_path)]) == code  # (a directory that is no cache: as before)
    assert "has no manifest.json; it is not a teacher cache" in capsys.readouterr().err
