"""Bad input to the commands: one line on stderr that says what to change, exit code 2, before any long work."""

import json

import pytest
import torch

from hmscale.cli import main


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("hmscale: error: ") and "\n" not in err and "Traceback" not in err, err
    return err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the check is for a torch without a GPU")
@pytest.mark.parametrize("command", ["run", "stage1", "stage2"])
def test_use_gpu_on_a_torch_without_gpu(tmp_path, capsys, command):
    args = [command, "-s", "parallel.engine=local", "-s", "parallel.use_gpu=true", "-s", f"output_dir={tmp_path}/r"]
    assert main(args) == 2
    assert "parallel.use_gpu: true, but this torch" in _one_line(capsys)
    assert not (tmp_path / "r" / "results.json").exists()


def test_generate_takes_a_run_directory_and_names_a_model_without_tokenizer(tmp_path, capsys):
    from hmscale.models import HedgeMambaConfig, HedgeMambaForCausalLM
    from hmscale.data.tokenizer import train_bpe

    cfg = HedgeMambaConfig(vocab_size=300, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=64)
    model = HedgeMambaForCausalLM(cfg)
    model.save_pretrained(tmp_path / "run" / "stage2" / "hf")  # the stage's export: no tokenizer
    model.save_pretrained(tmp_path / "run" / "model")
    capsys.readouterr()  # (transformers' progress bars)
    assert main(["generate", str(tmp_path / "run" / "stage2" / "hf")]) == 2
    assert "has no tokenizer; pass the run's model/ directory" in _one_line(capsys)
    assert main(["generate", str(tmp_path)]) == 2  # neither a model nor a run directory
    assert "holds no saved model (config.json)" in _one_line(capsys)
    tok = train_bpe(["def f(x):\n    return x + 1\n"] * 50, vocab_size=300)
    tok.save_pretrained(tmp_path / "run" / "model")
    assert main(["generate", str(tmp_path / "run"), "--max-new-tokens", "3"]) == 0  # the run's model/
    assert capsys.readouterr().out.startswith("def ")


def test_eval_checks_its_arguments_before_the_perplexities(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "results.json").write_text(json.dumps({"stages": {}}))
    assert main(["eval", "-s", f"output_dir={run}", "--context-length", "0"]) == 2
    assert "eval.context_length" in _one_line(capsys)
    assert main(["eval", "-s", f"output_dir={run}", "-s", f"data.cache_dir={tmp_path}/d",
                 "--tasks", "no_such_task_here"]) == 2
    err = _one_line(capsys)
    assert "lm-eval-harness knows no task 'no_such_task_here'" in err
    assert not (tmp_path / "d").exists()  # refused before the data was prepared
    assert main(["eval", "-s", f"output_dir={run}", "-s", "eval.tasks=[no_such_task_here]"]) == 2
    assert _one_line(capsys).startswith("hmscale: error: eval.tasks: lm-eval-harness knows no task")
    assert main(["eval", "-s", f"output_dir={run}", "--tasks", "hellaswag", "--include-path", f"{tmp_path}/no"]) == 2
    assert f"--include-path: '{tmp_path}/no' is not a folder" in _one_line(capsys)


def test_eval_refuses_other_training_settings_and_takes_a_run_directory(tmp_path, capsys):
    """`hmscale eval` with a training setting the run was not trained with would train another teacher and put the
    run's feature maps on it: refused in one line, before any data work; a run directory stands for its config.yaml."""
    from hmscale.config import build_config, save_resolved
    from hmscale.run_identity import training_hash

    run = tmp_path / "run"
    cfg = build_config({}, [f"output_dir={run}", f"data.cache_dir={tmp_path}/d", "teacher.pretrain_steps=50"])
    save_resolved(cfg.with_absolute_paths(), run)
    (run / "results.json").write_text(json.dumps({"config_hash": training_hash(cfg.with_absolute_paths()),
                                                  "stages": {}}))
    assert main(["eval", str(run), "-s", "teacher.pretrain_steps=40"]) == 2
    err = _one_line(capsys)
    assert f"output_dir: {run} holds a run of a different config (teacher.pretrain_steps: 50 -> 40)" in err
    assert f"`hmscale eval {run}`" in err
    assert main(["eval", str(run / "config.yaml"), "-s", "stage2.lr=0.5"]) == 2
    assert "stage2.lr: " in _one_line(capsys)
    assert not (tmp_path / "d").exists()  # refused before the data was prepared


def test_cache_engine_is_checked_first(capsys):
    assert main(["cache", "--engine", "foo"]) == 2
    assert "cache --engine: 'foo' is not an engine" in _one_line(capsys)


def test_stage2_from_a_directory_without_stage1_is_one_line(tmp_path, capsys):
    assert main(["stage2", "-s", f"output_dir={tmp_path}/abl", "--stage1-from", str(tmp_path / "nothing")]) == 2
    assert "--stage1-from: " in _one_line(capsys)
    assert not (tmp_path / "abl" / "stage2").exists()
