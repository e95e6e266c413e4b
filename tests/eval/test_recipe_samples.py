"""The recipe's greedy samples (``eval.generate_tokens``): each model's continuation of a held-out prompt, computed
by full forwards, equal to transformers' greedy ``generate`` (which HedgeMamba runs on its recurrent cache)."""

import torch
from transformers import GPTNeoXForCausalLM

from hmscale.eval.generation import greedy_continuation, recipe_samples
from hmscale.models.convert import to_hedgehog, to_hedgemamba
from hmscale.recipe import _sample_lines
from hmscale.teacher.flavors import neox_config


def _models(vocab=64):
    torch.manual_seed(0)
    teacher = GPTNeoXForCausalLM(neox_config("pythia-nano", vocab_size=vocab)).eval()
    hedgehog = to_hedgehog(teacher)
    mamba = to_hedgemamba(to_hedgehog(teacher)).eval()
    with torch.no_grad():  # away from the exact-copy initialisation: the students' own decoding
        for layer in mamba.backbone.layers:
            layer.mixer.A_scale.add_(0.3)
    return {"teacher": teacher, "hedgehog": hedgehog, "hedgemamba": mamba}


def test_greedy_continuation_is_generates_greedy_decoding():
    models = _models()
    ids = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(1))
    for name in ("teacher", "hedgemamba"):
        want = models[name].generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                                     do_sample=False, pad_token_id=0)[0, 9:].tolist()
        assert greedy_continuation(models[name], ids, 12) == want, name
    assert len(greedy_continuation(models["hedgehog"], ids, 5)) == 5


class _Tok:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(f"t{i}" for i in ids)


def test_recipe_samples_stay_within_the_training_length_and_land_in_the_report():
    models = _models()
    row = torch.randint(0, 64, (32,), generator=torch.Generator().manual_seed(2)).numpy()
    s = recipe_samples(models, _Tok(), row, new_tokens=100, seq_len=32)
    assert s["new_tokens"] == 32 - 8  # the prompt is a quarter of the row: 8 tokens, 24 left within 32
    assert s["prompt"] == " ".join(f"t{i}" for i in row[:8])
    assert set(s["continuations"]) == set(models) and all(len(t.split()) == 24 for t in s["continuations"].values())
    s["continuations"]["teacher"] = "code ``` fence"
    lines = _sample_lines({"samples": s})
    text = "\n".join(lines)
    assert "HedgeMamba (stage 2):" in text
    # (the 100 asked for were cut to 24: the report said "24 tokens, `eval.generate_tokens`", as if the setting were 24)
    assert "Greedy continuations (24 tokens: `eval.generate_tokens` 100, kept within the training rows" in text
    s2 = recipe_samples(models, _Tok(), row, new_tokens=5, seq_len=32)
    assert "Greedy continuations (5 tokens, `eval.generate_tokens`) of" in "\n".join(_sample_lines({"samples": s2}))
    assert text.count("```") == 2 * 4  # prompt and three models, each fenced once; a fence inside is broken up


def test_evaluating_an_unfinished_run_says_it_has_not_finished(tmp_path):
    import pytest

    from hmscale.config import build_config
    from hmscale.recipe import RecipeError, evaluate_run

    cfg = build_config({}, [f"output_dir={tmp_path}"])
    with pytest.raises(RecipeError, match="holds no run"):
        evaluate_run(cfg)
    (tmp_path / "stage1").mkdir()  # killed during (or after) stage 1
    with pytest.raises(RecipeError, match="has not finished; rerun `hmscale run`"):
        evaluate_run(cfg)
