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


def test_training_overrides_build_valid_configs(tmp_path):
    """Each configuration's overrides make a config the product accepts: a DeepSpeed file when given, ZeRO-0
    for CUDA-graph runs (the config refuses graphs with ZeRO 1-3)."""
    import runpy

    from hmscale.config import build_config

    overrides = runpy.run_path(str(REPO / "benchmarks" / "multi_gpu.py"))["training_overrides"]
    run = dict(gpu=True, bf16=True, tp=1, micro_batch=8, grad_accum=1, steps=20)
    ds = tmp_path / "z2.json"
    ds.write_text("{}")
    cfg = build_config({}, overrides(dict(run, ds_config=str(ds)), 2, str(tmp_path)))
    assert cfg.parallel.ds_config == str(ds) and cfg.parallel.zero_stage == 2 and not cfg.parallel.cuda_graphs
    cfg = build_config({}, overrides(dict(run, cuda_graphs=True), 2, str(tmp_path)))
    assert cfg.parallel.cuda_graphs and cfg.parallel.zero_stage == 0 and cfg.parallel.ds_config is None
    cfg = build_config({}, overrides(dict(run, tp=2, cuda_graphs=True, compile=True), 2, str(tmp_path)))
    assert cfg.parallel.compile and cfg.parallel.tp == 2 and not cfg.parallel.cuda_graphs
