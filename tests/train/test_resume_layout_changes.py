"""Resuming a stage across layout and lr changes, grad_norm logging, validation rows (stage 2 on CPU, gloo):

- resuming a stage from a checkpoint written with another ZeRO stage or another number of data-parallel workers
  ended in DeepSpeed's traceback (AttributeError, FileNotFoundError, AssertionError, ZeRORuntimeException); with
  another micro batch it went on silently from a data position that re-read rows: now one line;
- a resume with another stage lr trained at the checkpoint's lr, silently (the param groups and the LambdaLR's
  base_lrs came from the checkpoint); the config's lr and schedule now hold;
- ZeRO-0 in fp32 logged no grad_norm (DeepSpeed dropped the norm it clipped with);
- ZeRO-3's start event said trainable_params 0 (partitioned parameters);
- stage 2's validation loss skipped the last `max_sequences % dp` rows, so it depended on the number of workers.

Run as a script (`python THIS SPEC.json`, once per rank) it is the multi-process job of the last two tests.
"""

import json
import os
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

os.environ.setdefault("HMSCALE_NO_PROGRESS", "1")


def tiny_student(seed=0, vocab=96):
    from transformers import GPTNeoXForCausalLM

    from hmscale.models.convert import to_hedgehog
    from hmscale.teacher.flavors import neox_config

    torch.manual_seed(seed)
    teacher = GPTNeoXForCausalLM(neox_config("pythia-nano", vocab_size=vocab)).eval()
    return to_hedgehog(teacher)


def toks(n=48, L=32, vocab=96, seed=1):
    return np.random.default_rng(seed).integers(0, vocab, size=(n, L))


def _cfg(*extra):
    from hmscale.config import build_config

    return build_config({}, ["stage2.steps=6", "stage2.micro_batch_size=4", "stage2.warmup_steps=2", "stage2.lr=3e-3",
                             "parallel.checkpoint_every=3", "parallel.zero_stage=2", *extra])


def _stage2(cfg, run_dir, **kw):
    from hmscale.train.data import ArraySource
    from hmscale.train.stage2 import run_stage2

    return run_stage2(cfg, run_dir, student=tiny_student(), source=ArraySource(toks()), export=False, **kw)


@pytest.mark.parametrize("first, then, says", [
    (["parallel.zero_stage=2"], ["parallel.zero_stage=3"], "ZeRO 1-2 -> 3"),
    (["parallel.zero_stage=3"], ["parallel.zero_stage=2"], "ZeRO 3 -> 2"),
    (["parallel.zero_stage=2"], ["parallel.zero_stage=0"], "ZeRO 1-2 -> 0"),
    (["parallel.zero_stage=0"], ["parallel.zero_stage=1"], "ZeRO 0 -> 1"),
    ([], ["stage2.micro_batch_size=2"], "4 -> 2 rows per optimizer step"),
])
def test_resume_with_another_layout_is_one_line(tmp_path, first, then, says):
    from hmscale.train.engine import TrainingError

    _stage2(_cfg(*first), tmp_path, stop_at_step=3)
    with pytest.raises(TrainingError) as err:
        _stage2(_cfg(*then), tmp_path)
    msg = str(err.value)
    assert "\n" not in msg and says in msg and "step_00000003" in msg, msg


def test_resume_with_the_same_rows_per_step_and_zero_1_for_2_goes_on(tmp_path):
    full = _stage2(_cfg(), tmp_path / "full", resume=False)["losses"]
    part = _stage2(_cfg("parallel.zero_stage=1"), tmp_path / "cut", stop_at_step=3)["losses"]
    rest = _stage2(_cfg("stage2.micro_batch_size=2", "stage2.grad_accum=2"), tmp_path / "cut")
    assert rest["start_step"] == 3 and rest["done"]
    assert np.allclose(part + rest["losses"], full, rtol=1e-6, atol=0)


def test_resume_trains_at_the_configs_lr(tmp_path):
    from hmscale.train.engine import lr_multiplier, read_metrics

    _stage2(_cfg(), tmp_path, stop_at_step=3)
    _stage2(_cfg("stage2.lr=1e-2"), tmp_path)
    lrs = [r["lr"] for r in read_metrics(tmp_path / "stage2" / "metrics.jsonl")]
    want = [3e-3 * lr_multiplier(s, 2, 6, 0.1) for s in range(3)] + [1e-2 * lr_multiplier(s, 2, 6, 0.1) for s in range(3, 6)]
    assert np.allclose(lrs, want, rtol=1e-9), (lrs, want)


def test_zero0_logs_the_grad_norm_and_zero3_counts_its_parameters(tmp_path):
    from hmscale.train.engine import read_metrics

    norms, events = {}, {}
    for z in (0, 2, 3):
        _stage2(_cfg(f"parallel.zero_stage={z}", "stage2.steps=2"), tmp_path / f"z{z}", resume=False)
        path = tmp_path / f"z{z}" / "stage2" / "metrics.jsonl"
        norms[z] = [r.get("grad_norm") for r in read_metrics(path)]
        events[z] = read_metrics(path, kind="event")[0]["trainable_params"]
    assert None not in norms[0] and np.allclose(norms[0], norms[2], rtol=1e-5), norms
    assert events[3] == events[2] == events[0] > 0, events


def test_zero0_logs_the_grad_norm_without_clipping(tmp_path):
    """ZeRO 0 in fp32 with clipping off: DeepSpeed computes no norm there; it is logged all the same, equal to
    ZeRO 2's (which always computes it), and the run trains as ZeRO 2's does (nothing clipped)."""
    from hmscale.train.engine import read_metrics

    rows = {}
    for z in (0, 2):
        _stage2(_cfg(f"parallel.zero_stage={z}", "stage2.steps=2", "stage2.grad_clip=0"), tmp_path / f"z{z}",
                resume=False)
        rows[z] = read_metrics(tmp_path / f"z{z}" / "stage2" / "metrics.jsonl")
    norms = {z: [r.get("grad_norm") for r in rows[z]] for z in rows}
    assert None not in norms[0] and np.allclose(norms[0], norms[2], rtol=1e-5), norms
    assert np.allclose([r["loss"] for r in rows[0]], [r["loss"] for r in rows[2]], rtol=1e-5)


def _val_data(n=7):
    return types.SimpleNamespace(val_tokens=toks(n=n, seed=3))


def test_two_workers_validate_every_row_and_one_worker_refuses_their_checkpoint(launch_job, tmp_path):
    from hmscale.train.data import ArraySource
    from hmscale.train.engine import TrainingError
    from hmscale.train.stage2 import run_stage2

    common = ["stage2.steps=2", "stage2.warmup_steps=0", "stage2.lr=3e-3", "stage2.eval_every=100",
              "eval.max_sequences=5", "parallel.zero_stage=2"]
    one = run_stage2(_cfg(*common), tmp_path / "one", student=tiny_student(), source=ArraySource(toks()),
                     data=_val_data(), export=False, resume=False)
    out = launch_job({"overrides": common + ["stage2.micro_batch_size=2", "parallel.num_workers=2"],
                      "run_dir": str(tmp_path / "two"), "resume_dir": str(tmp_path / "cut")}, world=2,
                     job=Path(__file__))
    # the same rows per step: the same model; every one of the 5 validation rows counted (4 of them before)
    assert abs(out["val_loss"] - one["val_loss"]) < 1e-5, (out["val_loss"], one["val_loss"])
    # a 2-worker ZeRO-2 checkpoint (written by the job) resumed by one worker: one line, not DeepSpeed's traceback
    with pytest.raises(TrainingError, match=r"2 -> 1 data-parallel workers"):
        run_stage2(_cfg(*common, "stage2.micro_batch_size=2"), tmp_path / "cut", student=tiny_student(),
                   source=ArraySource(toks()), export=False)


def _job(spec_path):
    from hmscale.train.data import ArraySource
    from hmscale.train.stage2 import run_stage2

    torch.set_num_threads(1)
    spec = json.loads(Path(spec_path).read_text())
    cfg = _cfg(*spec["overrides"])
    out = run_stage2(cfg, spec["run_dir"], student=tiny_student(), source=ArraySource(toks()), data=_val_data(),
                     export=False, resume=False)
    run_stage2(_cfg(*spec["overrides"]), spec["resume_dir"], student=tiny_student(), source=ArraySource(toks()),
               export=False, stop_at_step=1)
    if int(os.environ["RANK"]) == 0:
        Path(spec["out"]).write_text(json.dumps({"val_loss": out["val_loss"]}))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    _job(sys.argv[1])
