"""ZeRO 1, 2, 3 and 3+offload (2 data-parallel workers, fp32) give the same stage-2 losses for 10 steps."""

import pytest



def rel_err(a, b):
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))

pytestmark = pytest.mark.slow


def test_zero_stages_match(launch_job, tmp_path):
    common = ["stage2.steps=10", "stage2.micro_batch_size=2", "stage2.grad_accum=2", "stage2.warmup_steps=3",
              "stage2.lr=3e-3", "parallel.checkpoint_every=100", "parallel.num_workers=2"]
    runs = [{"overrides": common + [f"parallel.zero_stage={z}"], "run_dir": str(tmp_path / f"z{z}")} for z in (1, 2, 3)]
    runs.append({"overrides": common + ["parallel.zero_stage=3", "parallel.ds_config=ds_configs/zero3_offload.json"],
                 "run_dir": str(tmp_path / "z3off")})
    losses = launch_job({"runs": runs}, world=2)
    z1, z2, z3, z3off = losses
    assert len(z1) == 10
    assert rel_err(z2, z1) <= 1e-4, (z1, z2)
    assert rel_err(z3, z1) <= 1e-4, (z1, z3)
    assert rel_err(z3off, z1) <= 1e-4, (z1, z3off)  # ZeRO-3 with CPU offload of params and optimizer
    assert z1[-1] < z1[0]  # it trains
