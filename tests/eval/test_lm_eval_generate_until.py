"""The adapter's generate_until gives a task without ``max_gen_toks`` (gsm8k's YAML sets none) as many new tokens as
lm-eval-harness's own models (its ``normalize_gen_kwargs`` default, the ``hf`` model's ``max_gen_toks``): it stopped
at 64, cutting chain-of-thought answers that the harness's ``hf`` model lets run to 256 tokens."""

import pytest
import torch
from transformers import GPTNeoXForCausalLM

pytest.importorskip("lm_eval")
from hmscale.eval.lm_eval_adapter import HmscaleLM  # noqa: E402
from hmscale.teacher.flavors import neox_config  # noqa: E402


class _Req:
    def __init__(self, *args):
        self.args = args


def test_generate_until_defaults_to_the_harness_max_gen_toks():
    utils = pytest.importorskip("lm_eval.models.utils")
    if not hasattr(utils, "normalize_gen_kwargs"):
        pytest.skip("this lm-eval has no normalize_gen_kwargs")
    default = utils.normalize_gen_kwargs({"until": ["\n"], "do_sample": False})["max_gen_toks"]

    from hmscale.data.tokenizer import train_bpe

    tok = train_bpe([f"def f{i}(x):\n    return x * {i}\n" for i in range(100)], 280)
    torch.manual_seed(0)
    model = GPTNeoXForCausalLM(neox_config("pythia-nano", vocab_size=len(tok))).eval()
    (x,) = tok(" x", add_special_tokens=False)["input_ids"]
    forward = model.forward

    def always_x(*args, **kwargs):  # never a stop string, never the end of text: runs to the token limit
        out = forward(*args, **kwargs)
        out.logits[:, -1, x] += 1e4
        return out

    model.forward = always_x
    lm = HmscaleLM(model=model, tokenizer=tok)
    (text,) = lm.generate_until([_Req("def f1(", {"until": ["\n"], "do_sample": False})], disable_tqdm=True)
    assert text == " x" * default
    (text,) = lm.generate_until([_Req("def f1(", {"until": ["\n"], "max_gen_toks": 3})], disable_tqdm=True)
    assert text == " x" * 3


def test_an_empty_stop_string_is_ignored_as_the_harness_does():
    """``until: [""]`` (an empty stop sequence; lm-eval's own models skip it) crashed the request with Python's
    'empty separator'; the text is that of the request without it."""
    from hmscale.data.tokenizer import train_bpe

    tok = train_bpe([f"def f{i}(x):\n    return x * {i}\n" for i in range(100)], 280)
    torch.manual_seed(0)
    model = GPTNeoXForCausalLM(neox_config("pythia-nano", vocab_size=len(tok))).eval()
    lm = HmscaleLM(model=model, tokenizer=tok)
    ref = lm.generate_until([_Req("def f1(", {"until": ["\n"], "max_gen_toks": 6})], disable_tqdm=True)
    got = lm.generate_until([_Req("def f1(", {"until": ["", "\n"], "max_gen_toks": 6})], disable_tqdm=True)
    assert got == ref
    ref = lm.generate_until([_Req("def f1(", {"until": [], "max_gen_toks": 6})], disable_tqdm=True)
    assert lm.generate_until([_Req("def f1(", {"until": "", "max_gen_toks": 6})], disable_tqdm=True) == ref


@pytest.mark.parametrize("kwargs", [
    {"until": ["\n"]},
    {"until": ["\n"], "temperature": 0.7},  # do_sample left out, a temperature: the harness samples
    {"until": ["\n"], "temperature": 0.0},
    {"until": ["\n"], "do_sample": True},  # (at transformers' default temperature)
    {"until": ["\n"], "do_sample": True, "temperature": 0.5, "top_p": 0.9},
    {"until": ["\n"], "do_sample": False, "temperature": 0.8},
    {"until": ["\n"], "max_new_tokens": 7},  # the aliases of max_gen_toks, in the harness's priority
    {"until": ["\n"], "max_tokens": 9, "max_completion_tokens": 4},
    {"until": ["\n"], "max_gen_toks": 5, "max_new_tokens": 7},
])
def test_generation_settings_are_read_as_the_harness_reads_them(kwargs):
    """A task that sets a temperature but no do_sample was decoded greedily (the harness samples), and one that
    limits its length with max_new_tokens (or another alias of max_gen_toks) ran to the default limit."""
    utils = pytest.importorskip("lm_eval.models.utils")
    if not hasattr(utils, "normalize_gen_kwargs"):
        pytest.skip("this lm-eval has no normalize_gen_kwargs")
    want = utils.normalize_gen_kwargs(dict(kwargs))
    until, max_new, do_sample, sampling = HmscaleLM._gen_settings(HmscaleLM.__new__(HmscaleLM), dict(kwargs))
    assert (until, max_new, do_sample) == (want["until"], want["max_gen_toks"], want["do_sample"])
    assert sampling == {k: kwargs[k] for k in ("temperature", "top_p", "top_k") if k in kwargs}
