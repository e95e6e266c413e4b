"""GPU correctness check of the Triton SSD against the float64 reference, over the full grid.

    python benchmarks/ssd_gpu_check.py            # full grid (P x N x g x dtype, option sets cycled)
    python benchmarks/ssd_gpu_check.py --quick    # a handful of cases
    python benchmarks/ssd_gpu_check.py --cpu --dtypes bf16   # the same cases on the CPU under TRITON_INTERPRET=1
                                                             # (slow: ~minutes per 25 cases; no CUDA graph check)
    python benchmarks/ssd_gpu_check.py --cpu --dtypes bf16 --case 64,512,1,plain --seeds 0,1,2
                                                 # chosen cases only, each from a generator seeded per case

For each case: fresh random inputs (never zeros), outputs and all gradients (x, dt, A, B, C, D,
initial_state) compared by ||ours - ref|| / ||ref|| to ``kernels.ssd_reference`` in float64 on the same
(rounded) inputs. Allocator memory is poisoned with NaN before every call, so an output element that
the kernels never write shows up as NaN. Limits: 1e-2 for bf16/fp16, 1e-4 for fp32 (tf32 off).
Also checks that forward+backward can be captured in a CUDA graph and replays to the eager result.
Prints a table and a PASS/FAIL summary; exit code 1 on failure.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

import torch

if "--cpu" in sys.argv:  # the interpreter must be chosen before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"
DEV = "cpu" if "--cpu" in sys.argv else "cuda"
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _runinfo import header, need_cuda  # noqa: E402
from kernels import ssd_reference  # noqa: E402
from kernels.interpreter import patch_interpreter_bf16_dot, patch_interpreter_device_calls  # noqa: E402
from kernels.ssd_autograd import ssd_triton  # noqa: E402

patch_interpreter_bf16_dot()  # --cpu: the interpreter's bf16 dots as the GPU computes them
patch_interpreter_device_calls()  # --cpu: the language patched once per launch

TOL = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 1e-4}
OPTION_SETS = {
    "plain": dict(),
    "init+seq+D": dict(initial_state=True, seq_idx=True, D=True),
    "norm+init+seq+D": dict(normalize=True, initial_state=True, seq_idx=True, D=True),
}


def poison():
    # large pool (one 256 MB block) and small pool (blocks under 1 MB): freed NaN memory is what
    # the caching allocator hands to the next torch.empty
    if DEV != "cuda":
        return
    junk = [torch.full((64 * 1024 * 1024,), float("nan"), device="cuda")]
    junk += [torch.full((s,), float("nan"), device="cuda") for s in (256, 4096, 65536, 200000) for _ in range(16)]
    del junk


def make_inputs(b, l, h, g, p, n, dtype, opts, gen):
    dev = DEV

    def rn(*s):
        return torch.randn(*s, device=dev, generator=gen)

    x = rn(b, l, h, p).to(dtype)
    dt = (torch.rand(b, l, h, device=dev, generator=gen) * 0.5 + 0.05)
    A = -(torch.rand(h, device=dev, generator=gen) * 1.0 + 0.05)
    if opts.get("normalize"):
        # positive feature maps, as in the models (phi = softmax): the normaliser stays away from zero
        B = torch.softmax(rn(b, l, g, n), dim=-1).to(dtype)
        C = torch.softmax(rn(b, l, g, n), dim=-1).to(dtype)
    else:
        B = (rn(b, l, g, n) / n ** 0.5).to(dtype)
        C = (rn(b, l, g, n) / n ** 0.5).to(dtype)
    ins = dict(x=x, dt=dt, A=A, B=B, C=C)
    if opts.get("D"):
        ins["D"] = rn(h)
    if opts.get("initial_state"):
        s = rn(b, h, p + int(bool(opts.get("normalize"))), n)
        if opts.get("normalize"):
            s[:, :, -1, :] = s[:, :, -1, :].abs() / n  # a positive normaliser row
        ins["initial_state"] = s
    seq = None
    if opts.get("seq_idx"):
        seq = torch.zeros(b, l, dtype=torch.int32, device=dev)
        for i in range(b):
            cuts = sorted(torch.randint(1, l, (3,), generator=gen, device=dev).tolist())
            for c in cuts:
                seq[i, c:] += 1
    return ins, seq


def run_case(b, l, h, g, p, n, dtype, opts, gen, chunk=64):
    ins, seq = make_inputs(b, l, h, g, p, n, dtype, opts, gen)
    names = list(ins)
    ours_in = {k: v.clone().requires_grad_() for k, v in ins.items()}
    ref_in = {k: v.detach().double().requires_grad_() for k, v in ins.items()}
    kw = dict(seq_idx=seq, normalize=bool(opts.get("normalize")), return_final_state=True, chunk_size=chunk)
    poison()
    y, fs = ssd_triton(**ours_in, **kw)
    if DEV == "cuda":
        torch.cuda.synchronize()
    # the output's cotangent in the output's dtype: the backward receives it rounded, so the reference gets it so too
    gy = torch.randn(y.shape, device=DEV, generator=gen).to(y.dtype)
    gfs = torch.randn(fs.shape, device=DEV, generator=gen)
    poison()
    grads = torch.autograd.grad((y.float() * gy).sum() + (fs * gfs).sum(), [ours_in[k] for k in names])
    yr, fsr = ssd_reference(**ref_in, **kw)
    gr = torch.autograd.grad((yr * gy.double()).sum() + (fsr * gfs.double()).sum(), [ref_in[k] for k in names])
    errs = {}

    def rel(a, r):
        a = a.double()
        if torch.isnan(a).any():
            return float("nan")
        return ((a - r).norm() / r.norm().clamp_min(1e-30)).item()

    errs["y"] = rel(y, yr)
    errs["final"] = rel(fs, fsr)
    for k, a, r in zip(names, grads, gr):
        errs["d" + k] = rel(a, r)
    return errs


def graph_check(chunk=64):
    """fwd+bwd captured in a CUDA graph gives the eager result (no host syncs in the hot path)."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    ins, seq = make_inputs(2, 512, 8, 8, 64, 128, torch.bfloat16, OPTION_SETS["init+seq+D"], gen)
    leaf = {k: v.clone().requires_grad_() for k, v in ins.items()}
    gy = torch.randn(2, 512, 8, 64, device="cuda", generator=gen).to(torch.bfloat16)

    def step():
        y, fs = ssd_triton(**leaf, seq_idx=seq, return_final_state=True, chunk_size=chunk)
        return torch.autograd.grad((y * gy).sum() + fs.sum(), list(leaf.values()))

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            eager = step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = step()
    g.replay()
    torch.cuda.synchronize()
    return max(((a.float() - e.float()).norm() / e.float().norm()).item() for a, e in zip(out, eager))


def chosen_cases(specs, seeds, dtypes, l, h, chunk):
    """--case: each (P, N, G, option set) x dtype x seed, its inputs from a generator seeded with the seed; prints
    every output's error; returns the exit code (1 if one is over its dtype's limit)."""
    fails = 0
    for seed in seeds:
        for spec in specs:
            p, n, g, oname = spec.split(",")
            if oname not in OPTION_SETS:
                raise SystemExit(f"--case {spec}: options must be one of {', '.join(OPTION_SETS)}")
            for dt in dtypes:
                gen = torch.Generator(device=DEV).manual_seed(seed)
                errs = run_case(2, l, h, int(g), int(p), int(n), dt, OPTION_SETS[oname], gen, chunk=chunk)
                worst = max(errs.values(), key=lambda v: float("inf") if v != v else v)  # a NaN is the worst
                fails += not (worst <= TOL[dt])
                print(f"seed {seed} P={p} N={n} g={g} {oname} {str(dt).replace('torch.', '')}: "
                      + " ".join(f"{k} {v:.2e}" for k, v in errs.items()) + ("" if worst <= TOL[dt] else " FAIL"),
                      flush=True)
    return 1 if fails else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="four cases instead of the grid")
    ap.add_argument("--l", type=int, default=200, help="sequence length (not a multiple of the chunk)")
    ap.add_argument("--chunk", type=int, default=64, help="chunk size of the kernels under test")
    ap.add_argument("--shard", default="0/1",
                    help="i/n: this process's share of the (dtype, option set) pairs (9 of them); run n in parallel")
    ap.add_argument("--cpu", action="store_true", help="run on the CPU under TRITON_INTERPRET=1 (no CUDA graph check)")
    ap.add_argument("--dtypes", default="bf16,fp16,fp32", help="the input dtypes to check, of bf16, fp16, fp32")
    ap.add_argument("--case", action="append", default=[],
                    help="P,N,G,OPTIONS (OPTIONS one of " + ", ".join(OPTION_SETS) + "): check only these cases "
                         "(repeatable), with --dtypes, once per seed of --seeds")
    ap.add_argument("--seeds", default="0", help="with --case: comma-separated seeds, each case's generator seeded anew")
    args = ap.parse_args()
    if DEV == "cuda":
        need_cuda("benchmarks/ssd_gpu_check.py", "--cpu runs the same cases under the Triton interpreter (slowly)")
    print(header(DEV, "TRITON_INTERPRET=1" if DEV == "cpu" else ""), flush=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    gen = torch.Generator(device=DEV).manual_seed(0)
    names = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    if not set(t.strip() for t in args.dtypes.split(",")) <= set(names):
        ap.error(f"--dtypes must name some of bf16, fp16, fp32, got {args.dtypes!r}")
    wanted = [names[t.strip()] for t in args.dtypes.split(",")]
    Ps = [32, 64, 80, 128, 256]
    Ns = [16, 64, 128, 256, 512]
    h = 8
    gs = [1, h // 4, h]
    dtypes = [torch.bfloat16, torch.float16, torch.float32]
    cases = list(itertools.product(Ps, Ns, gs, dtypes))
    if args.quick:
        cases = [(64, 128, 8, torch.bfloat16), (80, 16, 1, torch.float32), (256, 512, 2, torch.float16),
                 (32, 64, 2, torch.float32)]
    opt_names = list(OPTION_SETS)
    if args.case:
        sys.exit(chosen_cases(args.case, [int(v) for v in args.seeds.split(",")], wanted, args.l, h, args.chunk))
    shard, nshard = (int(v) for v in args.shard.split("/"))
    rows, fails = [], []
    t0 = time.time()
    for i, (p, n, g, dt) in enumerate(cases):
        # options rotate over the grid for each dtype, so every dtype meets every option set
        oi = (i // len(dtypes)) % len(opt_names)
        if (dtypes.index(dt) * len(opt_names) + oi) % nshard != shard:  # shards share compiled variants
            continue
        oname = opt_names[oi]
        if dt not in wanted:
            continue
        errs = run_case(2, args.l, h, g, p, n, dt, OPTION_SETS[oname], gen, chunk=args.chunk)
        worst_k = max(errs, key=lambda k: float("inf") if errs[k] != errs[k] else errs[k])
        worst = errs[worst_k]
        ok = worst == worst and worst <= TOL[dt]
        rows.append((p, n, g, str(dt).replace("torch.", ""), oname, worst_k, worst, ok))
        if not ok:
            fails.append((rows[-1], errs))
    print(f"| P | N | g (h={h}) | dtype | options | worst output | rel err | ok |")
    print("|---|---|---|---|---|---|---|---|")
    for p, n, g, dt, o, k, e, ok in rows:
        print(f"| {p} | {n} | {g} | {dt} | {o} | {k} | {e:.2e} | {'ok' if ok else 'FAIL'} |")
    gerr = 0.0
    if shard == 0 and DEV == "cuda":
        gerr = graph_check(args.chunk)
        print(f"CUDA graph capture of fwd+bwd: replay vs eager rel diff {gerr:.1e}")
    for row, errs in fails:
        print("FAILED", row, {k: f"{v:.2e}" for k, v in errs.items()})
    worst_by_dtype = {}
    for p, n, g, dt, o, k, e, ok in rows:
        worst_by_dtype[dt] = max(worst_by_dtype.get(dt, 0.0), e if e == e else float("inf"))
    print("worst rel err by dtype:", {k: f"{v:.2e}" for k, v in worst_by_dtype.items()})
    from kernels.launch import launch_counts

    counts = launch_counts()  # which path the kernels' launches took in this process (kernels.launch)
    print(f"launches: {counts['direct']} direct, {counts['jit']} through Triton's JIT "
          f"(HMSCALE_SSD_LAUNCH={os.environ.get('HMSCALE_SSD_LAUNCH', 'direct')})")
    ok = not fails and gerr < 1e-3
    print(f"{'PASS' if ok else 'FAIL'}: {len(rows) - len(fails)}/{len(rows)} cases within tolerance "
          f"(l={args.l}, b=2, h={h}, chunk {args.chunk}, shard {args.shard}), {time.time() - t0:.0f}s")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
