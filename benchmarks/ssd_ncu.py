"""One SSD fwd+bwd per sweep shape inside a CUDA profiler range, for Nsight Compute's hardware counters.

Warms each shape up (compiles, fills the launch cache) outside the range, then runs one fwd+bwd per shape inside
``cudaProfilerStart/Stop``, so that ``ncu --profile-from-start off`` sees each of our kernels once per shape:

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section Occupancy \\
        --section LaunchStats --section WarpStateStats python3 benchmarks/ssd_ncu.py --shapes 1.4b_2k,160m_norm

Shapes are ``ssd.py``'s sweep shapes (16K tokens, bf16).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _runinfo import header, need_cuda  # noqa: E402
from kernels import ssd  # noqa: E402
from ssd import SWEEP_SHAPES, sweep_inputs  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="1.4b_2k,160m_norm", help=f"comma-separated, of {sorted(SWEEP_SHAPES)}")
    args = ap.parse_args()
    need_cuda("benchmarks/ssd_ncu.py", "it runs the kernels for Nsight Compute's counters; on the CPU, "
                                       "benchmarks/ssd_registers.py reads their registers and spills")
    print(header("cuda"), flush=True)
    calls = []
    for name in args.shapes.split(","):
        if name not in SWEEP_SHAPES:
            raise SystemExit(f"--shapes: unknown shape {name!r}; choose from {sorted(SWEEP_SHAPES)}")
        torch.manual_seed(0)
        x, dt, A, B, C, gy, kw = sweep_inputs(*SWEEP_SHAPES[name])
        ins = [x, dt, A, B, C] + ([kw["D"]] if "D" in kw else [])

        def fb(x=x, dt=dt, A=A, B=B, C=C, gy=gy, kw=kw, ins=ins):
            return torch.autograd.grad(ssd(x, dt, A, B, C, chunk_size=64, **kw), ins, gy)

        for _ in range(3):
            fb()
        calls.append((name, fb))
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for name, fb in calls:
        torch.cuda.nvtx.range_push(name)
        fb()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
    torch.cuda.cudart().cudaProfilerStop()
    print("profiled:", ", ".join(n for n, _ in calls))


if __name__ == "__main__":
    main()
