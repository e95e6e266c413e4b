"""Training-engine resume paths with bf16 ZeRO checkpoints: reading their layout, stage-2 losses after a resume."""

import os

import numpy as np
import pytest
import torch

from hmscale.config import build_config
from hmscale.train.data import ArraySource
from hmscale.train.engine import TrainingError, read_metrics

os.environ.setdefault("HMSCALE_NO_PROGRESS", "1")


def _rel_err(a, b):
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def _student(seed=0, vocab=96):
    from transformers import GPTNeoXForCausalLM

    from hmscale.models.convert import to_hedgehog
    from hmscale.teacher.flavors import neox_config

    torch.manual_seed(seed)
    return to_hedgehog(GPTNeoXForCausalLM(neox_config("pythia-nano", vocab_size=vocab)).eval())


def _toks(n=48, L=32, vocab=96):
    return np.random.default_rng(1).integers(0, vocab, size=(n, L))


# ---------------------------------------------------------------- bf16 with ZeRO 1 / 2


def test_checkpoint_layout_reads_bf16_zero_files(tmp_path):
    """With bf16 on, DeepSpeed names the ZeRO 1/2 optimizer partitions ``bf16_zero_pp_rank_<dp>_mp_rank_<mp>_optim_states.pt``
    (``engine._get_zero_ckpt_prefix``): such a checkpoint is a ZeRO 1-2 one over that many data-parallel ranks, not a
    ZeRO 0 one (every bf16 ZeRO 1/2 resume was refused as 'ZeRO 0 -> 2')."""
    from hmscale.train.engine import Checkpointer, checkpoint_layout

    state = tmp_path / "step_00000002" / "state"
    state.mkdir(parents=True)
    (state / "mp_rank_00_model_states.pt").write_bytes(b"x")
    for dp in range(2):
        (state / f"bf16_zero_pp_rank_{dp}_mp_rank_00_optim_states.pt").write_bytes(b"x")
    assert checkpoint_layout(state.parent) == {"zero": 1, "dp": 2, "mp": 1}
    Checkpointer.check_layout(state.parent, "stage2", zero_stage=2, dp=2, mp=1, samples_per_step=8)
    with pytest.raises(TrainingError, match=r"2 -> 1 data-parallel workers"):
        Checkpointer.check_layout(state.parent, "stage2", zero_stage=2, dp=1, mp=1, samples_per_step=8)
    with pytest.raises(TrainingError, match=r"ZeRO 1-2 -> 0"):
        Checkpointer.check_layout(state.parent, "stage2", zero_stage=0, dp=2, mp=1, samples_per_step=8)


@pytest.mark.parametrize("zero", [1, 2])
def test_bf16_zero12_stage2_resumes_with_the_uninterrupted_losses(tmp_path, zero):
    """parallel.bf16=true with ZeRO 1 or 2 (what a GPU run uses): a stopped stage 2 resumes from its checkpoint (it was
    refused in one line, 'written with another layout (ZeRO 0 -> 2)', so no bf16 run could ever resume) and trains
    the uninterrupted run's losses (on the CPU the bf16 steps are deterministic: the same numbers)."""
    from hmscale.train.stage2 import run_stage2

    cfg = build_config({}, ["stage2.steps=4", "stage2.micro_batch_size=2", "stage2.grad_accum=2",
                            "stage2.warmup_steps=1", "stage2.lr=3e-3", "parallel.checkpoint_every=2",
                            f"parallel.zero_stage={zero}", "parallel.bf16=true"])
    full = run_stage2(cfg, tmp_path / "full", student=_student(), source=ArraySource(_toks()), resume=False,
                      export=False)
    part = run_stage2(cfg, tmp_path / "cut", student=_student(), source=ArraySource(_toks()), stop_at_step=2,
                      export=False)
    rest = run_stage2(cfg, tmp_path / "cut", student=_student(seed=5), source=ArraySource(_toks()), export=False)
    assert rest["start_step"] == 2 and rest["done"]
    assert _rel_err(part["losses"] + rest["losses"], full["losses"]) <= 1e-6
    assert [r["step"] for r in read_metrics(tmp_path / "cut" / "stage2" / "metrics.jsonl")] == [0, 1, 2, 3]
