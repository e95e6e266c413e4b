"""SSD benchmark on one GPU: ours (kernels.ssd, Triton) vs mamba_ssm's ``mamba_chunk_scan_combined`` vs
causal SDPA (flash) with the same heads; forward and forward+backward, 16K tokens per call, bf16.
Also the decode step against its memory floor (state read + write at the measured copy bandwidth).

    python benchmarks/ssd.py [--quick] [--chunks 64,128]
    python benchmarks/ssd.py --sweep variants.txt [--old DIR]   # tuning: fwd+bwd and per-kernel times per variant

mamba_ssm is imported from /tmp/anchors (``source .whl/preamble.sh`` unpacks it there, after ``make gpu-wheels``);
without it the benchmark stops at once, unless ``--ours-only`` (no baselines). Needs a CUDA GPU: without one it
stops at once (the CPU has ``ssd_gpu_check.py --cpu`` for numerics and ``ssd_registers.py`` for registers, no timing).
FLOP counts are those of the chunked algorithm at chunk 64 (fwd: 2QN per token and B/C group for C.B^T, plus
2QP + 4PN per token and head; bwd counted as 2x fwd, so fwd+bwd = 3x fwd); SDPA: causal, 2 * 2 * l^2/2 * P per
head fwd, fwd+bwd 3x that under the same convention (FlashAttention's own, which counts the recomputed QK^T, is 3.5x).
Peak memory: max allocated during the call minus what was allocated before it (inputs excluded).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _runinfo import header, mamba_ssm_version, need_cuda  # noqa: E402
from kernels import ssd  # noqa: E402
from kernels.step import ssd_step_triton  # noqa: E402

SHAPES = [  # name, H, G, P, N, L
    ("410m-hedge", 16, 16, 64, 128, 2048),
    ("410m-hedge", 16, 16, 64, 128, 8192),
    ("410m-hedge", 16, 16, 64, 128, 16384),
    ("1.4b-hedge", 16, 16, 128, 256, 2048),
    ("1.4b-hedge", 16, 16, 128, 256, 8192),
    ("1.4b-hedge", 16, 16, 128, 256, 16384),
    ("mamba2", 64, 1, 64, 128, 2048),
]
TOKENS = 16384


def load_mamba(script="benchmarks/ssd.py", instead="--ours-only to time ours alone"):
    """mamba_ssm's ``mamba_chunk_scan_combined``, or exit with one line saying how to get it."""
    sys.path.insert(0, "/tmp/anchors")
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
        return mamba_chunk_scan_combined
    except Exception as e:  # pragma: no cover - depends on the machine
        sys.exit(f"{script}: the mamba_ssm baseline is missing ({type(e).__name__}: {e}): `make gpu-wheels` once, then "
                 f"`source .whl/preamble.sh` (it unpacks mamba_ssm into /tmp/anchors); or {instead}")


def bench(fn, warmup=10, rep=50):
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def peak_mem(fn):
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 20


def ssd_flops(b, l, h, p, n, Q=64, g=None):
    """(fwd, fwd+bwd) FLOPs of the chunked SSD: per token, C.B^T once per group (2QN), then per head the masked
    (C B^T) x (2QP), the chunk state B^T x (2PN) and the output C S (2PN); the backward counted as 2x the forward."""
    g = h if g is None else g
    fwd = b * l * (g * 2 * Q * n + h * (2 * Q * p + 4 * p * n))
    return fwd, 3 * fwd


def sdpa_flops(b, h, l, p):
    """(fwd, fwd+bwd) FLOPs of causal attention: QK^T and PV, 2 l^2 P each per head, halved by the mask; the
    backward counted as 2x the forward, as the SSD's."""
    fwd = b * h * 2 * 2 * l * l / 2 * p
    return fwd, 3 * fwd


def make(b, l, h, g, p, n, dtype=torch.bfloat16):
    dev = "cuda"
    x = torch.randn(b, l, h, p, device=dev, dtype=dtype, requires_grad=True)
    dt = (torch.rand(b, l, h, device=dev) * 0.5 + 0.05).requires_grad_()
    A = (-(torch.rand(h, device=dev) + 0.05)).requires_grad_()
    B = (torch.randn(b, l, g, n, device=dev) / n ** 0.5).to(dtype).requires_grad_()
    C = (torch.randn(b, l, g, n, device=dev) / n ** 0.5).to(dtype).requires_grad_()
    gy = torch.randn(b, l, h, p, device=dev, dtype=dtype)
    return x, dt, A, B, C, gy


def case(name, H, G, P, N, L, mamba, chunks, rows, sdpa=True):
    b = TOKENS // L
    x, dt, A, B, C, gy = make(b, L, H, G, P, N)
    ins = [x, dt, A, B, C]
    res = {}
    for Q in chunks:
        f = lambda Q=Q: ssd(x, dt, A, B, C, chunk_size=Q)  # noqa: E731
        fb = lambda Q=Q: torch.autograd.grad(ssd(x, dt, A, B, C, chunk_size=Q), ins, gy)  # noqa: E731
        fb()
        torch.cuda.synchronize()
        res[f"ours{Q}"] = (bench(f), bench(fb), peak_mem(fb))
    if mamba is not None:
        f = lambda: mamba(x, dt, A, B, C, chunk_size=64)  # noqa: E731
        fb = lambda: torch.autograd.grad(mamba(x, dt, A, B, C, chunk_size=64), ins, gy)  # noqa: E731
        fb()
        res["mamba"] = (bench(f), bench(fb), peak_mem(fb))
    fl_f, fl_fb = ssd_flops(b, L, H, P, N, g=G)
    sd_f, sd_fb = sdpa_flops(b, H, L, P)
    if not sdpa:
        rows.append((name, H, G, P, N, L, b, res, fl_f, fl_fb, sd_f, sd_fb))
        return
    q = torch.randn(b, H, L, P, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn_like(q, requires_grad=True)
    v = torch.randn_like(q, requires_grad=True)
    go = torch.randn_like(q)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        f = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
        fb = lambda: torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True), [q, k, v], go)  # noqa: E731
        fb()
        res["sdpa"] = (bench(f), bench(fb), peak_mem(fb))
    rows.append((name, H, G, P, N, L, b, res, fl_f, fl_fb, sd_f, sd_fb))


def decode_bench(rows):
    b, h, p, n, g = 64, 16, 64, 128, 16
    dev = "cuda"
    state = torch.randn(b, h, p, n, device=dev)
    x = torch.randn(b, h, p, device=dev, dtype=torch.bfloat16)
    dt = torch.rand(b, h, device=dev) * 0.5 + 0.05
    A = -(torch.rand(h, device=dev) + 0.05)
    B = torch.randn(b, g, n, device=dev, dtype=torch.bfloat16)
    C = torch.randn(b, g, n, device=dev, dtype=torch.bfloat16)
    # copy bandwidth: large device-to-device copy, bytes read + written
    src = torch.randn(512 * 1024 * 1024 // 4, device=dev)
    dst = torch.empty_like(src)
    t_copy = bench(lambda: dst.copy_(src))
    bw = 2 * src.numel() * 4 / (t_copy * 1e-3)
    del src, dst
    # rotate among several states so the state is not served from L2 (state is 32 MiB, L2 60 MB)
    states = [torch.randn_like(state) for _ in range(8)]
    it = [0]

    def step():
        it[0] = (it[0] + 1) % len(states)
        return ssd_step_triton(states[it[0]], x, dt, A, B, C)

    t = bench(step)
    graph_states = states
    # also with the launch overhead removed: a CUDA graph of 8 steps, one per state
    gph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for st in graph_states:
            ssd_step_triton(st, x, dt, A, B, C)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(gph):
        for st in graph_states:
            ssd_step_triton(st, x, dt, A, B, C)
    t_graph = bench(gph.replay) / len(graph_states)
    state_bytes = state.numel() * 4
    floor = 2 * state_bytes / bw * 1e3
    rows.append((b, h, p, n, t, t_graph, floor, bw))


def profile_breakdown(H, G, P, N, L):
    """Per-kernel CUDA time of ours fwd+bwd at one shape (torch.profiler), to see where time goes."""
    b = TOKENS // L
    x, dt, A, B, C, gy = make(b, L, H, G, P, N)
    ins = [x, dt, A, B, C]
    for _ in range(3):
        torch.autograd.grad(ssd(x, dt, A, B, C), ins, gy)
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            torch.autograd.grad(ssd(x, dt, A, B, C), ins, gy)
        torch.cuda.synchronize()
    print(f"\nper-kernel CUDA time, ours fwd+bwd x10, H={H} G={G} P={P} N={N} L={L} b={b}:")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=40))


def dbc_sweep(configs):
    """fwd+bwd time of ours for several tilings of the dB/dC kernel (HMSCALE_SSD_DBC_CFG), two shapes."""
    print("\n| dbc config (BP,BN,stages,warps) | 410m L=2048 fwd+bwd ms | 1.4b L=16384 fwd+bwd ms |")
    print("|---|---|---|")
    shapes = [(16, 16, 64, 128, 2048), (16, 16, 128, 256, 16384)]
    data = [make(TOKENS // L, L, H, G, P, N) for H, G, P, N, L in shapes]
    for cfg in configs:
        os.environ["HMSCALE_SSD_DBC_CFG"] = cfg
        ts = []
        for x, dt, A, B, C, gy in data:
            ins = [x, dt, A, B, C]
            fb = lambda: torch.autograd.grad(ssd(x, dt, A, B, C), ins, gy)  # noqa: E731
            fb()
            ts.append(bench(fb))
        print(f"| {cfg} | {ts[0]:.3f} | {ts[1]:.3f} |", flush=True)
    os.environ.pop("HMSCALE_SSD_DBC_CFG", None)


SWEEP_SHAPES = {  # name: H, G, P, N, L, normalize (the *_norm ones: the 160m and 410m training calls, softmax B/C, D)
    "410m_2k": (16, 16, 64, 128, 2048, False),
    "410m_8k": (16, 16, 64, 128, 8192, False),
    "410m_16k": (16, 16, 64, 128, 16384, False),
    "1.4b_2k": (16, 16, 128, 256, 2048, False),
    "1.4b_8k": (16, 16, 128, 256, 8192, False),
    "1.4b_16k": (16, 16, 128, 256, 16384, False),
    "160m_norm": (12, 12, 64, 128, 2048, True),
    "410m_norm": (16, 16, 64, 128, 2048, True),
    "1b_norm": (8, 8, 256, 512, 2048, True),  # Pythia-1b's training call (the paper's teacher)
    "1b_2k": (8, 8, 256, 512, 2048, False),
}
KERNEL_SHORT = {"_chunk_state_fwd": "state", "_state_pass_fwd": "pass", "_chunk_scan_fwd": "scan",
                "_chunk_dstate_bwd": "dstate", "_state_pass_bwd": "pass_b", "_chunk_bwd_dx_dcs": "dx",
                "_chunk_bwd_dx": "dx1", "_chunk_bwd_dbc": "dbc",
                "_state_fused_fwd": "fstate", "_dstate_fused_bwd": "fdstate", "_chunk_bwd_fused": "fbwd",
                "_chunk_bwd_pair": "pair"}


def kernel_times(fn, iters=5, label=None):
    """Per-kernel CUDA time (us per call) of fn, by torch.profiler, summed by ``label(kernel name)`` (default: our
    kernels' short names, everything else as 'torch')."""
    label = label or (lambda key: KERNEL_SHORT.get(key, "torch"))
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        # self time: a CPU op's device time is its kernels', which are counted themselves
        t = getattr(e, "self_device_time_total", None)
        if t is None:
            t = getattr(e, "self_cuda_time_total", 0)
        if t <= 0 or e.key.startswith("ProfilerStep"):
            continue
        k = label(e.key)
        out[k] = out.get(k, 0.0) + t / iters
    return out


def sweep_inputs(H, G, P, N, L, norm):
    b = TOKENS // L
    x, dt, A, B, C, gy = make(b, L, H, G, P, N)
    kw = {}
    if norm:  # positive feature maps as in the model, and the D skip
        B = torch.softmax(B.detach().float() * 4, -1).to(B.dtype).requires_grad_()
        C = torch.softmax(C.detach().float() * 4, -1).to(C.dtype).requires_grad_()
        kw = dict(normalize=True, D=torch.randn(H, device="cuda", requires_grad=True))
    return x, dt, A, B, C, gy, kw


def run_sweep(path, warm_only=False, part="0/1", old_dir=None, fwd_only=False):
    """Time ours fwd+bwd (and per-kernel) for the variants of a sweep file: one per line,
    ``label | ENV=VAL ENV=VAL ... | shape,shape`` (shapes optional; names in SWEEP_SHAPES). ``IMPL=old`` times the
    kernels package found at --old instead; ``CHUNK=128`` sets the chunk size (default 64). --warm-only --part i/n only compiles a share of the variants."""
    variants = []
    for line in open(path):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = [t.strip() for t in line.split("|")]
        env = dict(kv.split("=", 1) for kv in parts[1].split()) if len(parts) > 1 and parts[1] else {}
        shapes = parts[2].split(",") if len(parts) > 2 and parts[2] else list(SWEEP_SHAPES)
        variants.append((parts[0], env, shapes))
    i, n = (int(v) for v in part.split("/"))
    if warm_only:
        variants = variants[i::n]
    old = None
    if old_dir:
        sys.path.insert(0, old_dir)
        import kernels_old  # noqa: F401
        old = kernels_old.ssd
    data = {}
    base_env = dict(os.environ)
    if not warm_only:
        what = "fwd" if fwd_only else "fwd+bwd"
        print(f"| variant | shape | {what} ms | per kernel us (profiler) |\n|---|---|---|---|", flush=True)
    for label, env, shapes in variants:
        os.environ.clear()
        os.environ.update(base_env)
        os.environ.update({k: v for k, v in env.items() if k not in ("IMPL", "CHUNK")})
        fn_ssd = old if env.get("IMPL") == "old" else ssd
        chunk = int(env.get("CHUNK", 64))
        for sh in shapes:
            if sh not in data:
                torch.manual_seed(0)
                data[sh] = sweep_inputs(*SWEEP_SHAPES[sh])
            x, dt, A, B, C, gy, kw = data[sh]
            ins = [x, dt, A, B, C] + ([kw["D"]] if "D" in kw else [])
            if fwd_only:  # what inference runs: no graph, no numerator kept for a backward
                def fb(x=x, dt=dt, A=A, B=B, C=C, kw=kw, chunk=chunk, fn_ssd=fn_ssd):
                    with torch.no_grad():
                        return fn_ssd(x, dt, A, B, C, chunk_size=chunk, **kw)
            else:
                fb = lambda: torch.autograd.grad(fn_ssd(x, dt, A, B, C, chunk_size=chunk, **kw), ins, gy)  # noqa: E731
            try:
                fb()
                torch.cuda.synchronize()
                if warm_only:
                    continue
                t = bench(fb, warmup=10, rep=40)
                kt = kernel_times(fb)
                ks = " ".join(f"{k} {v:.0f}" for k, v in sorted(kt.items(), key=lambda kv: -kv[1]))
                print(f"| {label} | {sh} | {t:.3f} | {ks} |", flush=True)
            except Exception as e:  # a tiling that does not compile or fit: report and go on
                print(f"| {label} | {sh} | ERROR | {type(e).__name__}: {str(e)[:160]} |", flush=True)
    os.environ.clear()
    os.environ.update(base_env)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="two shapes (410m L=2048, 1.4b L=16384) instead of seven")
    ap.add_argument("--chunks", default="64", help="chunk sizes of ours to time, comma-separated")
    ap.add_argument("--ours-only", action="store_true", help="skip the mamba_ssm and SDPA baselines")
    ap.add_argument("--dbc-sweep", default="",
                    help="only time these ';'-separated dB/dC kernel configs 'BP,BN,stages,warps', then exit")
    ap.add_argument("--profile", action="store_true", help="also print a per-kernel breakdown at two shapes")
    ap.add_argument("--sweep", default="", help="time the variants of this sweep file (see run_sweep), then exit")
    ap.add_argument("--warm-only", action="store_true", help="with --sweep: only compile (share --part i/n)")
    ap.add_argument("--part", default="0/1")
    ap.add_argument("--old", default=None, help="with --sweep: a folder holding a package kernels_old (IMPL=old)")
    ap.add_argument("--fwd-only", action="store_true", help="with --sweep: time the forward alone, under no_grad")
    args = ap.parse_args()
    need_cuda("benchmarks/ssd.py", "on the CPU, benchmarks/ssd_gpu_check.py --cpu checks the kernels' numerics and "
                                   "benchmarks/ssd_registers.py their registers (no timing)")
    if args.sweep:
        run_sweep(args.sweep, args.warm_only, args.part, args.old, args.fwd_only)
        return
    chunks = [int(c) for c in args.chunks.split(",")]
    torch.manual_seed(0)
    if args.dbc_sweep:
        dbc_sweep(args.dbc_sweep.split(";"))
        return
    t0 = time.time()
    mamba = None if args.ours_only else load_mamba()
    print(header("cuda", f"triton {triton.__version__}, baseline "
                 + ("none (--ours-only)" if args.ours_only else f"mamba_ssm {mamba_ssm_version()} and SDPA (flash)")),
          flush=True)
    dev_name = torch.cuda.get_device_name()
    rows = []
    shapes = SHAPES[:1] + SHAPES[5:6] if args.quick else SHAPES
    for s in shapes:
        case(*s, mamba, chunks, rows, sdpa=not args.ours_only)
        print(f"done {s} at {time.time() - t0:.0f}s", flush=True)
    drows = []
    decode_bench(drows)
    if args.profile:
        profile_breakdown(16, 16, 64, 128, 2048)
        profile_breakdown(16, 16, 128, 256, 16384)
    settings = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("HMSCALE_SSD_")) or "defaults"
    print(f"\ndevice: {dev_name}; torch {torch.__version__}; triton {triton.__version__}; bf16; "
          f"{TOKENS} tokens per call; ms are medians of triton.testing.do_bench; kernel settings: {settings}")
    hdr = "| shape (H,G,P,N) | L | b | impl | fwd ms | fwd+bwd ms | fwd TFLOP/s | fwd+bwd TFLOP/s | peak MiB (fwd+bwd) |"
    print(hdr)
    print("|" + "---|" * (hdr.count("|") - 1))
    for name, H, G, P, N, L, b, res, fl_f, fl_fb, sd_f, sd_fb in rows:
        for impl, (tf, tfb, mem) in res.items():
            ff, ffb = (sd_f, sd_fb) if impl == "sdpa" else (fl_f, fl_fb)
            print(f"| {name} ({H},{G},{P},{N}) | {L} | {b} | {impl} | {tf:.3f} | {tfb:.3f} | "
                  f"{ff / tf * 1e-9:.1f} | {ffb / tfb * 1e-9:.1f} | {mem:.0f} |")
    print("\nratios (fwd+bwd time; memory):")
    print("| shape | L | ours | mamba/ours | sdpa/ours | ours mem / mamba mem |")
    print("|---|---|---|---|---|---|")
    for name, H, G, P, N, L, b, res, *_ in rows:
        ours_key = min((k for k in res if k.startswith("ours")), key=lambda k: res[k][1])
        o = res[ours_key]
        m = res.get("mamba")
        sd = res.get("sdpa")
        mr = f"{m[1] / o[1]:.2f}x" if m else "n/a"
        mm = f"{o[2] / m[2]:.2f}" if m else "n/a"
        sr = f"{sd[1] / o[1]:.2f}x" if sd else "n/a"
        print(f"| {name} ({H},{G},{P},{N}) | {L} | {ours_key} {o[1]:.3f} ms | {mr} | {sr} | {mm} |")
    for b, h, p, n, t, tg, floor, bw in drows:
        print(f"\ndecode step b={b} H={h} P={p} N={n} fp32 state: {t * 1e3:.1f} us per call "
              f"({tg * 1e3:.1f} us per step inside a CUDA graph); floor {floor * 1e3:.1f} us "
              f"(state read+write {2 * b * h * p * n * 4 / 2**20:.0f} MiB at copy bandwidth {bw / 1e12:.2f} TB/s); "
              f"ratio {t / floor:.2f}x (graph {tg / floor:.2f}x)")
    print(f"total {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
