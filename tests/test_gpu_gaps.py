"""benchmarks/gpu_gaps.py: the GPU's idle gaps in a chrome trace and the host events charged with them."""

import gzip
import json
import runpy
from pathlib import Path

import pytest

GAPS = runpy.run_path(str(Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_gaps.py"))


def _trace():
    """Device: kernels on two streams [0,10] and [5,20] (merged), a memcpy [30,40], a kernel [100,110]; idle
    [20,30] and [40,100]. Host: a step range [0,120] over a forward frame [15,35] and a hook frame [38,105]."""
    k = lambda ts, dur, cat="kernel": {"ph": "X", "cat": cat, "name": "k", "ts": ts, "dur": dur}
    h = lambda name, ts, dur, cat: {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}
    return [k(0, 10), k(5, 15), k(30, 10, "gpu_memcpy"), k(100, 10),
            h("hmscale:step", 0, 120, "user_annotation"), h("model.py(3): forward", 15, 20, "python_function"),
            h("zero.py(9): hook", 38, 67, "python_function"), h("aten::copy_", 50, 5, "cpu_op"),
            {"ph": "M", "name": "process_name"}]


def test_busy_intervals_merge_streams_and_gaps_are_what_is_left():
    busy = GAPS["busy_intervals"](_trace())
    assert busy == [(0.0, 20.0), (30.0, 40.0), (100.0, 110.0)]
    assert GAPS["idle_gaps"](busy) == [(20.0, 30.0), (40.0, 100.0)]
    assert GAPS["idle_gaps"](busy, min_gap_us=11) == [(40.0, 100.0)]


def test_host_events_are_charged_the_idle_time_inside_them():
    events = _trace()
    rows = GAPS["attribute"](events, GAPS["idle_gaps"](GAPS["busy_intervals"](events)))
    assert rows["hmscale:step"][0] == pytest.approx(70.0)  # both gaps
    assert rows["model.py(3): forward"][0] == pytest.approx(10.0)  # [20,30]
    assert rows["zero.py(9): hook"][0] == pytest.approx(60.0)  # [40,100]
    assert rows["aten::copy_"][0] == pytest.approx(5.0)
    assert rows["zero.py(9): hook"][1:] == [1, 67.0]


def test_report_ranks_the_host_events_and_reads_gzipped_traces(tmp_path):
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": _trace()}, f)
    text = GAPS["report"](GAPS["load_events"](path), min_gap_us=0, title="t")
    assert "busy 0.04 ms, idle 0.07 ms (63.6 %)" in text
    assert "hmscale:step: wall 0.12 ms, GPU idle inside it 0.07 ms" in text
    ranked = [line.split()[-1] for line in text.splitlines()[4:]]
    assert ranked[:3] == ["hmscale:step", "hook", "forward"]
    assert GAPS["report"]([e for e in _trace() if e.get("cat") != "kernel" and e.get("cat") != "gpu_memcpy"],
                          title="t") == "t: no device events in the trace"
