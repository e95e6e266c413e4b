"""A NaN loss on one data-parallel worker only. Every worker stops (they agree on
finiteness), but the line the user reads is rank 0's (the driver raises the error rank 0 recorded, under Ray and the
local engine alike), and it named rank 0's own, finite loss as the reason: "loss is 4.83 at step 5".

This file is also the job each worker runs (`python test_nan_on_one_rank.py SPEC.json`)."""

import json
import os
import sys
from pathlib import Path

import pytest


def _job(spec_path: str) -> None:
    import numpy as np
    import torch

    from hmscale.config import build_config
    from hmscale.train.data import ArraySource
    from hmscale.train.engine import NonFiniteLoss
    from hmscale.train.stage2 import run_stage2

    from tests.train.test_engine_resume import PoisonedLM  # logits NaN on its bad_call-th forward (None: never)

    spec = json.loads(Path(spec_path).read_text())
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    tokens = np.random.default_rng(1).integers(0, 96, size=(48, 32))
    try:  # rank 1's loss turns NaN at step 5 (its 6th forward), rank 0's stays finite
        run_stage2(build_config({}, spec["overrides"]), spec["run_dir"],
                   model=PoisonedLM(bad_call=6 if rank == 1 else None), source=ArraySource(tokens), export=False)
        msg = None
    except NonFiniteLoss as err:
        msg = str(err)
    Path(f"{spec['out']}.{rank}").write_text(json.dumps(msg))
    if rank == 0:
        Path(spec["out"]).write_text(json.dumps(msg))


pytestmark = pytest.mark.slow


def test_a_nan_on_one_worker_is_named_in_rank_0s_line(launch_job, tmp_path):
    overrides = ["stage2.steps=8", "stage2.micro_batch_size=2", "parallel.checkpoint_every=2",
                 "parallel.num_workers=2", "parallel.zero_stage=2"]
    msg0 = launch_job({"overrides": overrides, "run_dir": str(tmp_path / "run")}, world=2, job=Path(__file__))
    msg1 = json.loads((tmp_path / "losses.json.1").read_text())
    for msg in (msg0, msg1):  # both workers stopped at the same step, naming the same last good checkpoint
        assert msg is not None and "\n" not in msg, msg
        assert "stage2: loss is nan at step 5 (micro batch 0" in msg, msg
        assert "1 of 2 workers" in msg and "step_00000004" in msg, msg


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    os.environ.setdefault("HMSCALE_NO_PROGRESS", "1")
    _job(sys.argv[1])
