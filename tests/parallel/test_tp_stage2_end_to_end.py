"""Tensor parallelism (parallel.tp) end to end on CPU with gloo: stage 2 at tp=2 against
tp=1 on the same rows, through tests/train/dist_job.py (one process per rank, as the train tests launch them).

Found on the walk (each test failed before its fix):
- the start event's ``trainable_params`` at tp=2 counted rank 0's shards only (60,048 of the tiny student's 119,200);
- with bf16 and ZeRO-0 (DeepSpeed's unfused bf16 optimizer) the clipping norm at tp=2 left tp rank 1's shards out
  (1.24 instead of tp=1's 1.54), so the clipping scaled the gradients differently from one GPU.
Also kept here: the tp=2 run's HF export loads with ``from_pretrained`` and gives tp=1's logits.
"""

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
JOB = REPO / "tests" / "train" / "dist_job.py"

# slow; the tests sharing the `runs` fixture stay on one xdist worker (`make test`): else each worker would launch them
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("tp_stage2_runs")]


def _launch(runs: list, world: int, tmp: Path, timeout: int = 120) -> list:
    from tests.train.conftest import launch  # (one process per rank)

    tmp.mkdir(parents=True, exist_ok=True)
    return launch({"runs": runs}, world, tmp, timeout=timeout, job=JOB)


def _metrics(run_dir: Path, kind: str) -> list:
    from hmscale.train.engine import read_metrics

    return read_metrics(run_dir / "stage2" / "metrics.jsonl", kind=kind)


BF16_ZERO0 = ["stage2.steps=2", "stage2.micro_batch_size=4", "stage2.warmup_steps=1", "stage2.lr=3e-3",
              "stage2.grad_clip=0.05", "parallel.bf16=true", "parallel.zero_stage=0", "parallel.checkpoint_every=100"]
FP32_ZERO1 = ["stage2.steps=3", "stage2.micro_batch_size=4", "stage2.warmup_steps=1", "stage2.lr=3e-3",
              "stage2.grad_clip=0.05", "parallel.zero_stage=1", "parallel.checkpoint_every=100"]
TP2 = ["parallel.tp=2", "parallel.num_workers=2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """tp=1 and tp=2 (one launch each): a bf16 ZeRO-0 run with clipping, and an fp32 ZeRO-1 run with its HF export."""
    root = tmp_path_factory.mktemp("tp_stage2")
    out = {}
    for tp, world, extra in (("tp1", 1, []), ("tp2", 2, TP2)):
        d = root / tp
        losses = _launch([{"overrides": BF16_ZERO0 + extra, "run_dir": str(d / "bf16")},
                          {"overrides": FP32_ZERO1 + extra, "run_dir": str(d / "fp32"), "export": True}], world, d / "job")
        out[tp] = {"dir": d, "losses": losses}
    return out


def test_start_event_counts_each_parameter_once_at_tp2(runs):
    """metrics.jsonl's start event: the whole model's trainable parameters, not rank 0's tensor-parallel shards."""
    for name in ("bf16", "fp32"):
        ref = _metrics(runs["tp1"]["dir"] / name, "event")[0]
        got = _metrics(runs["tp2"]["dir"] / name, "event")[0]
        assert got["tp"] == 2 and ref["tp"] == 1
        assert got["trainable_params"] == ref["trainable_params"], (got, ref)
        assert got["frozen_params"] == ref["frozen_params"]


def test_bf16_zero0_clipping_norm_at_tp2_equals_tp1(runs):
    """ZeRO-0 with bf16 (DeepSpeed's unfused optimizer): the global gradient norm, which decides the clipping, counts
    both ranks' shards (bf16 rounding apart, tp=1's norm; it read 1.24 for 1.54)."""
    ref = [r["grad_norm"] for r in _metrics(runs["tp1"]["dir"] / "bf16", "train")]
    got = [r["grad_norm"] for r in _metrics(runs["tp2"]["dir"] / "bf16", "train")]
    assert len(ref) == len(got) == 2
    assert ref[0] > 0.5  # the norm is well above grad_clip=0.05: the clipping acts
    for a, b in zip(got, ref):
        assert abs(a - b) <= 2e-3 * b, (got, ref)


def test_tp2_fp32_losses_norms_and_export_equal_tp1(runs):
    """fp32 ZeRO-1 with clipping: the same losses and norms step for step, and the gathered HF export of the tp=2 run
    loads with from_pretrained and gives the tp=1 export's logits."""
    import torch
    from transformers import AutoModelForCausalLM

    import hmscale.models  # noqa: F401  (registers HedgeMamba)

    ref_l, got_l = runs["tp1"]["losses"][1], runs["tp2"]["losses"][1]
    assert len(ref_l) == len(got_l) == 3
    assert max(abs(a - b) / b for a, b in zip(got_l, ref_l)) <= 1e-5, (got_l, ref_l)
    ref_n = [r["grad_norm"] for r in _metrics(runs["tp1"]["dir"] / "fp32", "train")]
    got_n = [r["grad_norm"] for r in _metrics(runs["tp2"]["dir"] / "fp32", "train")]
    assert max(abs(a - b) / b for a, b in zip(got_n, ref_n)) <= 1e-5, (got_n, ref_n)
    models = [AutoModelForCausalLM.from_pretrained(str(runs[tp]["dir"] / "fp32" / "stage2" / "hf")).eval()
              for tp in ("tp1", "tp2")]
    ids = torch.randint(0, models[0].config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref, got = (m(input_ids=ids).logits for m in models)
    assert got.shape == (2, 24, models[0].config.vocab_size)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
