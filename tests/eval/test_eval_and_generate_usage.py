"""Evaluating and using a distilled model on the CPU (eval, perplexity, generate, the lm-eval adapter): bugs pinned."""

import shutil

import pytest
import torch
from transformers import GPTNeoXForCausalLM

from hmscale.cli import main
from hmscale.config import build_config, save_resolved
from hmscale.eval import perplexity
from hmscale.eval.long_context import position_nll
from hmscale.models.convert import to_hedgehog, to_hedgemamba
from hmscale.teacher.flavors import neox_config


def _hedgemamba(vocab=64):
    torch.manual_seed(0)
    model = to_hedgemamba(to_hedgehog(GPTNeoXForCausalLM(neox_config("pythia-nano", vocab_size=vocab)).eval())).eval()
    with torch.no_grad():
        for layer in model.backbone.layers:
            layer.mixer.A_scale.add_(0.3)
    return model


def _saved(tmp_path):
    from hmscale.data.tokenizer import train_bpe

    docs = [f"def f{i}(x):\n    return x * {i} + state_{i % 7}\n" for i in range(200)]
    tok = train_bpe(docs, 300)
    model = _hedgemamba(len(tok))
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    return model, tok


# ----------------------------------------------------------------------------- hmscale eval RUN_DIR


def _fake_run(run_dir, trained_in):
    """A run directory whose config.yaml names the directory it was trained in (it was moved or copied since)."""
    save_resolved(build_config({}, [f"output_dir={trained_in}"]), run_dir)
    (run_dir / "results.json").write_text("{}")


@pytest.fixture
def scored_dirs(monkeypatch):
    import hmscale.recipe

    seen = []

    def fake_evaluate_run(cfg, **kwargs):
        seen.append(cfg.output_dir)
        return {}

    monkeypatch.setattr(hmscale.recipe, "evaluate_run", fake_evaluate_run)
    return seen


def test_eval_of_a_moved_run_scores_the_directory_given(tmp_path, scored_dirs, capsys):
    """`hmscale eval COPY` scored the run's original directory (the output_dir of its config.yaml), silently, or
    failed on the original's files: it scores the directory given, in either form; -s output_dir still wins."""
    original, moved = tmp_path / "original", tmp_path / "moved"
    _fake_run(original, original)
    shutil.copytree(original, moved)
    assert main(["eval", str(moved)]) == 0
    assert main(["eval", str(moved / "config.yaml")]) == 0
    assert main(["eval", str(moved), "-s", f"output_dir={original}"]) == 0
    assert scored_dirs == [str(moved.resolve()), str(moved.resolve()), str(original)]
    # an unfinished run (no results.json yet): still that directory, which then says it holds no finished run
    unfinished = tmp_path / "unfinished"
    save_resolved(build_config({}, [f"output_dir={original}"]), unfinished)
    assert main(["eval", str(unfinished)]) == 0
    assert scored_dirs[-1] == str(unfinished.resolve())


def test_eval_of_a_saved_model_directory_is_one_line(tmp_path, capsys):
    """A run's model/ directory (config.json, no config.yaml) was read as a YAML path and the error pointed at a
    model/config.yaml that no run has."""
    _saved(tmp_path)
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err
    assert "is a saved model, not a run" in err and len(err.strip().splitlines()) == 1


def test_eval_limit_below_one_is_refused_up_front(tmp_path, scored_dirs, capsys):
    """--limit 0 scored every model's perplexity, then lm-eval failed ('did not find any docs')."""
    _fake_run(tmp_path / "run", tmp_path / "run")
    assert main(["eval", str(tmp_path / "run"), "--limit", "0"]) == 2
    assert scored_dirs == []


# ----------------------------------------------------------------------------- perplexity on bad input


def test_perplexity_of_nothing_is_an_error_not_one():
    """No rows, or rows of one token, have no target: the perplexity came out as exactly 1.0."""
    model = _hedgemamba()
    for rows in (torch.zeros(0, 16, dtype=torch.long), torch.zeros(3, 1, dtype=torch.long)):
        with pytest.raises(ValueError, match="no next token to score"):
            perplexity(model, rows)
    with pytest.raises(ValueError, match="batch_size"):
        perplexity(model, torch.zeros(2, 8, dtype=torch.long), batch_size=0)
    with pytest.raises(ValueError, match=r"n >= 1"):
        position_nll(model, torch.zeros(0, 16, dtype=torch.long))


def test_token_ids_outside_the_vocabulary_are_one_line():
    """Tokens of another tokenizer: the embedding's bare 'IndexError: index out of range in self'."""
    model = _hedgemamba(vocab=64)
    rows = torch.randint(0, 64, (2, 16))
    rows[0, 0], rows[1, 3] = 0, 70
    for score in (lambda: perplexity(model, rows), lambda: position_nll(model, rows)):
        with pytest.raises(ValueError, match=r"token ids span 0\.\.70, outside the model's vocabulary \(0\.\.63\)"):
            score()


# ----------------------------------------------------------------------------- generation


def test_generate_prefill_makes_the_last_logits_only():
    """generate() asks for logits_to_keep=1, but prepare_inputs_for_generation dropped it: the prefill made
    (b, prompt length, vocab) logits (GBs for a long prompt with Pythia's vocabulary) to use the last row."""
    model = _hedgemamba()
    rows = []
    hook = model.lm_head.register_forward_hook(lambda mod, inp, out: rows.append(out.shape[1]))
    x = torch.randint(0, 64, (2, 40))
    with torch.no_grad():
        got = model.generate(input_ids=x, max_new_tokens=4, do_sample=False, pad_token_id=0)
    hook.remove()
    assert rows == [1, 1, 1, 1]
    y = x
    with torch.no_grad():  # the same tokens as argmax over full forwards
        for _ in range(4):
            y = torch.cat([y, model(y).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(got, y)


# ----------------------------------------------------------------------------- the lm-eval adapter


def test_adapter_takes_lm_eval_cli_arguments(tmp_path, capsys):
    """lm_eval's CLI passes device='cuda:0' by default and batch_size='auto' with --batch_size auto: both were
    tracebacks on a CPU machine; dtype= was silently ignored; a directory without a tokenizer was transformers'
    long tokenizer-conversion error."""
    pytest.importorskip("lm_eval")
    from hmscale.eval.lm_eval_adapter import HmscaleLM

    _saved(tmp_path)
    lm = HmscaleLM(pretrained=str(tmp_path / "m"), batch_size="auto", device="cuda:0", dtype="bfloat16",
                   max_batch_size=None)
    assert lm.batch_size == 1 and next(lm.model.parameters()).dtype == torch.bfloat16
    if not torch.cuda.is_available():
        assert lm._device.type == "cpu" and "sees no GPU; scoring on the CPU" in capsys.readouterr().err
    with pytest.raises(ValueError, match="dtype='int4'"):
        HmscaleLM(pretrained=str(tmp_path / "m"), dtype="int4", device="cpu")
    with pytest.raises(ValueError, match="batch_size='many'"):
        HmscaleLM(pretrained=str(tmp_path / "m"), batch_size="many", device="cpu")
    (tmp_path / "m" / "tokenizer.json").unlink()
    (tmp_path / "m" / "tokenizer_config.json").unlink()
    with pytest.raises(ValueError, match="has no tokenizer; pass the run's model/ directory"):
        HmscaleLM(pretrained=str(tmp_path / "m"), device="cpu")
    with pytest.raises(ValueError, match="holds no saved model"):
        HmscaleLM(pretrained=str(tmp_path / "missing"), device="cpu")


def test_adapter_generate_until_follows_the_task_sampling_settings(tmp_path):
    """A generate_until task's do_sample / temperature / top_p were dropped: always greedy."""
    pytest.importorskip("lm_eval")
    from hmscale.eval.lm_eval_adapter import HmscaleLM

    model, tok = _saved(tmp_path)
    lm = HmscaleLM(model=model, tokenizer=tok)
    calls = []
    generate = model.generate

    def spy(*args, **kwargs):
        calls.append({k: kwargs.get(k) for k in ("do_sample", "temperature", "top_p", "top_k")})
        return generate(*args, **kwargs)

    model.generate = spy

    class Req:
        def __init__(self, *args):
            self.args = args

    lm.generate_until([Req("def f1(", {"until": ["\n"], "max_gen_toks": 3}),
                       Req("def f1(", {"until": ["\n"], "max_gen_toks": 3, "do_sample": True, "temperature": 0.7,
                                       "top_p": 0.9}),
                       Req("def f1(", {"until": ["\n"], "max_gen_toks": 3, "do_sample": True, "temperature": 0.0})],
                      disable_tqdm=True)
    assert calls == [{"do_sample": False, "temperature": None, "top_p": None, "top_k": None},
                     {"do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": None},
                     {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}]


def test_generate_on_an_unfinished_run_says_so(tmp_path, capsys):
    """A run directory without model/ yet (killed in stage 1 or 2) was 'holds no saved model (config.json); pass a
    run's model/ directory': the one it does not have."""
    _fake_run(tmp_path / "run", tmp_path / "run")
    (tmp_path / "run" / "stage1").mkdir()
    assert main(["generate", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "is a run without its final model (model/): it has not finished; rerun `hmscale run`" in err
