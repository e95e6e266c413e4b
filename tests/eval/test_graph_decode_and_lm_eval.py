"""Evaluation: the CUDA-graph decoder's prefill and step outputs (CPU-reachable parts; one GPU test),
and the lm-eval adapter: generate_until on a model without generate(), a tokenizer model_arg, lm-eval's own models
still registered after importing it, the device of a model object, max_length below one."""

import pytest
import torch
from transformers import GPTNeoXForCausalLM

from hmscale.eval import graph_decode
from hmscale.eval.graph_decode import GraphDecoder
from hmscale.teacher.flavors import neox_config
from tests.models._helpers import perturbed_hedgemamba


class _CountingModel(torch.nn.Module):
    """The model, recording the keyword arguments of each call."""

    def __init__(self, model):
        super().__init__()
        self.model, self.calls = model, []

    def forward(self, **kwargs):
        self.calls.append(kwargs)
        return self.model(**kwargs)


def test_graph_decoder_prefill_makes_the_last_logits_only():
    model = perturbed_hedgemamba(97)
    ids = torch.randint(1, 97, (2, 40))
    spy = _CountingModel(model)
    cache, logits = graph_decode.prefill(spy, ids)
    assert spy.calls[0].get("logits_to_keep") == 1
    with torch.no_grad():
        full = model(ids).logits[:, -1]
    torch.testing.assert_close(logits, full, rtol=1e-5, atol=1e-5)
    # not a view into (b, prompt length, vocab) logits: those would stay allocated as long as the decoder
    assert logits.untyped_storage().nbytes() == logits.numel() * logits.element_size()
    assert cache.seqlen == 40


class _Graph:
    """A stand-in for the captured step: replay writes row ``static_ids`` of a fixed table into the static output."""

    def __init__(self, dec, table):
        self.dec, self.table = dec, table

    def replay(self):
        self.dec.static_logits.copy_(self.table[self.dec.static_ids.view(-1)])


def test_graph_decoder_step_returns_logits_the_next_step_leaves_alone():
    table = torch.randn(11, 11, generator=torch.Generator().manual_seed(0))
    dec = object.__new__(GraphDecoder)  # (the CUDA capture is skipped: its replay is stubbed)
    dec.static_ids, dec.static_pos = torch.zeros(2, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long)
    dec.static_logits, dec.pos = torch.zeros(2, 11), 5
    dec.graph = _Graph(dec, table)
    first = dec.step(torch.tensor([3, 4]))
    second = dec.step(torch.tensor([7, 1]))
    assert torch.equal(first, table[[3, 4]])  # (it was the static buffer: the second step overwrote it)
    assert torch.equal(second, table[[7, 1]])
    assert dec.pos == 7


class _Req:
    def __init__(self, *args):
        self.args = args


def test_generate_until_on_a_model_without_generate_is_one_line():
    pytest.importorskip("lm_eval", reason="lm-eval is in the project's CPU environment (make venv)")
    from hmscale.data.tokenizer import train_bpe
    from hmscale.eval.lm_eval_adapter import HmscaleLM
    from hmscale.models.convert import to_hedgehog

    tok = train_bpe([f"def f{i}(x):\n    return x * {i}\n" for i in range(100)], 300)
    torch.manual_seed(0)
    student = to_hedgehog(GPTNeoXForCausalLM(neox_config("pythia-nano", vocab_size=len(tok))).eval())
    lm = HmscaleLM(model=student, tokenizer=tok)
    with pytest.raises(ValueError, match="HedgehogForCausalLM has no generate"):
        lm.generate_until([_Req("def f1(x):", {"until": ["\n"], "max_gen_toks": 4})], disable_tqdm=True)
    assert lm.generate_until([], disable_tqdm=True) == []
    (score, _), = lm.loglikelihood([_Req("def f1(x):", " return")], disable_tqdm=True)  # (scoring still works)
    assert score < 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the graph capture)")
def test_graph_decoder_on_gpu_keeps_one_row_of_prompt_logits_and_decodes_as_generate():
    model = perturbed_hedgemamba(97).cuda()
    ids = torch.randint(1, 97, (2, 70), device="cuda")
    dec = GraphDecoder(model, ids)
    assert dec.next_logits.untyped_storage().nbytes() == dec.next_logits.numel() * dec.next_logits.element_size()
    ref = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)[:, 70:]
    assert torch.equal(dec.greedy(12), ref)
    dec = GraphDecoder(model, ids)
    first = dec.step(ref[:, 0])
    kept = first.clone()
    dec.step(ref[:, 1])
    assert torch.equal(first, kept)


def test_tokenizer_model_arg_given_as_a_directory_is_loaded(tmp_path):
    pytest.importorskip("lm_eval", reason="lm-eval is in the project's CPU environment (make venv)")
    from hmscale.data.tokenizer import train_bpe
    from hmscale.eval.lm_eval_adapter import HmscaleLM

    tok = train_bpe([f"def f{i}(x):\n    return x * {i}\n" for i in range(100)], 300)
    torch.manual_seed(0)
    model = GPTNeoXForCausalLM(neox_config("pythia-nano", vocab_size=len(tok))).eval()
    model.save_pretrained(tmp_path / "model")  # (a model directory without its tokenizer)
    tok.save_pretrained(tmp_path / "tok")
    lm = HmscaleLM.create_from_arg_string(f"pretrained={tmp_path / 'model'},tokenizer={tmp_path / 'tok'}",
                                          {"batch_size": 1, "device": "cpu"})
    (score, _), = lm.loglikelihood([_Req("def f1(x):", " return")], disable_tqdm=True)
    ids = tok("def f1(x): return", add_special_tokens=False)["input_ids"]
    n = len(tok(" return", add_special_tokens=False)["input_ids"])
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids[:-1]])).logits[0, -n:], -1)
    assert abs(score - logp.gather(-1, torch.tensor(ids[-n:])[:, None]).sum().item()) < 1e-4


def test_importing_the_adapter_leaves_lm_evals_own_models_registered():
    pytest.importorskip("lm_eval", reason="lm-eval is in the project's CPU environment (make venv)")
    import subprocess
    import sys

    code = ("import hmscale.eval.lm_eval_adapter\n"
            "from lm_eval.api.registry import get_model\n"
            "print(get_model('dummy').__name__, get_model('hmscale').__name__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["DummyLM", "HmscaleLM"]


def test_a_model_object_is_scored_on_its_own_device_unless_told():
    pytest.importorskip("lm_eval", reason="lm-eval is in the project's CPU environment (make venv)")
    from hmscale.eval.lm_eval_adapter import HmscaleLM

    # meta: the one device besides the CPU that a CPU machine has (a GPU model was moved to the CPU, in place)
    with torch.device("meta"):
        model = GPTNeoXForCausalLM(neox_config("pythia-nano", vocab_size=300))
    lm = HmscaleLM(model=model, tokenizer=object())
    assert lm._device == torch.device("meta") and next(model.parameters()).is_meta
    cpu_model = GPTNeoXForCausalLM(neox_config("pythia-nano", vocab_size=300))
    assert HmscaleLM(model=cpu_model, tokenizer=object(), device="cpu")._device == torch.device("cpu")


def test_a_max_length_below_one_is_refused_not_scored_as_zero():
    pytest.importorskip("lm_eval", reason="lm-eval is in the project's CPU environment (make venv)")
    from hmscale.eval.lm_eval_adapter import HmscaleLM

    model = GPTNeoXForCausalLM(neox_config("pythia-nano", vocab_size=300)).eval()
    for bad in (-3, 0, "abc", 2.5):  # (-3 scored every rolling loglikelihood 0.0; 0 failed inside range())
        with pytest.raises(ValueError, match=r"max_length=.*1 or more"):
            HmscaleLM(model=model, tokenizer=object(), max_length=bad)
    assert HmscaleLM(model=model, tokenizer=object(), max_length="16").max_length == 16
