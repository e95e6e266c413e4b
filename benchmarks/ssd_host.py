"""Where the wall time of one SSD fwd+bwd call goes on the GPU's host: ours against mamba_ssm, same inputs.

For each shape (16K tokens per call, bf16) and each implementation, in one process:

- ``wall``: back-to-back calls, one synchronisation at the end, mean per call;
- ``host``: the same calls timed on the host without waiting for the device (the launch queue is deep enough
  for the calls timed): what the Python side and the launches cost per call;
- ``kernels``: the CUDA time of the call's kernels (torch.profiler, summed);
- ``graph`` (ours only): the call replayed from a CUDA graph (no host work per call but the replay).

With ``--cprofile`` also the top host functions of ours by own time.

    python benchmarks/ssd_host.py [--shapes 410m,410m-train,1.4b] [--iters 50] [--cprofile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from kernels import ssd  # noqa: E402

from _runinfo import header, mamba_ssm_version, need_cuda  # noqa: E402
from ssd import load_mamba  # noqa: E402  (benchmarks/ssd.py, beside this script)

TOKENS = 16384
SHAPES = {  # name: H, G, P, N, L, training-call options (normaliser and D, positive feature maps)
    "410m": (16, 16, 64, 128, 2048, False),
    "410m-train": (16, 16, 64, 128, 2048, True),
    "1.4b": (16, 16, 128, 256, 2048, False),
    "410m-16k": (16, 16, 64, 128, 16384, False),  # one sequence: the split passes, host-bound
    "1.4b-16k": (16, 16, 128, 256, 16384, False),
}


def inputs(H, G, P, N, L, train):
    b = TOKENS // L
    dev = "cuda"
    x = torch.randn(b, L, H, P, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dt = (torch.rand(b, L, H, device=dev) * 0.5 + 0.05).requires_grad_()
    A = (-(torch.rand(H, device=dev) + 0.05)).requires_grad_()
    B = torch.randn(b, L, G, N, device=dev) / N ** 0.5
    C = torch.randn(b, L, G, N, device=dev) / N ** 0.5
    kw = {}
    if train:
        B, C = torch.softmax(B * 4, -1), torch.softmax(C * 4, -1)
        kw = dict(normalize=True, D=torch.randn(H, device=dev, requires_grad=True))
    B = B.to(torch.bfloat16).requires_grad_()
    C = C.to(torch.bfloat16).requires_grad_()
    gy = torch.randn_like(x)
    return [x, dt, A, B, C], kw, gy


def timings(fn, iters):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    host = (time.perf_counter() - t0) / iters
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / iters
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    dev_us = 0.0
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None)
        if t is None:
            t = getattr(e, "self_cuda_time_total", 0)
        if t > 0 and not e.key.startswith("ProfilerStep"):
            dev_us += t
    return wall * 1e6, host * 1e6, dev_us / 5


def graph_time(fn, iters):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        g.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e6


def _host_us(fn, n):
    """Host time per call of fn over n calls, not waiting for the device (after one warm call)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return t


def launch_cost(iters):
    import triton
    import triton.language as tl

    @triton.jit
    def _touch4(a, b, c, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(a + i, tl.load(b + i, mask=i < n) + tl.load(c + i, mask=i < n), mask=i < n)

    @triton.jit
    def _touch32(a, b, c, d, e, f, g, h, i0, j, k, l, m, n, o, q, n1, n2, n3, n4, n5, n6, n7, n8, n9, n10, n11,
                 n12, n13, n14, n15, n16, BLOCK: tl.constexpr, F1: tl.constexpr, F2: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(a + i, tl.load(b + i, mask=i < n1), mask=i < n1)

    from kernels.launch import launch as direct

    ts = [torch.empty(1024, device="cuda") for _ in range(16)]
    ints = [1024 + 16 * k for k in range(16)]
    for name, launch in (("4 args", lambda: _touch4[(1,)](ts[0], ts[1], ts[2], 1024, BLOCK=1024)),
                         ("32 args", lambda: _touch32[(1,)](*ts, *ints, BLOCK=1024, F1=True, F2=2)),
                         ("4 args, kernels.launch", lambda: direct(_touch4, (1,), ts[0], ts[1], ts[2], 1024,
                                                                   BLOCK=1024)),
                         ("32 args, kernels.launch", lambda: direct(_touch32, (1,), *ts, *ints, BLOCK=1024,
                                                                    F1=True, F2=2))):
        print(f"trivial Triton launch, {name}: {_host_us(launch, iters * 10):.1f} us host per launch", flush=True)
    x = torch.empty(1 << 20, device="cuda")
    t = _host_us(lambda: (torch.empty(1 << 20, device="cuda"), x.add_(1.0)), iters * 10)
    print(f"torch.empty + one in-place add: {t:.1f} us host", flush=True)

    class _Probe(torch.autograd.Function):  # the fixed cost of an autograd.Function fwd+bwd with 5 inputs
        @staticmethod
        def forward(ctx, a, b, c, d, e):
            return a + 1

        @staticmethod
        def backward(ctx, g):
            return g, None, None, None, None

    ins = [torch.randn(1024, device="cuda", requires_grad=True) for _ in range(5)]
    go = torch.ones(1024, device="cuda")
    probe = lambda: torch.autograd.grad(_Probe.apply(*ins), ins[:1], go)  # noqa: E731
    t = _host_us(probe, iters * 10)
    print(f"autograd.Function fwd + autograd.grad, one add each way: {t:.1f} us host", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="410m,410m-train,1.4b")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--cprofile", action="store_true")
    ap.add_argument("--no-mamba", action="store_true", help="skip the mamba_ssm baseline (needed otherwise)")
    ap.add_argument("--launch-cost", action="store_true",
                    help="also time the host cost of launching one trivial Triton kernel with 4 and 32 arguments")
    args = ap.parse_args()
    need_cuda("benchmarks/ssd_host.py", "it times the host side of GPU calls; there is no CPU mode")
    mamba = None if args.no_mamba else load_mamba("benchmarks/ssd_host.py", "--no-mamba to time ours alone")
    print(header("cuda", "baseline " + ("none (--no-mamba)" if args.no_mamba else f"mamba_ssm {mamba_ssm_version()}")),
          flush=True)
    if args.launch_cost:
        launch_cost(args.iters)
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}; us per fwd+bwd call, "
          f"{TOKENS} tokens per call, bf16, {args.iters} calls")
    print(f"{'shape':<11} {'impl':<6} {'wall':>8} {'host':>8} {'kernels':>8} {'graph':>8}")
    for name in args.shapes.split(","):
        H, G, P, N, L, train = SHAPES[name]
        ins, kw, gy = inputs(H, G, P, N, L, train)
        ours = lambda: torch.autograd.grad(ssd(*ins, chunk_size=64, **kw), ins, gy)  # noqa: E731
        w, h, k = timings(ours, args.iters)
        gr = graph_time(ours, args.iters)
        print(f"{name:<11} {'ours':<6} {w:8.1f} {h:8.1f} {k:8.1f} {gr:8.1f}", flush=True)
        from kernels.launch import launch_counts
        launch_counts(reset=True)
        ours()
        print(f"  launches of one call: {launch_counts()}", flush=True)
        if mamba is not None and not train:
            fb = lambda: torch.autograd.grad(mamba(*ins, chunk_size=64), ins, gy)  # noqa: E731
            w, h, k = timings(fb, args.iters)
            print(f"{name:<11} {'mamba':<6} {w:8.1f} {h:8.1f} {k:8.1f} {'-':>8}", flush=True)
        if args.cprofile:
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(args.iters):
                ours()
            pr.disable()
            torch.cuda.synchronize()
            buf = io.StringIO()
            st = pstats.Stats(pr, stream=buf)
            st.sort_stats("tottime").print_stats(30)
            st.sort_stats("cumulative").print_stats(45)
            print(f"--- cProfile of ours, {name}, {args.iters} calls (by own time, then cumulative) ---")
            print(buf.getvalue())


if __name__ == "__main__":
    main()
