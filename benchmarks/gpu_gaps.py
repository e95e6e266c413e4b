"""Where a step leaves the GPU idle: the idle gaps of a torch.profiler chrome trace, attributed to the host work
that was running while the device waited.

    python benchmarks/gpu_gaps.py TRACE.json [--top 30] [--min-gap-us 2]

`train_throughput.py --gaps` profiles one optimizer step per model and prints this report (once with the host's
torch ops and once with its Python frames). The device is busy while any kernel, memcpy or memset runs; every
other moment between the first and the last device event of the trace is idle. Each host event (a Python frame,
a torch op, a `record_function` range) is charged the idle time inside its interval, inclusive of its callees, so
the report reads like a flame graph of the time the GPU spent waiting for the host.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATS = ("python_function", "user_annotation", "cpu_op")


def load_events(path: str | Path) -> list[dict]:
    """The complete ("X") events of a chrome trace (plain or .gz)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [e for e in events if e.get("ph") == "X" and "ts" in e and "dur" in e]


def busy_intervals(events: list[dict]) -> list[tuple[float, float]]:
    """The device's busy time as sorted, disjoint (start, end) intervals in us (overlapping streams merged)."""
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events if e.get("cat") in DEVICE_CATS)
    merged: list[list[float]] = []
    for a, b in spans:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def idle_gaps(busy: list[tuple[float, float]], min_gap_us: float = 0.0) -> list[tuple[float, float]]:
    """The gaps between consecutive busy intervals at least `min_gap_us` long."""
    return [(a[1], b[0]) for a, b in zip(busy, busy[1:]) if b[0] - a[1] >= min_gap_us]


class IdleClock:
    """idle(t): the idle time (summed gaps) before t; overlap(a, b) = idle(b) - idle(a) in O(log n)."""

    def __init__(self, gaps: list[tuple[float, float]]):
        self.starts = [g[0] for g in gaps]
        self.gaps = gaps
        self.before = [0.0]
        for a, b in gaps:
            self.before.append(self.before[-1] + (b - a))

    def idle(self, t: float) -> float:
        i = bisect.bisect_right(self.starts, t)  # gaps[:i] start at or before t
        if i == 0:
            return 0.0
        a, b = self.gaps[i - 1]
        return self.before[i - 1] + (min(t, b) - a)

    def overlap(self, a: float, b: float) -> float:
        return self.idle(b) - self.idle(a)


def attribute(events: list[dict], gaps: list[tuple[float, float]], cats=HOST_CATS) -> dict[str, list[float]]:
    """name -> [idle us inside its intervals (inclusive), calls, wall us] for host events of the given categories."""
    clock = IdleClock(gaps)
    out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0, 0.0])
    for e in events:
        if e.get("cat") not in cats:
            continue
        a = float(e["ts"])
        b = a + float(e["dur"])
        row = out[e.get("name", "?")]
        row[0] += clock.overlap(a, b)
        row[1] += 1
        row[2] += b - a
    return dict(out)


def report(events: list[dict], *, top: int = 30, min_gap_us: float = 2.0, cats=HOST_CATS, title: str = "") -> str:
    """A text report: device busy / idle over the traced window, the idle per annotated range, and the host events
    charged the most idle time."""
    busy = busy_intervals(events)
    if not busy:
        return f"{title}: no device events in the trace"
    t0, t1 = busy[0][0], busy[-1][1]
    busy_us = sum(b - a for a, b in busy)
    gaps = idle_gaps(busy, min_gap_us)
    idle_us = sum(b - a for a, b in gaps)
    lines = [f"{title}" if title else "GPU idle report",
             f"  device window {1e-3 * (t1 - t0):.2f} ms: busy {1e-3 * busy_us:.2f} ms, idle {1e-3 * (t1 - t0 - busy_us):.2f} ms"
             f" ({100 * (t1 - t0 - busy_us) / (t1 - t0):.1f} %), of it in {len(gaps)} gaps >= {min_gap_us:g} us: "
             f"{1e-3 * idle_us:.2f} ms"]
    rows = attribute(events, gaps, cats)
    ranges = {k: v for k, v in rows.items() if k.startswith("hmscale:")}
    for name, (idle, _, wall) in sorted(ranges.items()):
        lines.append(f"  {name}: wall {1e-3 * wall:.2f} ms, GPU idle inside it {1e-3 * idle:.2f} ms")
    lines.append(f"  {'idle ms':>8} {'calls':>6} {'wall ms':>8}  host event (inclusive of its callees)")
    for name, (idle, calls, wall) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:top]:
        if idle <= 0:
            break
        lines.append(f"  {1e-3 * idle:8.2f} {int(calls):6d} {1e-3 * wall:8.2f}  {name[:110]}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", help="a chrome trace from torch.profiler (export_chrome_trace), .json or .json.gz")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--min-gap-us", type=float, default=2.0, help="ignore idle gaps shorter than this")
    ap.add_argument("--cats", default=",".join(HOST_CATS), help="host event categories to charge")
    args = ap.parse_args(argv)
    if not Path(args.trace).is_file():
        print(f"gpu_gaps: no trace at {args.trace}", file=sys.stderr)
        return 2
    print(report(load_events(args.trace), top=args.top, min_gap_us=args.min_gap_us,
                 cats=tuple(args.cats.split(",")), title=args.trace))
    return 0


if __name__ == "__main__":
    sys.exit(main())
