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
