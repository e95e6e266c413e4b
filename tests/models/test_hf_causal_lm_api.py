"""Both students used the way a transformers user uses a causal LM: input checks, config.return_dict /
output_hidden_states, tied embeddings, the Trainer's gradient-accumulation loss contract, a left-padded prompt
decoded by hand with the cache, and generate() given a cache of the whole input."""

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, GPTNeoXForCausalLM

import hmscale.models  # noqa: F401  (registers the Auto classes)
from hmscale.models import HedgeMambaConfig, HedgeMambaForCausalLM
from hmscale.models.convert import to_hedgehog
from hmscale.teacher.flavors import neox_config

VOCAB = 97


def _hedgemamba(seed=0, **overrides):
    torch.manual_seed(seed)
    cfg = HedgeMambaConfig(**{**dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     rotary_pct=1.0), **overrides})
    model = HedgeMambaForCausalLM(cfg).eval()
    with torch.no_grad():  # away from the identity init: the state and the positions matter
        for name, p in model.named_parameters():
            if any(k in name for k in ("conv.", "dt_proj", "A_scale", "z_proj", "feature_map")):
                p.add_(0.2 * torch.randn_like(p))
        for layer in model.backbone.layers:
            layer.mixer.A_scale.abs_()
    return model


def _hedgehog():
    torch.manual_seed(0)
    return to_hedgehog(GPTNeoXForCausalLM(neox_config("pythia-nano", vocab_size=VOCAB)).eval()).eval()


def test_hedgehog_inputs_return_dict_and_no_cache():
    student = _hedgehog()
    ids = torch.randint(1, VOCAB, (2, 9))
    with pytest.raises(ValueError, match="exactly one of input_ids or inputs_embeds"):
        student()
    with pytest.raises(ValueError, match="exactly one of input_ids or inputs_embeds"):
        student(input_ids=ids, inputs_embeds=student.teacher.gpt_neox.embed_in(ids))
    with pytest.raises(ValueError, match="has no cache"):
        student(ids, use_cache=True)
    with torch.no_grad():
        want = student(ids).logits
        out = student(ids, return_dict=False)
        assert isinstance(out, tuple) and torch.equal(out[0], want)
        student.config.return_dict = False
        try:
            assert isinstance(student(ids), tuple)
            assert not isinstance(student(ids, return_dict=True), tuple)
        finally:
            student.config.return_dict = True


def test_hedgemamba_honours_config_return_dict_and_output_hidden_states():
    model = _hedgemamba()
    ids = torch.randint(1, VOCAB, (2, 7))
    with torch.no_grad():
        want = model(ids).logits
        model.config.return_dict = False
        out = model(ids)
        assert isinstance(out, tuple) and torch.equal(out[0], want)
        model.config.return_dict = True
        model.config.output_hidden_states = True
        hidden = model(ids).hidden_states
        assert hidden is not None and len(hidden) == model.config.num_hidden_layers + 1
        assert model(ids, output_hidden_states=False).hidden_states is None


def test_tie_word_embeddings(tmp_path):
    model = _hedgemamba(tie_word_embeddings=True)
    assert model.lm_head.weight is model.backbone.embed_in.weight
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.lm_head.weight is loaded.backbone.embed_in.weight
    ids = torch.randint(1, VOCAB, (2, 7))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    untied = _hedgemamba()
    assert untied.lm_head.weight is not untied.backbone.embed_in.weight


@pytest.mark.parametrize("which", ["hedgemamba", "hedgehog"])
def test_loss_with_num_items_in_batch_accumulates_to_the_full_batch_mean(which):
    """transformers' Trainer passes num_items_in_batch to a forward that takes **kwargs and then does not divide the
    loss by the accumulation steps: the micro-batch losses must add up to the full batch's mean."""
    model = _hedgemamba() if which == "hedgemamba" else _hedgehog()
    ids = torch.randint(1, VOCAB, (4, 10))
    labels = ids.clone()
    labels[0, :6] = -100
    n = int((labels[:, 1:] != -100).sum())
    with torch.no_grad():
        full = model(ids, labels=labels).loss
        parts = sum(model(ids[i:i + 2], labels=labels[i:i + 2], num_items_in_batch=torch.tensor(n)).loss for i in (0, 2))
        logits = model(ids).logits
    torch.testing.assert_close(parts, full, rtol=1e-5, atol=1e-6)
    manual = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=-100)
    torch.testing.assert_close(full, manual, rtol=1e-6, atol=1e-6)


def test_left_padded_prompt_then_cached_steps_match_each_row_alone():
    """A manual decode loop (prefill with the padded mask, then one token at a time with the grown mask and the
    cache): the padded row's positions keep counting its real tokens, as in generate()."""
    model = _hedgemamba()
    p1, p2 = torch.randint(1, VOCAB, (1, 10)), torch.randint(1, VOCAB, (1, 6))
    batch = torch.cat([p1, torch.cat([torch.zeros(1, 4, dtype=torch.long), p2], 1)])
    mask = torch.ones_like(batch)
    mask[1, :4] = 0
    new = torch.randint(1, VOCAB, (2, 3))
    with torch.no_grad():
        out = model(batch, attention_mask=mask, use_cache=True)
        steps = []
        for t in range(3):
            mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
            steps.append(model(new[:, t:t + 1], cache=out.cache, use_cache=True, attention_mask=mask).logits[:, -1])
        alone = [model(torch.cat([p, new[i:i + 1]], 1)).logits[0, -3:] for i, p in enumerate((p1, p2))]
    got = torch.stack(steps, 1)
    for i in range(2):
        torch.testing.assert_close(got[i], alone[i], rtol=1e-4, atol=1e-5)


def test_generate_with_a_cache_of_the_whole_input_is_one_line():
    model = _hedgemamba()
    ids = torch.randint(1, VOCAB, (2, 8))
    kw = dict(max_new_tokens=3, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        full = model(ids, use_cache=True).cache
        with pytest.raises(ValueError, match="the cache has consumed 8 tokens, the input has 8"):
            model.generate(ids, cache=full, **kw)
        part = model(ids[:, :-1], use_cache=True).cache  # what the message asks for
        assert torch.equal(model.generate(ids, cache=part, **kw), model.generate(ids, **kw))
