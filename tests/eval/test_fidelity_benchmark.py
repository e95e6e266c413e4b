"""benchmarks/fidelity.py --smoke: the whole benchmark's plumbing on CPU (a tiny teacher pretrained on the
spot, every ablation distilled through the recipe code, the shared stage 1, the results file)."""

import json
import math
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_fidelity_smoke(tmp_path):
    out = tmp_path / "fid"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "fidelity.py"), "--smoke", "--out", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    res = json.loads((out / "fidelity.json").read_text())
    names = {"teacher", "hedgemamba", "split_0_100", "split_100_0", "no_gate", "hedgehog", "stage1_only"}
    assert set(res["results"]) == names
    assert all(math.isfinite(r["ppl"]) and r["ppl"] > 1 for r in res["results"].values())
    assert set(res["checks"]) == {"hedgemamba/teacher <= 1.03", "10/90 beats 0/100 and 100/0", "the gate helps",
                                  "Hedgehog-only is worse than HedgeMamba"}
    assert "stage 1 shared with hedgemamba" in proc.stdout  # no_gate and hedgehog reuse the 10/90 stage 1
    assert "| HedgeMamba, split 10/90 |" in proc.stdout
