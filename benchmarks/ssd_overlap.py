"""Would a kernel on a second stream run beside the SSD's walks? (kernels/NOTES.md "Next steps" item 00b.)

One fwd+bwd of ``kernels.ssd`` is run with the launches recorded (kernel, grid, arguments); then pairs of those
launches are replayed, each alone and the two at once on two CUDA streams, and timed (CUDA events, median of
``--rep``). A walk (``_state_fused_fwd`` / ``_dstate_fused_bwd``) beside a reader (the scan / the paired dx + dB/dC)
is not a valid order of the real computation (the reader needs the walk's output); the replay only measures how much
of the reader's time the hardware hides behind the walk's:

    hidden = (t_walk + t_reader - t_both) / min(t_walk, t_reader)      (1: fully hidden, 0: serialised)

    python3 benchmarks/ssd_overlap.py [--shapes 1.4b_16k,1.4b_2k] [--rep 30]

Needs a CUDA GPU (it stops at once without one).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _runinfo import header, need_cuda  # noqa: E402
from kernels import ssd  # noqa: E402
import kernels.ssd_triton_bwd as _bwd  # noqa: E402
import kernels.ssd_triton_fwd as _fwd  # noqa: E402
from kernels.launch import launch  # noqa: E402
from ssd import SWEEP_SHAPES, TOKENS, make  # noqa: E402

PAIRS = [("_state_fused_fwd", "_chunk_scan_fwd"), ("_dstate_fused_bwd", "_chunk_bwd_pair"),
         ("_dstate_fused_bwd", "_chunk_scan_fwd")]


def record(shape):
    """The launches (name, fn, grid, args, kwargs) of one fwd+bwd at ``shape`` (a SWEEP_SHAPES name); their
    arguments keep the call's tensors alive for the replays."""
    H, G, P, N, L, _norm = SWEEP_SHAPES[shape]
    x, dt, A, B, C, gy = make(TOKENS // L, L, H, G, P, N)
    seen = []

    def spy(fn, grid, *args, **kwargs):
        seen.append((getattr(fn, "fn", fn).__name__, fn, grid, args, kwargs))
        return launch(fn, grid, *args, **kwargs)

    _fwd.launch = _bwd.launch = spy
    try:
        torch.autograd.grad(ssd(x, dt, A, B, C), [x, dt, A, B, C], gy)
    finally:
        _fwd.launch = _bwd.launch = launch
    torch.cuda.synchronize()
    return seen


def timed(fn, rep):
    """Median ms of ``fn`` over ``rep`` runs (CUDA events on the current stream, after 3 warm-up runs)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(rep):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1.4b_16k,1.4b_2k")
    ap.add_argument("--rep", type=int, default=30)
    args = ap.parse_args()
    need_cuda("benchmarks/ssd_overlap.py", "it times CUDA streams")
    print(header(extra="SSD kernels replayed on two streams"))
    print("\n| shape | walk | reader | walk alone us | reader alone us | both at once us | sum us | hidden |")
    print("|---|---|---|---|---|---|---|---|")
    side = torch.cuda.Stream()
    for shape in args.shapes.split(","):
        seen = record(shape)
        by_name = {name: (fn, grid, a, kw) for name, fn, grid, a, kw in seen}
        for walk, reader in PAIRS:
            if walk not in by_name or reader not in by_name:
                print(f"| {shape} | {walk} | {reader} | (not launched at this shape) | | | | |")
                continue
            run_walk = lambda w=by_name[walk]: launch(w[0], w[1], *w[2], **w[3])  # noqa: E731
            run_reader = lambda r=by_name[reader]: launch(r[0], r[1], *r[2], **r[3])  # noqa: E731

            def both():
                main_stream = torch.cuda.current_stream()
                side.wait_stream(main_stream)
                run_walk()
                with torch.cuda.stream(side):
                    run_reader()
                main_stream.wait_stream(side)

            tw, tr, tb = timed(run_walk, args.rep), timed(run_reader, args.rep), timed(both, args.rep)
            hidden = (tw + tr - tb) / min(tw, tr)
            print(f"| {shape} | {walk} | {reader} | {tw * 1e3:.0f} | {tr * 1e3:.0f} | {tb * 1e3:.0f} | "
                  f"{(tw + tr) * 1e3:.0f} | {hidden:.2f} |", flush=True)


if __name__ == "__main__":
    main()
