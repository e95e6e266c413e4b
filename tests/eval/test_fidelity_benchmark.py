"""benchmarks/fidelity.py --smoke: the whole benchmark's plumbing on CPU (a tiny teacher pretrained on the
spot, every ablation distilled through the recipe code, the shared stage 1, the results file)."""

import json
import math
import sys
from pathlib import Path

from tests.forked_python import run_python

REPO = Path(__file__).resolve().parents[2]


def test_fidelity_smoke(tmp_path):
    """The tuned recipe's mixer transfer: each ablation whose mixer differs (no gate, Hedgehog only) aligns its
    own mixer in stage 1, so none of them may reuse the 10/90 run's stage 1."""
    out = tmp_path / "fid"
    proc = run_python([REPO / "benchmarks" / "fidelity.py", "--smoke", "--out", str(out)],
                    cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    res = json.loads((out / "fidelity.json").read_text())
    names = {"teacher", "hedgemamba", "split_0_100", "split_100_0", "no_gate", "hedgehog", "stage1_only"}
    assert set(res["results"]) == names
    assert all(math.isfinite(r["ppl"]) and r["ppl"] > 1 for r in res["results"].values())
    assert set(res["checks"]) == {"hedgemamba/teacher <= 1.03", "10/90 beats 0/100 and 100/0", "the gate helps",
                                  "Hedgehog-only is worse than HedgeMamba"}
    assert "stage 1 shared" not in proc.stdout
    assert "| HedgeMamba, split 10/90 |" in proc.stdout


def test_fidelity_attention_transfer_shares_stage1(tmp_path):
    """With the paper's attention transfer stage 1 trains only the feature maps, so the ablations that differ
    only in stage 2 (no gate, Hedgehog only) reuse the 10/90 run's stage 1."""
    out = tmp_path / "fid"
    proc = run_python([REPO / "benchmarks" / "fidelity.py", "--smoke", "--out", str(out),
                           "--only", "hedgemamba", "no_gate", "hedgehog", "-s", "stage1.transfer=attention"],
                    cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "no_gate: stage 1 shared with hedgemamba" in proc.stdout
    assert "hedgehog: stage 1 shared with hedgemamba" in proc.stdout


def test_variants_parse_list_values():
    sys.path.insert(0, str(REPO / "benchmarks"))
    import argparse

    import fidelity

    got = fidelity.ablations(argparse.Namespace(variants=["z:budget.split=[0.0,1.0],stage2.epochs=2", "e1:stage2.epochs=1"]))
    assert got["z"] == ["budget.split=[0.0,1.0]", "stage2.epochs=2"] and got["e1"] == ["stage2.epochs=1"]
    assert set(fidelity.ABLATIONS) < set(got)
    for bad in (["hedgemamba:stage2.epochs=1"], ["noequals"], [":stage2.epochs=1"]):
        try:
            fidelity.ablations(argparse.Namespace(variants=bad))
        except SystemExit as e:
            assert "--variant" in str(e)
        else:
            raise AssertionError(f"{bad} was accepted")


def test_fidelity_jobs_run_ablations_in_their_own_processes(tmp_path):
    """--jobs: each ablation (here the 10/90 run and one variant) in a child process, results gathered."""
    out = tmp_path / "fid"
    proc = run_python([REPO / "benchmarks" / "fidelity.py", "--smoke", "--out", str(out),
                           "--jobs", "2", "--only", "hedgemamba", "e1", "--variant", "e1:stage2.epochs=1",
                           "--context-length", "256"],
                    cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    res = json.loads((out / "fidelity.json").read_text())["results"]
    assert {"teacher", "hedgemamba", "e1", "stage1_only"} == set(res)
    assert res["hedgemamba"]["ppl"] != res["e1"]["ppl"]  # the tuned recipe's two stage-2 passes vs one
    for name in ("hedgemamba", "e1"):
        assert (out / name / "fidelity_result.json").exists() and (out / name / "fidelity.log").exists()
    assert "| HedgeMamba 10/90, variant e1: stage2.epochs=1 |" in proc.stdout
    # --context-length: every model per position bucket, the children's included
    for name in ("teacher", "hedgemamba", "e1"):
        lc = res[name]["long_context"]
        assert lc["buckets"] == [[1, 64], [64, 128], [128, 256]] and all(p > 1 for p in lc["ppl"])
    assert "| model | 1-63 | 64-127 * | 128-255 * |" in proc.stdout
