"""Overrides a user may write that the config once accepted and that failed (or trained otherwise) much later."""

import pytest

from hmscale.config import ConfigError, build_config


@pytest.mark.parametrize("override", ["parallel.zero_stage=true", "parallel.zero_stage=false"])
def test_a_boolean_is_not_a_zero_stage(override):
    # zero_stage is Literal[0, 1, 2, 3]: pydantic read true / false there as ZeRO 1 / 0
    with pytest.raises(ConfigError, match=r"^parallel.zero_stage: a boolean where a number is expected"):
        build_config({}, [override])
    assert build_config({}, ["parallel.zero_stage=1"]).parallel.zero_stage == 1


def test_seq_len_past_the_miniature_teachers_positions():
    # pretraining the pythia-micro teacher (1024 positions) on 2048-token rows raised a traceback after the data work
    with pytest.raises(ConfigError, match=r"^data.seq_len: 2048 exceeds the pythia-micro teacher's 1024 positions; "
                                          r"set data.seq_len<=1024"):
        build_config({}, ["data.seq_len=2048"])
    assert build_config({}, ["data.seq_len=1024"]).data.seq_len == 1024
    assert build_config({}, ["data.seq_len=2048", "teacher.flavor=pythia-mini"]).data.seq_len == 2048


def test_layer_parallel_with_more_workers_than_layers():
    # stage 1 stopped on it only after the data, the teacher and the cache
    with pytest.raises(ConfigError, match=r"^stage1.layer_parallel: 5 workers for 4 layers"):
        build_config({}, ["stage1.layer_parallel=true", "parallel.num_workers=5"])
    assert build_config({}, ["stage1.layer_parallel=true", "parallel.num_workers=4"]).stage1.layer_parallel


@pytest.mark.parametrize("overrides, vocab", [
    (["cache.capture.topk=4096"], 2048),  # the demo's BPE (tokenizer.vocab_size)
    (["teacher.name_or_path=EleutherAI/pythia-160m", "cache.capture.topk=60000"], 50304),
])
def test_topk_past_the_vocabulary(overrides, vocab):
    # the teacher forward failed on the first shard with "selected index k out of range"
    with pytest.raises(ConfigError, match=rf"^cache.capture.topk: \d+ exceeds the {vocab}-token vocabulary"):
        build_config({}, overrides)
    assert build_config({}, ["cache.capture.topk=2048"]).cache.capture.topk == 2048


def test_a_number_with_a_leading_zero_is_not_octal(tmp_path):
    # YAML 1.1 read data.revision=0123456 (an all-digit short sha) as the octal 42798: another revision, silently
    from hmscale.config import load_config, save_resolved

    hf = ["data.source=hf", "data.dataset=org/corpus"]
    cfg = build_config({}, hf + ["data.revision=0123456"])
    assert cfg.data.revision == "0123456"
    assert load_config(save_resolved(cfg, tmp_path / "run")) == cfg
    (tmp_path / "c.yaml").write_text("data: {source: hf, dataset: org/corpus, revision: 0123456}\n")
    assert load_config(tmp_path / "c.yaml").data.revision == "0123456"
    assert build_config({}, ["seed=010"]).seed == 10 and build_config({}, ["seed=0"]).seed == 0  # decimal, as written


def test_cache_disabled_moves_stage1_online(tmp_path):
    # cache.enabled=false ("stage 1 runs online from the live teacher") left stage1.source=cache: stage 1 built the
    # cache itself and trained from it
    from hmscale.config import load_config, save_resolved

    cfg = build_config({}, ["cache.enabled=false"])
    assert cfg.stage1.source == "online"
    assert load_config(save_resolved(cfg, tmp_path / "run")) == cfg
    assert build_config({}, []).stage1.source == "cache"


@pytest.mark.parametrize("command", ["run", "stage1"])
@pytest.mark.parametrize("override, says", [
    ("cache.capture.tensors=[attn_output]", "cache.capture.tensors: ['attn_output'] lacks attn_input"),  # a KeyError
    ("cache.capture.layers=[0]", "cache.capture.layers: [0] leaves out layers"),  # after building the cache
])
def test_stage1_from_a_cache_that_lacks_what_it_reads(tmp_path, capsys, command, override, says):
    from hmscale.cli import main

    args = [command, "-s", override, "-s", f"output_dir={tmp_path}/r", "-s", f"data.cache_dir={tmp_path}/d"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"hmscale: error: {says}") and "\n" not in err
    assert not (tmp_path / "d").exists()  # before any data work
    assert main(["check", "-s", override]) == 0  # `hmscale cache` alone may capture less
    assert main(["check", "-s", override, "-s", "stage1.source=online"]) == 0


def test_a_submitted_job_refuses_a_stage1_cache_that_lacks_what_it_reads(tmp_path, capsys):
    # the job `hmscale submit` sends (python -m ray_jobs.run_recipe) checks it as `hmscale run` does
    from ray_jobs import run_recipe

    args = ["-s", "cache.capture.tensors=[attn_output]", "-s", f"output_dir={tmp_path}/r",
            "-s", f"data.cache_dir={tmp_path}/d"]
    assert run_recipe.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("hmscale: error: cache.capture.tensors: ['attn_output'] lacks attn_input") and err.count("\n") == 1
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("override", ["stage2.lr=.inf", "stage1.lr=.inf", "teacher.pretrain_lr=.inf",
                                      "stage2.new_params_lr_scale=.inf", "stage2.feature_map_lr_scale=.inf"])
def test_an_infinite_learning_rate_is_refused(override):
    # (NaN already failed the > 0 check; inf passed it and trained to NaN at the first step)
    with pytest.raises(ConfigError, match=rf"{override.split('=')[0]}: Input should be a finite number"):
        build_config({}, [override])
