"""`hmscale generate --temperature T` samples from the whole softmax: transformers' generate() keeps only the top 50
tokens unless told otherwise, which the command never did (and had no way to ask for). --top-k / --top-p truncate on
request; a temperature that is not finite is one line."""

import pytest
import torch

from hmscale.cli import main
from hmscale.eval.generation import generate_text, load_model_and_tokenizer, sampling_kwargs

from .test_generate_cli_errors import _one_line_error, _saved


def _sampled_ranks(model, ids, **kw):
    """Sample 40 tokens after ids with generate(); each one's rank among its step's logits (0 = the most likely)."""
    torch.manual_seed(0)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, min_new_tokens=40,
                         pad_token_id=0, **sampling_kwargs(**kw))
    with torch.no_grad():
        logits = model(out).logits[0]
    return [int((logits[t - 1] > logits[t - 1, out[0, t]]).sum()) for t in range(ids.shape[1], out.shape[1])]


def test_sampling_uses_the_whole_softmax_unless_truncated(tmp_path, capsys):
    m = _saved(tmp_path)
    model, tok = load_model_and_tokenizer(str(m), torch.device("cpu"), None)
    assert len(tok) > 200
    ids = tok("def f3(x):", return_tensors="pt", add_special_tokens=False)["input_ids"]
    # a very high temperature: nearly uniform over the vocabulary (> 200 tokens), so 40 draws from the whole softmax
    # reach past rank 100 almost surely (1 - (100 / 280)^40); transformers' default top-k of 50 never does (ranks are
    # recomputed by a full forward, whose last bits may reorder near-equal logits: hence the margins)
    assert max(_sampled_ranks(model, ids, temperature=1e4)) >= 100
    assert max(_sampled_ranks(model, ids, temperature=1e4, top_k=5)) < 10
    # top-k 1 is greedy, through the command's own path
    prompt = "def f3(x):"
    greedy, _ = generate_text(str(m), prompt, max_new_tokens=8)
    assert generate_text(str(m), prompt, max_new_tokens=8, temperature=3.0, seed=1, top_k=1)[0] == greedy

    assert main(["generate", str(m), "--max-new-tokens", "2", "--temperature", "inf"]) == 2
    _one_line_error(capsys, "temperature")


@pytest.mark.parametrize("kw", [{"temperature": float("nan")}, {"temperature": 1.0, "top_p": 0.0}, {"top_k": -1}])
def test_bad_sampling_settings_are_refused(kw):
    with pytest.raises(ValueError):
        sampling_kwargs(**kw)
