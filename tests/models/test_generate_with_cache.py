"""A recurrent cache continued by an input of another batch size (generate's own expansion
for num_return_sequences / num_beams included), and the backbone's return_dict / output_hidden_states."""

import pytest
import torch

from ._helpers import perturbed_hedgemamba

VOCAB = 97
NO_EOS = dict(pad_token_id=0, eos_token_id=None)


def _ids(rows, length, seed=0):
    return torch.randint(1, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))


def test_a_cache_of_another_batch_is_a_one_line_error():
    model = perturbed_hedgemamba(VOCAB)
    ids = _ids(3, 9)
    with torch.no_grad():
        cache = model(ids[:2, :5], use_cache=True).cache
        with pytest.raises(ValueError, match=r"holds the state of 2 row\(s\), the input has 1.*batch_select_indices"):
            model(ids[:1, 5:], cache=cache)
        with pytest.raises(ValueError, match=r"holds the state of 2 row\(s\), the input has 3"):
            model.generate(ids, cache=cache, max_new_tokens=2, do_sample=False, **NO_EOS)
        one = model(ids[:1, :5], use_cache=True).cache
        with pytest.raises(ValueError, match=r"batch_repeat_interleave\(3\)"):
            model(ids[:, 5:], cache=one)


def test_generate_repeats_a_prefilled_cache_as_it_repeats_the_input():
    model = perturbed_hedgemamba(VOCAB)
    ids = _ids(2, 8, seed=1)
    with torch.no_grad():
        for kw in (dict(num_beams=3, do_sample=False), dict(num_return_sequences=2, do_sample=True, top_k=0)):
            torch.manual_seed(0)
            ref = model.generate(ids, max_new_tokens=5, **kw, **NO_EOS)
            cache = model(ids[:, :-1], use_cache=True).cache
            torch.manual_seed(0)
            got = model.generate(ids, cache=cache, max_new_tokens=5, **kw, **NO_EOS)
            assert torch.equal(got, ref), kw


def test_a_one_row_prompt_cache_serves_a_batch_sharing_its_prefix():
    model = perturbed_hedgemamba(VOCAB)
    shared, tails = _ids(1, 6, seed=2), _ids(3, 4, seed=3)
    ids = torch.cat([shared.expand(3, -1), tails], 1)
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=5, do_sample=False, **NO_EOS)
        got = model.generate(ids, cache=model(shared, use_cache=True).cache, max_new_tokens=5, do_sample=False,
                             **NO_EOS)
    assert torch.equal(got, ref)


def test_the_backbone_honours_return_dict_and_output_hidden_states(tmp_path):
    from transformers import AutoModel

    model = perturbed_hedgemamba(VOCAB)
    model.save_pretrained(tmp_path)
    ids = _ids(2, 7, seed=4)
    with torch.no_grad():
        want = model.backbone(ids).last_hidden_state
        backbone = AutoModel.from_pretrained(tmp_path, output_hidden_states=True).eval()
        hidden = backbone(ids).hidden_states
        assert hidden is not None and len(hidden) == model.config.num_hidden_layers + 1
        torch.testing.assert_close(hidden[-1], want)
        out = backbone(ids, return_dict=False, output_hidden_states=False)
        assert isinstance(out, tuple) and len(out) == 1 and torch.equal(out[0], want)
        backbone.config.return_dict = False
        assert isinstance(backbone(ids), tuple)
        model.config.return_dict = False  # (the causal LM's own forward still reads its backbone's output)
        assert torch.equal(model(ids)[0], model.lm_head(want))


def _as_transformers_5_17(monkeypatch):
    """transformers 5.17's naming (the GPU image's): generate() carries and beam search reorders only caches named in
    ALL_CACHE_NAMES, which holds no "cache", and reads no output named "cache"."""
    from transformers import GenerationMixin
    from transformers.generation import utils

    monkeypatch.setattr(utils, "ALL_CACHE_NAMES", ["past_key_values", "cache_params", "state", "mems",
                                                   "past_buckets_states"])
    update = GenerationMixin._update_model_kwargs_for_generation

    def update_5_17(self, outputs, model_kwargs, *args, **kwargs):
        passed_in = "cache" in model_kwargs
        model_kwargs = update(self, outputs, model_kwargs, *args, **kwargs)
        if not passed_in:
            model_kwargs.pop("cache", None)
        return model_kwargs

    monkeypatch.setattr(GenerationMixin, "_update_model_kwargs_for_generation", update_5_17)


def test_generate_carries_the_state_under_an_older_transformers_cache_name(monkeypatch):
    model = perturbed_hedgemamba(VOCAB)
    ids = _ids(2, 9, seed=5)
    with torch.no_grad():
        ref_greedy = model.generate(ids, max_new_tokens=5, do_sample=False, use_cache=False, **NO_EOS)
        ref_beams = model.generate(ids, max_new_tokens=5, num_beams=3, use_cache=False, **NO_EOS)
    _as_transformers_5_17(monkeypatch)
    lengths = []
    forward = model.backbone.forward

    def spy(*args, **kwargs):
        lengths.append(kwargs["input_ids"].shape[1])
        return forward(*args, **kwargs)

    monkeypatch.setattr(model.backbone, "forward", spy)
    with torch.no_grad():
        assert torch.equal(model.generate(ids, max_new_tokens=5, do_sample=False, **NO_EOS), ref_greedy)
        assert lengths == [9, 1, 1, 1, 1]  # (the whole sequence every step: 9, 10, 11, 12, 13)
        assert torch.equal(model.generate(ids, max_new_tokens=5, num_beams=3, **NO_EOS), ref_beams)
        cache = model(ids[:, :-1], use_cache=True).cache
        assert torch.equal(model.generate(ids, cache=cache, max_new_tokens=5, num_beams=3, **NO_EOS), ref_beams)
