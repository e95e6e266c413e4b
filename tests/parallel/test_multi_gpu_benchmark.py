"""benchmarks/multi_gpu.py --smoke: the scaling benchmark's paths on CPU (2 gloo processes through
`spawn_workers` and `run_stage2`; 2 cache worker processes). dp and tp=2 train on the same global batch,
so their fp32 losses must equal the one-process run's."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def test_multi_gpu_benchmark_smoke(tmp_path):
    out = tmp_path / "mg.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "multi_gpu.py"), "--smoke", "--runs", "1gpu,dp,tp2",
                           "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    summary = res["train"]["summary"]
    assert summary["loss_diff_dp"] <= 1e-6 and summary["loss_diff_tp2"] <= 1e-5, summary
    runs = res["train"]["runs"]
    assert (runs["dp"]["dp"], runs["tp2"]["tp"], runs["tp2"]["micro_batch"]) == (2, 2, 2 * runs["1gpu"]["micro_batch"])
    assert all(len(r["losses"]) == 4 for r in runs.values())
    assert res["cache"]["full"]["2"]["verified"] and res["cache"]["full"]["2"]["devices"] == ["cpu", "cpu"]
    assert res["comm"][0]["bus_gb_s"] > 0
