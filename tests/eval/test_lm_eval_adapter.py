"""The lm-eval-harness adapter on a local custom task (the harness's datasets cannot be downloaded here)."""

import json

import pytest
import torch
from transformers import GPTNeoXForCausalLM, PreTrainedTokenizerFast
from tokenizers import Tokenizer, models, pre_tokenizers

pytest.importorskip("lm_eval", reason="lm-eval is in the project's CPU environment (make venv), not on the GPU image")
from hmscale.eval.lm_eval_adapter import HmscaleLM, evaluate_tasks  # noqa: E402
from hmscale.teacher.flavors import neox_config


def _char_tokenizer():
    vocab = {c: i for i, c in enumerate(["<eos>"] + [chr(i) for i in range(32, 127)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def _task(tmp_path):
    docs = [{"question": f"{a}+{b}=", "choices": [str(a + b), str(a + b + 1)], "label": 0} for a in range(3) for b in range(3)]
    data = tmp_path / "toy.jsonl"
    data.write_text("\n".join(json.dumps(d) for d in docs))
    (tmp_path / "toy.yaml").write_text(
        "task: hmscale_toy\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "doc_to_text: '{{question}}'\n"
        "doc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{label}}'\n"
        "metric_list:\n  - metric: acc\n"
    )
    return len(docs)


def test_adapter_runs_a_local_task(tmp_path):
    torch.manual_seed(0)
    tok = _char_tokenizer()
    model = GPTNeoXForCausalLM(neox_config("pythia-nano", vocab_size=len(tok))).eval()
    _task(tmp_path)
    res = evaluate_tasks(model, tok, ["hmscale_toy"], include_path=str(tmp_path))
    acc = res["hmscale_toy"]["acc,none"]
    assert 0.0 <= acc <= 1.0


def test_loglikelihood_matches_a_direct_forward():
    torch.manual_seed(0)
    tok = _char_tokenizer()
    model = GPTNeoXForCausalLM(neox_config("pythia-nano", vocab_size=len(tok))).eval()
    lm = HmscaleLM(model=model, tokenizer=tok)

    class Req:
        args = ("1+2=", "3")

    (score, _), = lm.loglikelihood([Req()])
    ids = tok("1+2=3", add_special_tokens=False)["input_ids"]
    logits = model(input_ids=torch.tensor([ids[:-1]])).logits[0, -1]
    expected = torch.log_softmax(logits, -1)[ids[-1]].item()
    assert abs(score - expected) < 1e-5


class _Req:
    def __init__(self, *args):
        self.args = args


def _bpe_model():
    from hmscale.data.tokenizer import train_bpe

    docs = [f"def f{i}(x):\n    return x * {i} + state_{i % 7}\nAnswer: {'ABCD'[i % 4]}\n" for i in range(300)]
    tok = train_bpe(docs, 300)
    torch.manual_seed(1)
    return GPTNeoXForCausalLM(neox_config("pythia-nano", vocab_size=len(tok))).eval(), tok


def _direct_logprob(model, ctx_ids, cont_ids):
    ids = torch.tensor([ctx_ids + cont_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids[:, :-1]).logits[0].float(), -1)[-len(cont_ids):]
    return logp.gather(-1, torch.tensor(cont_ids)[:, None]).sum().item()


def test_trailing_space_of_the_context_moves_to_the_continuation():
    """As lm-eval-harness's own models: "return " + "x" is scored on the tokens of "return x" (" x"), not on " "
    then "x" (which a BPE never produces in running text)."""
    model, tok = _bpe_model()
    lm = HmscaleLM(model=model, tokenizer=tok)
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    for context, continuation in [("def f3(x):\n    return ", "x"), ("Answer: ", "B"), ("def f1(x):\n    return", " x")]:
        whole, ctx = enc(context.rstrip() + context[len(context.rstrip()):] + continuation), enc(context.rstrip())
        if context != context.rstrip():  # the case that matters: tokenised apart, the pair has other tokens
            assert enc(context) + enc(continuation) != whole
        (score, _), = lm.loglikelihood([_Req(context, continuation)])
        assert abs(score - _direct_logprob(model, ctx, whole[len(ctx):])) < 1e-5


def test_loglikelihood_edge_cases_and_progress(capsys, monkeypatch):
    monkeypatch.delenv("HMSCALE_NO_PROGRESS", raising=False)  # (set process-wide by other test modules: no bars then)
    model, tok = _bpe_model()
    lm = HmscaleLM(model=model, tokenizer=tok, max_length=8)
    reqs = [_Req("def f2(x):", "\n    return x"), _Req("", "def f5(x):"), _Req("Answer:", ""), _Req("  ", "def f5(x):")]
    scores = lm.loglikelihood(reqs, disable_tqdm=True)  # the keyword lm-eval's TemplateLM takes
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert abs(scores[1][0] - _direct_logprob(model, [tok.eos_token_id], enc("def f5(x):"))) < 1e-5
    assert abs(scores[3][0] - _direct_logprob(model, [tok.eos_token_id], enc("  def f5(x):"))) < 1e-5  # all blank
    assert scores[2] == (0.0, True)  # nothing to score
    assert "[lm-eval]" not in capsys.readouterr().err
    lm.loglikelihood(reqs)
    assert "[lm-eval] HmscaleLM" in capsys.readouterr().err  # progress on long task runs
    with pytest.raises(ValueError, match="does not fit max_length=8"):
        lm.loglikelihood([_Req("x", " ".join(["state"] * 20))])
    assert isinstance(lm.loglikelihood_rolling([_Req("def f1(x):\n    return x\n" * 3)], disable_tqdm=True)[0], float)


def test_generate_until_stops_at_the_stop_string():
    """A stop string ends the generation (not only cuts its text): a request costs its answer's tokens, not
    max_gen_toks forwards; the text is the greedy continuation up to the stop string."""
    model, tok = _bpe_model()
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    (x,), (nl,) = enc(" x"), enc("\n")
    forward, calls = model.forward, []

    def writes_x_then_newline(*args, **kwargs):  # the model's own forward, its last logits pushed to " x", " x", "\n"
        calls.append(1)
        out = forward(*args, **kwargs)
        out.logits[:, -1, x if len(calls) < 3 else nl] += 1e4
        return out

    model.forward = writes_x_then_newline
    lm = HmscaleLM(model=model, tokenizer=tok)
    out = lm.generate_until([_Req("def f1(", {"until": ["\n"], "max_gen_toks": 40})], disable_tqdm=True)
    assert out == [" x x"]
    assert len(calls) == 3  # not 40 forwards


def test_generate_until_stops_with_a_tokenizer_without_a_decoder():
    """transformers' stop_strings reads the vocabulary through the tokenizer's decoder: with a word-level tokenizer
    that has none it failed inside transformers ("substring not found"). The stop strings are now looked for in the
    decoded continuation, as lm-eval's own models do."""
    torch.manual_seed(0)
    tok = _char_tokenizer()
    model = GPTNeoXForCausalLM(neox_config("pythia-nano", vocab_size=len(tok))).eval()
    a, b = tok.convert_tokens_to_ids(["a", "b"])
    forward, calls = model.forward, []

    def writes_a_a_then_b(*args, **kwargs):
        calls.append(1)
        out = forward(*args, **kwargs)
        out.logits[:, -1, a if len(calls) < 3 else b] += 1e4
        return out

    model.forward = writes_a_a_then_b
    lm = HmscaleLM(model=model, tokenizer=tok)
    out = lm.generate_until([_Req("def f(", {"until": ["b"], "max_gen_toks": 30})], disable_tqdm=True)
    assert out == [tok.decode([a, a, b]).split("b")[0]] and "a" in out[0]
    assert len(calls) == 3  # stopped at the stop string, not after 30 forwards


def test_task_names_are_checked_without_the_full_index_only_when_no_yaml_spells_them(tmp_path, monkeypatch):
    """`unknown_tasks` refuses at once a name that no task YAML (nor template) under lm-eval's folder or the include
    path spells out; any name some file mentions goes to lm-eval's own index, which decides."""
    from hmscale.eval import lm_eval_adapter as adapter

    (tmp_path / "mine.yaml").write_text("task: hmscale_mine_task\ndataset_path: json\n")
    (tmp_path / "_base_template_yaml").write_text("tag: hmscale_template_tag\n")
    found = adapter._mentioned_in_task_yamls(["hmscale_mine_task", "hmscale_template_tag", "hellaswag",
                                              "no_such_task_xyz"], include_path=str(tmp_path))
    assert found == {"hmscale_mine_task", "hmscale_template_tag", "hellaswag"}
    (tmp_path / "more.yaml").write_text("include: mine.yaml\ntask: other\n")  # a name that may come from anywhere
    assert adapter._mentioned_in_task_yamls(["no_such_task_xyz"], include_path=str(tmp_path)) == {"no_such_task_xyz"}

    import lm_eval.tasks

    class Index:  # lm-eval's index: built only when some name is mentioned
        built = 0

        def __init__(self, include_path=None):
            Index.built += 1
            self.all_tasks = ["hellaswag"]

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", Index)
    assert adapter.unknown_tasks(["no_such_task_xyz"]) == ["no_such_task_xyz"] and Index.built == 0
    assert adapter.unknown_tasks(["hellaswag", "no_such_task_xyz"]) == ["no_such_task_xyz"] and Index.built == 1
