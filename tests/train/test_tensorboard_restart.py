"""metrics.jsonl and TensorBoard tell the same story after a restart (world 1, CPU, fp32)."""

import os

import numpy as np
import pytest
import torch

from hmscale.config import build_config
from hmscale.train.data import ArraySource
from hmscale.train.engine import read_metrics

os.environ.setdefault("HMSCALE_NO_PROGRESS", "1")


def _student(seed=0, vocab=96):
    from transformers import GPTNeoXForCausalLM

    from hmscale.models.convert import to_hedgehog
    from hmscale.teacher.flavors import neox_config

    torch.manual_seed(seed)
    return to_hedgehog(GPTNeoXForCausalLM(neox_config("pythia-nano", vocab_size=vocab)).eval())


def _tb_scalars(tb_dir, tag):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    acc = event_accumulator.EventAccumulator(str(tb_dir), size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_a_stage_started_over_shows_only_its_own_steps_in_tensorboard(tmp_path):
    """An attempt interrupted before its first checkpoint leaves nothing to resume: the rerun starts the stage over,
    and metrics.jsonl starts over with it. TensorBoard kept the first attempt's event file, so its steps showed
    twice (the loss curve of steps 0-1 drawn once per attempt) next to a metrics.jsonl that has them once."""
    from hmscale.train.stage2 import run_stage2

    cfg = build_config({}, ["stage2.steps=4", "stage2.micro_batch_size=2", "stage2.warmup_steps=1",
                            "parallel.checkpoint_every=100", "parallel.zero_stage=2"])
    toks = np.random.default_rng(1).integers(0, 96, size=(24, 32))

    def interrupt(step):
        if step == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_stage2(cfg, tmp_path, student=_student(), source=ArraySource(toks), export=False, fault_hook=interrupt)
    res = run_stage2(cfg, tmp_path, student=_student(), source=ArraySource(toks), export=False)
    assert res["start_step"] == 0 and res["done"]
    logged = [(r["step"], r["loss"]) for r in read_metrics(tmp_path / "stage2" / "metrics.jsonl")]
    assert [s for s, _ in logged] == [0, 1, 2, 3]
    shown = _tb_scalars(tmp_path / "stage2" / "tb", "stage2/train/loss")
    assert [s for s, _ in shown] == [0, 1, 2, 3], shown
    np.testing.assert_allclose([v for _, v in shown], [v for _, v in logged], rtol=1e-6)
