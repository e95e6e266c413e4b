"""tp=2 x dp=1 trains stage 2 exactly like tp=1 (fp32, 5 steps); unsupported tp x ZeRO-3 is a clear error."""

import pytest

from hmscale.config import ConfigError, build_config

pytestmark = pytest.mark.slow


def rel_err(a, b):
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def test_tp2_equals_tp1_with_and_without_online_kd(launch_job, tmp_path, monkeypatch):
    """Both runs in one launch per layout (process start-up is most of their time; tp=1 runs in this process): plain
    stage 2, 5 steps, with the
    tp run's HF export; and the vocabulary-parallel LM head's KD path end to end, online KD from the live teacher's
    logits at temperature 2 with a reduced CE weight, 4 steps. tp=2 x dp=1 against tp=1, fp32."""
    base = ["stage2.micro_batch_size=4", "stage2.lr=3e-3", "parallel.checkpoint_every=100", "parallel.zero_stage=1"]
    plain = base + ["stage2.steps=5", "stage2.warmup_steps=2"]
    kd = base + ["stage2.steps=4", "stage2.warmup_steps=1", "stage2.kd_source=online", "stage2.kd_weight=2",
                 "stage2.kd_temperature=2", "stage2.ce_weight=0.5"]
    tp2 = ["parallel.tp=2", "parallel.num_workers=2"]
    # tp=1: dist_job's runs in this process (its one-process group), as a one-rank launch runs them
    from tests.train.dist_job import run_one

    monkeypatch.setenv("HMSCALE_NO_PROGRESS", "1")
    ref, ref_kd = (run_one({"overrides": plain, "run_dir": str(tmp_path / "tp1")}),
                   run_one({"overrides": kd, "run_dir": str(tmp_path / "tp1_kd")}))
    got, got_kd = launch_job({"runs": [{"overrides": plain + tp2, "run_dir": str(tmp_path / "tp2"), "export": True},
                                       {"overrides": kd + tp2, "run_dir": str(tmp_path / "tp2_kd")}]}, world=2)
    assert len(ref) == len(got) == 5
    assert rel_err(got, ref) <= 1e-5, ("plain", ref, got)
    assert len(ref_kd) == len(got_kd) == 4
    assert rel_err(got_kd, ref_kd) <= 1e-5, ("online KD", ref_kd, got_kd)
    assert len(set(ref_kd)) == 4  # the loss moves: not a constant that would match trivially
    # the tp run exports one full (unsharded) HF model
    import torch
    from transformers import AutoModelForCausalLM

    import hmscale.models  # noqa: F401  (registers HedgeMamba)

    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "tp2" / "stage2" / "hf"))
    out = model(input_ids=torch.zeros(1, 8, dtype=torch.long))
    assert out.logits.shape == (1, 8, model.config.vocab_size)


def test_tp_with_zero3_is_a_clear_error():
    with pytest.raises(ConfigError, match="zero_stage"):
        build_config({}, ["parallel.tp=2", "parallel.num_workers=2", "parallel.zero_stage=3", "teacher.flavor=pythia-nano"])
