"""Multi-GPU scaling on one machine: stage-2 training (ZeRO-2 data parallel, tp=2 x dp) and teacher caching.

    source .whl/preamble.sh && python benchmarks/multi_gpu.py --part train   # every GPU of the machine
    source .whl/preamble.sh && python benchmarks/multi_gpu.py --part cache
    python benchmarks/multi_gpu.py --smoke                                   # CPU: 2 gloo processes, tiny shapes
                                                                             # (no JSON unless --out)

Training: every configuration runs the product's stage-2 path (`hmscale.train.stage2.run_stage2`:
process layout, tensor-parallel sharding, DeepSpeed ZeRO-2, the deterministic batch plan, the
all-reduced loss) in N freshly spawned processes (`hmscale.train.launch.spawn_workers`, the launcher of
`parallel.engine=local` with several workers: one per GPU, NCCL; gloo on CPU), on a random-init
Pythia-410m-shaped HedgeMamba student and random tokens, with the same global batch everywhere:

    1gpu       world 1, grad_accum N                   (the reference)
    dp         world N, ZeRO-2, grad_accum 1
    tp2        world N, tp=2, dp=N/2, micro batch x 2  (the memory tp frees buys the larger micro batch)
    tp2_ga     world N, tp=2, dp=N/2, grad_accum 2     (the same micro batch as the others)

Throughput: tokens per optimizer step / median step time of the steps after `--skip` (the compile and
allocator warm-up), per GPU. Scaling efficiency = per-GPU tokens/s of dp=N / tokens/s of 1 GPU (target
>= 90 %); tp=2 per-GPU / dp=N per-GPU (target >= 85 %). Loss equality: the same three runs in fp32 at
`--fp32-seq`, per-step losses against the 1-GPU run (target max |diff| <= 1e-4); the bf16 runs' diffs
are printed next to the noise between two identical 1-GPU bf16 runs. Checkpoint writes are switched off
(they would time the disk).

Caching: `build_cache` with the local engine on 1 GPU and on N GPUs (`devices`: one spawned process per
GPU, `hmscale.teacher.cache.multiproc`), a Pythia-160m-shaped teacher (random weights), shards/s
against one GPU (target >= 90 % linear), for the full capture spec and a light one (fp8, three layers,
10 % of positions). Both run in spawned worker processes (`processes=True`); shards/s counts from the
moment every worker is ready (teacher on its device, pinned buffers reserved) to the last shard; the
start-up time is printed beside it.

Communication (`--part comm`): bf16 all-reduce time and NCCL bus bandwidth between the GPUs (what
tensor parallelism pays per layer).

Writes JSON (`--out`) and prints markdown tables.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from _runinfo import header  # noqa: E402


# ----------------------------------------------------------------------------------------- training


def training_overrides(run: dict, world: int, out_dir: str) -> list[str]:
    """The config overrides of one training configuration."""
    gpu = run["gpu"]
    graphs = bool(run.get("cuda_graphs")) and gpu and run["tp"] == 1
    return [
        "parallel.engine=local", f"parallel.use_gpu={gpu}", f"parallel.bf16={run['bf16']}",
        f"parallel.zero_stage={0 if graphs else 2}",  # CUDA graphs need ZeRO-0 (see parallel.cuda_graphs)
        f"parallel.tp={run['tp']}", f"parallel.num_workers={world}", "parallel.checkpoint_every=1000000",
        f"parallel.compile={run.get('compile', False)}",
        f"parallel.cuda_graphs={graphs}",
        *([f"parallel.ds_config={run['ds_config']}"] if run.get("ds_config") else []),
        f"stage2.micro_batch_size={run['micro_batch']}", f"stage2.grad_accum={run['grad_accum']}",
        f"stage2.steps={run['steps']}", "stage2.warmup_steps=2", "stage2.kd_weight=0", "stage2.lr=3e-4",
        f"output_dir={out_dir}", "seed=0",
    ]


def _train_rank(rank: int, run: dict, out_dir: str) -> None:
    """One process of one configuration (spawned by `hmscale.train.launch.spawn_workers`)."""
    world = int(os.environ["WORLD_SIZE"])
    gpu = run["gpu"]
    if not gpu:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    from hmscale.config import build_config
    from hmscale.models.convert import hedgemamba_config_from_teacher
    from hmscale.models.hedgemamba import HedgeMambaForCausalLM
    from hmscale.teacher.flavors import neox_config
    from hmscale.train import engine as E
    from hmscale.train.data import ArraySource
    from hmscale.train.stage2 import run_stage2

    E.Checkpointer.save = lambda self, *a, **k: None  # no checkpoint writes: they would time the disk
    cfg = build_config({}, training_overrides(run, world, out_dir))
    cfg._progress = False
    device = torch.device("cuda", rank) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    mcfg = hedgemamba_config_from_teacher(neox_config(run["flavor"], vocab_size=run["vocab"]), chunk_size=64)
    with device:  # the same seed on every rank: the same full model, then sharded for tp
        model = HedgeMambaForCausalLM(mcfg)
    global_batch = run["micro_batch"] * run["grad_accum"] * (world // run["tp"])
    tokens = np.random.default_rng(0).integers(0, run["vocab"], size=(global_batch * run["steps"], run["seq"]))
    hook, prof = None, None
    if run.get("profile") and rank == 0:  # one optimizer step (after the warm-up) under the profiler
        from torch.profiler import ProfilerActivity, profile, schedule

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
        at = max(0, min(run["skip"], run["steps"] - 3))  # a later step closes the active window
        def save(pr):
            ka = pr.key_averages()
            text = ka.table(sort_by="cuda_time_total" if gpu else "cpu_time_total", row_limit=30, max_name_column_width=70)
            text += "\n" + ka.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=70)
            Path(out_dir, "profile.txt").write_text(text)

        prof = profile(activities=acts, schedule=schedule(wait=at, warmup=1, active=1), on_trace_ready=save)
        prof.start()
        hook = lambda step: prof.step()  # noqa: E731 - called at the start of every step
    res = run_stage2(cfg, out_dir, model=model, source=ArraySource(tokens.astype(np.int32)), export=False,
                     fault_hook=hook)
    if prof is not None:
        prof.stop()
    peak = torch.cuda.max_memory_allocated(device) if gpu else 0
    stats = {"rank": rank, "peak_bytes": int(peak)}
    if rank == 0:
        stats.update(losses=res["losses"], tokens=res["tokens"], seconds=res["seconds"], dp=res["dp"], tp=res["tp"])
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(stats))


def run_training(name: str, world: int, run: dict, work: Path) -> dict:
    """Spawn `world` processes for one configuration; returns its losses and throughput."""
    out_dir = work / name
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    t0 = time.perf_counter()
    from hmscale.train.launch import spawn_workers

    spawn_workers(_train_rank, world, run, str(out_dir), use_gpu=run["gpu"])
    wall = time.perf_counter() - t0
    ranks = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world)]
    steps = [json.loads(line) for line in (out_dir / "stage2" / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "step_seconds" in s]
    skip = min(run["skip"], len(steps) - 1)
    step_s = statistics.median(s["step_seconds"] for s in steps[skip:])
    tokens_per_step = run["micro_batch"] * run["grad_accum"] * (world // run["tp"]) * run["seq"]
    tps = tokens_per_step / step_s
    r0 = ranks[0]
    if (out_dir / "profile.txt").exists():
        print(f"\n--- profile of one step of {name} (rank 0) ---\n" + (out_dir / "profile.txt").read_text(), flush=True)
    out = {"name": name, "world": world, "tp": r0["tp"], "dp": r0["dp"], "grad_accum": run["grad_accum"],
           "micro_batch": run["micro_batch"], "seq": run["seq"], "bf16": run["bf16"], "tokens_per_step": tokens_per_step,
           "median_step_s": step_s, "tokens_per_s": tps, "tokens_per_s_per_gpu": tps / world,
           "peak_gib_per_gpu": max(r["peak_bytes"] for r in ranks) / 2**30, "losses": r0["losses"], "wall_s": wall}
    print(f"  {name}: world {world} (tp {out['tp']} x dp {out['dp']}, grad_accum {run['grad_accum']}): "
          f"{step_s * 1e3:.1f} ms/step, {tps:,.0f} tok/s, {tps / world:,.0f} tok/s/GPU, "
          f"peak {out['peak_gib_per_gpu']:.1f} GiB/GPU, final loss {r0['losses'][-1]:.5f}, {wall:.0f} s", flush=True)
    return out


def max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


def training_part(args, n: int, gpu: bool, work: Path) -> dict:
    base = dict(flavor=args.flavor, vocab=args.vocab, seq=args.seq, micro_batch=args.micro_batch, steps=args.steps,
                skip=args.skip, gpu=gpu, bf16=gpu and not args.fp32_only, profile=args.profile,
                compile=args.compile, cuda_graphs=args.cuda_graphs, ds_config=args.ds_config)
    tp = 2 if n % 2 == 0 else 1
    want = set(args.runs.split(",")) if args.runs else None
    runs = {}

    def go(name, world, run):
        if want is None or name in want:
            runs[name] = run_training(name, world, run, work)

    print(f"training: {args.flavor}-shaped student, {n} {'GPUs' if gpu else 'CPU processes'}, seq {args.seq}, "
          f"micro batch {args.micro_batch}, global batch {args.micro_batch * n}, {args.steps} steps", flush=True)
    # tp=2 x dp=n/2 keeps the global batch: micro batch x 2 (the memory tp frees), or grad_accum 2 (tp2_ga)
    if not args.fp32_only:
        go("1gpu", 1, dict(base, tp=1, grad_accum=n))
        go("dp", n, dict(base, tp=1, grad_accum=1))
        if tp == 2:
            go("tp2", n, dict(base, tp=2, grad_accum=1, micro_batch=2 * args.micro_batch))
            go("tp2_ga", n, dict(base, tp=2, grad_accum=2))
        if base["bf16"]:
            go("1gpu_repeat", 1, dict(base, tp=1, grad_accum=n))
    f32 = dict(base, bf16=False, seq=args.fp32_seq, micro_batch=args.fp32_micro_batch)
    if gpu:
        print(f"fp32 loss equality: seq {args.fp32_seq}, micro batch {args.fp32_micro_batch}", flush=True)
        go("fp32_1gpu", 1, dict(f32, tp=1, grad_accum=n))
        go("fp32_dp", n, dict(f32, tp=1, grad_accum=1))
        if tp == 2:
            go("fp32_tp2", n, dict(f32, tp=2, grad_accum=1, micro_batch=2 * args.fp32_micro_batch))
    summary = {}

    def diff(key, a, b):
        if a in runs and b in runs:
            summary[key] = max_diff(runs[a]["losses"], runs[b]["losses"])

    if "1gpu" in runs and "dp" in runs:
        summary["dp_scaling_efficiency"] = runs["dp"]["tokens_per_s_per_gpu"] / runs["1gpu"]["tokens_per_s"]
    for t in ("tp2", "tp2_ga"):
        if t in runs and "dp" in runs:
            summary[f"{t}_vs_dp_per_gpu"] = runs[t]["tokens_per_s_per_gpu"] / runs["dp"]["tokens_per_s_per_gpu"]
    diff("loss_diff_dp", "dp", "1gpu")
    diff("loss_diff_tp2", "tp2", "1gpu")
    diff("loss_diff_tp2_ga", "tp2_ga", "1gpu")
    diff("loss_noise_1gpu", "1gpu_repeat", "1gpu")
    diff("fp32_loss_diff_dp", "fp32_dp", "fp32_1gpu")
    diff("fp32_loss_diff_tp2", "fp32_tp2", "fp32_1gpu")
    rows = [r for r in runs.values()]
    print("\n| run | world | tp x dp | grad accum | precision | seq x micro | ms/step | tok/s | tok/s per GPU | peak GiB/GPU | final loss |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['name']} | {r['world']} | {r['tp']} x {r['dp']} | {r['grad_accum']} | {'bf16' if r['bf16'] else 'fp32'} "
              f"| {r['seq']} x {r['micro_batch']} | {r['median_step_s'] * 1e3:.1f} | {r['tokens_per_s']:,.0f} "
              f"| {r['tokens_per_s_per_gpu']:,.0f} | {r['peak_gib_per_gpu']:.1f} | {r['losses'][-1]:.6f} |")
    print()
    for k, v in summary.items():
        print(f"{k}: {v:.6g}")
    if "dp_scaling_efficiency" in summary:
        print(f"data-parallel scaling efficiency {100 * summary['dp_scaling_efficiency']:.1f} % (target >= 90 %)")
    for t in ("tp2", "tp2_ga"):
        if f"{t}_vs_dp_per_gpu" in summary:
            print(f"{t}: per-GPU throughput {100 * summary[f'{t}_vs_dp_per_gpu']:.1f} % of data parallel (target >= 85 %)")
    if "fp32_loss_diff_dp" in summary:
        worst = max(v for k, v in summary.items() if k.startswith("fp32_loss_diff"))
        print(f"fp32 losses over {args.steps} steps: max |diff| vs 1 GPU {worst:.3g} (target <= 1e-4)")
    return {"runs": runs, "summary": summary}


# ------------------------------------------------------------------------------------ communication


def _comm_rank(rank: int, sizes_mb: list, gpu: bool, out_dir: str) -> None:
    import torch.distributed as dist

    world = int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", rank) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if gpu else "gloo", rank=rank, world_size=world)
    rows = []
    for mb in sizes_mb:
        x = torch.randn(int(mb * 2**20) // 2, dtype=torch.bfloat16, device=device)
        for _ in range(3):
            dist.all_reduce(x)
        if gpu:
            torch.cuda.synchronize()
        reps = 20
        t0 = time.perf_counter()
        for _ in range(reps):
            dist.all_reduce(x)
        if gpu:
            torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / reps
        # NCCL's "bus bandwidth": 2 (n-1)/n x bytes / time
        rows.append({"mb": mb, "ms": dt * 1e3, "bus_gb_s": 2 * (world - 1) / world * x.numel() * 2 / dt / 1e9})
    if rank == 0:
        Path(out_dir, "comm.json").write_text(json.dumps(rows))
    dist.destroy_process_group()


def comm_part(args, n: int, gpu: bool, work: Path) -> list:
    """bf16 all-reduce time and bus bandwidth over the n devices (NCCL on GPUs)."""
    sizes = [1, 8, 32, 256] if not args.smoke else [1]
    from hmscale.train.launch import spawn_workers

    spawn_workers(_comm_rank, n, sizes, gpu, str(work), use_gpu=gpu)
    rows = json.loads((work / "comm.json").read_text())
    print(f"\nall-reduce, bf16, {n} {'GPUs (NCCL)' if gpu else 'CPU processes (gloo)'}:")
    for r in rows:
        print(f"  {r['mb']:>4} MiB: {r['ms']:.3f} ms, bus bandwidth {r['bus_gb_s']:.1f} GB/s", flush=True)
    return rows


# ------------------------------------------------------------------------------------------ caching


def cache_part(args, n: int, gpu: bool, work: Path) -> dict:
    from hmscale.config import build_config
    from hmscale.data.plan import ShardPlan
    from hmscale.teacher.cache import build_cache, verify_cache
    from hmscale.teacher.flavors import neox_config
    from transformers import GPTNeoXForCausalLM

    flavor = args.cache_flavor
    seq = args.cache_seq
    per_shard = args.sequences_per_shard
    shards = args.cache_shards
    vocab = args.vocab
    tokens = np.random.default_rng(0).integers(1, vocab, size=shards * per_shard * seq).astype(np.int32)
    doc_lens = np.full(len(tokens) // seq, seq, dtype=np.int64)
    plan = ShardPlan(tokens, doc_lens, seq, per_shard, source="random-multi-gpu")
    data = type("Data", (), {"plan": plan, "vocab_size": vocab, "eos_id": 0})()
    torch.manual_seed(0)
    tcfg = neox_config(flavor, vocab_size=vocab)
    tcfg._attn_implementation = "sdpa"
    teacher = GPTNeoXForCausalLM(tcfg).eval()
    if gpu:
        teacher = teacher.to(torch.bfloat16)
    specs = {"full": [], "light": ["cache.capture.dtype=fp8_e4m3", "cache.capture.layers=[0,5,11]",
                                   "cache.capture.token_fraction=0.1"]}
    if args.smoke:
        specs = {"full": []}
    if args.cache_specs:
        specs = {k: v for k, v in specs.items() if k in args.cache_specs.split(",")}
    devices_n = [f"cuda:{i}" for i in range(n)] if gpu else ["cpu"] * n
    out = {}
    print(f"\ncaching: {flavor}-shaped teacher, {shards} shards x {per_shard} sequences x {seq} tokens, "
          f"1 vs {n} {'GPUs' if gpu else 'CPU processes'}", flush=True)
    for spec_name, items in specs.items():
        res = {}
        for label, devices in (("1", devices_n[:1]), (str(n), devices_n)):
            root = work / f"cache-{spec_name}-{label}"
            shutil.rmtree(root, ignore_errors=True)
            cfg = build_config({}, [f"cache.root={root}", f"cache.batch_size={args.cache_batch}",
                                    f"cache.max_tokens={len(tokens)}", f"cache.workers={n}", "cache.allow_exceed_disk=true",
                                    *items])
            ready = []

            def log(msg, ready=ready):
                if "workers ready" in msg:
                    ready.append(time.perf_counter())

            t0 = time.perf_counter()
            path = build_cache(cfg, data, teacher, engine="local", devices=devices, processes=True, log=log)
            t1 = time.perf_counter()
            work_s = t1 - (ready[0] if ready else t0)
            size = sum(p.stat().st_size for p in path.iterdir())
            ok = verify_cache(path).ok
            res[label] = {"devices": devices, "seconds": t1 - t0, "startup_s": (ready[0] - t0) if ready else None,
                          "work_s": work_s, "shards_per_s": shards / work_s, "bytes": size, "verified": ok}
            print(f"  {spec_name} spec, {len(devices)} worker(s): {t1 - t0:.1f} s ({res[label]['startup_s'] or 0:.1f} s "
                  f"starting), {shards / work_s:.2f} shards/s after the start, {size / work_s / 1e9:.2f} GB/s written, "
                  f"verified {ok}", flush=True)
            shutil.rmtree(root, ignore_errors=True)
        eff = res[str(n)]["shards_per_s"] / (n * res["1"]["shards_per_s"])
        res["linear_fraction"] = eff
        print(f"  {spec_name} spec: {n} workers = {100 * eff:.1f} % of linear (target >= 90 %)", flush=True)
        out[spec_name] = res
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=["train", "cache", "comm", "all"], default="all")
    ap.add_argument("--smoke", action="store_true", help="CPU, 2 gloo processes, tiny shapes (seconds)")
    ap.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: all)")
    ap.add_argument("--flavor", default="pythia-410m")
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--skip", type=int, default=5, help="steps left out of the median step time")
    ap.add_argument("--fp32-seq", type=int, default=1024)
    ap.add_argument("--fp32-micro-batch", type=int, default=2)
    ap.add_argument("--fp32-only", action="store_true", help="only the fp32 loss-equality runs")
    ap.add_argument("--compile", action="store_true",
                    help="parallel.compile=true for every training run (blocks under torch.compile)")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="parallel.cuda_graphs=true (and ZeRO-0) for the runs without tensor parallelism (GPU)")
    ap.add_argument("--ds-config", default=None,
                    help="a DeepSpeed JSON for every training run instead of ds_configs/zero2.json (e.g. overlap_comm; "
                         "its ZeRO stage wins; not with --cuda-graphs)")
    ap.add_argument("--profile", action="store_true", help="print a profile of one step (rank 0) of each run")
    ap.add_argument("--runs", default=None, help="comma list of runs to do (default all): 1gpu,dp,tp2,tp2_ga,"
                    "1gpu_repeat,fp32_1gpu,fp32_dp,fp32_tp2")
    ap.add_argument("--cache-flavor", default="pythia-160m")
    ap.add_argument("--cache-seq", type=int, default=2048)
    ap.add_argument("--cache-shards", type=int, default=32)
    ap.add_argument("--sequences-per-shard", type=int, default=16)
    ap.add_argument("--cache-batch", type=int, default=8)
    ap.add_argument("--cache-specs", default=None, help="comma list of capture specs (default: full,light)")
    ap.add_argument("--work", default=None, help="scratch directory (default: a temporary one)")
    ap.add_argument("--out", default=None,
                    help="JSON path (default benchmarks/results/multi_gpu.json; none with --smoke)")
    args = ap.parse_args(argv)
    if args.ds_config and args.cuda_graphs:
        ap.error("--ds-config and --cuda-graphs: the graphs need ZeRO-0, the file sets its own stage; use one")

    gpu = torch.cuda.is_available() and not args.smoke
    if args.smoke:
        args.flavor, args.vocab, args.seq, args.micro_batch, args.steps, args.skip = "pythia-nano", 256, 64, 2, 4, 1
        args.cache_flavor, args.cache_seq, args.cache_shards, args.sequences_per_shard, args.cache_batch = (
            "pythia-nano", 32, 4, 2, 2)
    if not gpu and not args.smoke:
        print(f"multi_gpu: needs 2 or more CUDA GPUs and torch sees none here (torch {torch.__version__}); "
              "--smoke runs its paths on the CPU (2 gloo processes, tiny shapes)", file=sys.stderr)
        return 2
    out = args.out or (None if args.smoke else str(REPO / "benchmarks" / "results" / "multi_gpu.json"))
    n = args.gpus or (torch.cuda.device_count() if gpu else 2)
    if gpu and n < 2:
        print(f"multi_gpu: this machine has {n} GPU; the benchmark needs 2 or more (or --smoke on CPU)", file=sys.stderr)
        return 2
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="hmscale-multi-gpu-"))
    work.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name(0) if gpu else "CPU"
    print(header("cuda" if gpu else "cpu"), flush=True)
    print(f"multi_gpu: {n} x {device}, torch {torch.__version__}, "
          f"NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')}", flush=True)
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": device, "n": n,
              "argv": sys.argv[1:]}
    try:
        if args.part in ("comm", "all"):
            result["comm"] = comm_part(args, n, gpu, work)
        if args.part in ("train", "all"):
            result["train"] = training_part(args, n, gpu, work)
        if args.part in ("cache", "all"):
            result["cache"] = cache_part(args, n, gpu, work)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=1))
        print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
