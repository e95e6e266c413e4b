"""Stage-2 training throughput: HedgeMamba students vs their teacher architecture (SDPA), same engine.

    source .whl/preamble.sh && python benchmarks/train_throughput.py            # H200: 160m and 410m shapes
    python benchmarks/train_throughput.py --smoke                               # CPU: tiny shapes, seconds

Both models train through the stage-2 engine (`hmscale.train.engine.build_engine`: DeepSpeed ZeRO-2,
bf16, torch Adam (no fused-Adam JIT build), gradient clipping 1.0, input embeddings frozen as in stage 2),
world size 1 (local engine), seq 2048, random tokens. Per model: `--warmup` untimed optimizer steps
(Triton compile, allocator warmup), then `--steps` timed ones (CUDA-synchronised wall time).

Reported per model: parameters (all, incl. the frozen embeddings), tokens/s, MFU = 6 x params x tokens/s
/ 800e12 (the bf16 matmul peak measured on the H200), step time, and activation memory per token =
(peak allocated during a step - allocated before it) / tokens per micro batch.
Prints a markdown table and writes JSON (`--out`, default benchmarks/results/train_throughput.json).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from _runinfo import commit  # noqa: E402

PEAK_FLOPS = 800e12


def student_model(flavor: str, vocab: int | None = None, chunk_size: int = 64):
    from hmscale.models.convert import hedgemamba_config_from_teacher
    from hmscale.models.hedgemamba import HedgeMambaForCausalLM
    from hmscale.teacher.flavors import neox_config

    cfg = hedgemamba_config_from_teacher(neox_config(flavor, vocab_size=vocab), chunk_size=chunk_size)
    return HedgeMambaForCausalLM(cfg)


def teacher_model(flavor: str, vocab: int | None = None):
    from transformers import GPTNeoXForCausalLM

    from hmscale.teacher.flavors import neox_config

    cfg = neox_config(flavor, vocab_size=vocab)
    cfg._attn_implementation = "sdpa"
    return GPTNeoXForCausalLM(cfg)


def bench(name: str, model, *, seq: int, micro_batch: int, steps: int, warmup: int, device, bf16: bool, vocab: int,
          profile: bool = False, compile_blocks: bool = False, sync_debug: bool = False,
          ds_config: str | None = None, cuda_graphs: bool = False, zero_stage: int = 2, phases: bool = False,
          grad_checks: str = "hmscale", grad_buckets: bool = True, compile_mode: str | None = None, adam: str = "auto",
          fused_ce: bool | None = None, kd_topk: int = 0, gaps: bool = False, lora_rank: int = 0) -> dict:
    from hmscale.train.engine import OptimSpec, build_engine
    from hmscale.train.stage2 import apply_stage2_lora, causal_lm_losses, freeze_embeddings

    n_params = sum(p.numel() for p in model.parameters())
    freeze_embeddings(model)
    if lora_rank:  # stage2.lora_rank: adapters on the mixers' in_proj / out_proj, every teacher weight frozen
        apply_stage2_lora(model, SimpleNamespace(lora_targets=["in_proj", "out_proj"], lora_rank=lora_rank,
                                                 lora_alpha=2.0 * lora_rank))
    model.to(device)
    if compile_blocks:
        from hmscale.parallel import apply_compile

        apply_compile(model, mode=compile_mode)
    spec = OptimSpec(lr=1e-4, micro_batch_size=micro_batch, grad_accum=1, warmup_steps=0, total_steps=steps + warmup,
                     zero_stage=zero_stage, bf16=bf16, adam=adam, ds_config=ds_config)
    engine = build_engine(model, spec, dp_world=1, foreach_grad_checks=grad_checks != "deepspeed",
                          grad_buckets=grad_buckets)
    if grad_checks == "two-pass":  # zero_foreach's foreach flag and norm, each read by DeepSpeed's step
        for name_ in ("has_overflow", "scaled_global_norm"):
            engine.optimizer.__dict__.pop(name_, None)
    if cuda_graphs:  # the student's blocks only (hmscale.parallel.apply_cuda_graphs)
        from hmscale.parallel import apply_cuda_graphs

        apply_cuda_graphs(engine.module, micro_batch, seq)
    gen = torch.Generator(device="cpu").manual_seed(0)
    cuda = device.type == "cuda"

    def kd_batch():  # random cached-teacher top-k at every position (stage 2's KD term, weight 0.5)
        if not kd_topk:
            return {}, 0.0
        ids = torch.randint(0, vocab, (micro_batch, seq, kd_topk), generator=gen).to(device)
        lp = torch.log_softmax(torch.randn(micro_batch, seq, kd_topk, generator=gen), -1).to(device, torch.bfloat16)
        return {"topk_ids": ids, "topk_logprobs": lp}, 0.5

    from torch.profiler import record_function  # names the phases in a trace (--gaps); a no-op otherwise

    def step():
        x = torch.randint(0, vocab, (micro_batch, seq), generator=gen).to(device)
        kd, w = kd_batch()
        with record_function("hmscale:forward"):
            # no generation cache in training (HF's DynamicCache would also make compile guard on every layer)
            loss, _ = causal_lm_losses(engine(input_ids=x, use_cache=False).logits, x, kd, w, fused_ce=fused_ce)
        with record_function("hmscale:backward"):
            engine.backward(loss)
        with record_function("hmscale:step"):
            engine.step()
        return loss

    for _ in range(warmup):
        step()
    phase_ms = None
    if phases:  # one extra step with the device drained between its phases: where the step's wall time goes
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        x = torch.randint(0, vocab, (micro_batch, seq), generator=gen).to(device)
        sync()
        t = [time.perf_counter()]
        loss, _ = causal_lm_losses(engine(input_ids=x, use_cache=False).logits, x, {}, 0.0, fused_ce=fused_ce)
        sync()
        t.append(time.perf_counter())
        engine.backward(loss)
        sync()
        t.append(time.perf_counter())
        if profile and cuda:  # what the optimizer step spends its time on, host and device
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as torch_profile

            with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as step_prof:
                engine.step()
                sync()
        else:
            engine.step()
            sync()
        t.append(time.perf_counter())
        if profile and cuda:
            print(f"\noptimizer step of {name}, by host time:")
            print(step_prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=70))
            print(f"\noptimizer step of {name}, by device time:")
            print(step_prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=70))
        phase_ms = {k: 1e3 * (b - a) for k, a, b in zip(("forward", "backward", "step"), t, t[1:])}
        print(f"{name}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in phase_ms.items()), flush=True)
    if sync_debug and cuda:  # one step with every host<->device synchronisation reported (with its stack)
        import traceback
        import warnings

        seen = []

        def record(message, category, filename, lineno, file=None, line=None):
            frames = [f for f in traceback.extract_stack()[:-2] if "/torch/" not in f.filename][-3:]
            seen.append((str(message).splitlines()[0][:100], [f"{f.filename}:{f.lineno}" for f in frames]))

        torch.cuda.synchronize()
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            torch.cuda.set_sync_debug_mode("warn")
            step()
            torch.cuda.set_sync_debug_mode("default")
        print(f"\n{name}: {len(seen)} synchronising calls in one step")
        for msg, where in seen[:20]:
            print(f"  {msg} at {' <- '.join(reversed(where))}")
    if gaps:  # one step traced twice: GPU idle time charged to the host's torch ops, then to its Python frames
        import tempfile

        from gpu_gaps import load_events, report  # benchmarks/gpu_gaps.py, beside this script
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        for with_stack, cats in ((False, ("user_annotation", "cpu_op")), (True, ("user_annotation", "python_function"))):
            if cuda:
                torch.cuda.synchronize()
            with torch_profile(activities=acts, with_stack=with_stack) as gap_prof:
                step()
                if cuda:
                    torch.cuda.synchronize()
            with tempfile.TemporaryDirectory() as tmp:
                trace = Path(tmp) / "trace.json"
                gap_prof.export_chrome_trace(str(trace))
                events = load_events(trace)
            where = "Python frames (traced: host time inflated)" if with_stack else "torch ops"
            print("\n" + report(events, top=40 if with_stack else 25, cats=cats,
                                title=f"GPU idle in one step of {name}, charged to {where}"), flush=True)
    if profile and cuda:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        print(f"\nper-kernel CUDA time, one step of {name}:")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=60))
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    if cuda:
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    tokens = steps * micro_batch * seq
    tps = tokens / dt
    # a graphed run's activations live in the graphs' private pool, allocated at capture: not seen here
    # (the same for compile mode reduce-overhead: torch's CUDA-graph trees keep the blocks' tensors in their pool)
    graphed = cuda_graphs or compile_mode == "reduce-overhead"
    act = (torch.cuda.max_memory_allocated() - base) / (micro_batch * seq) if cuda and not graphed else None
    out = {"model": name, "params": n_params, "seq": seq, "micro_batch": micro_batch, "steps": steps,
           # MFU's 6 x params counts every weight's gradient: not what a LoRA step computes (no MFU for it)
           "step_ms": 1e3 * dt / steps, "tokens_per_s": tps, "mfu": None if lora_rank else 6 * n_params * tps / PEAK_FLOPS,
           "act_bytes_per_token": act, "final_loss": float(loss)}
    if phase_ms is not None:
        out["phase_ms"] = phase_ms
    del engine, model
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU smoke run with tiny shapes")
    ap.add_argument("--flavors", default="pythia-160m,pythia-410m")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-teacher", action="store_true")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="capture the student's blocks as CUDA graphs (hmscale.parallel.apply_cuda_graphs; GPU)")
    ap.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=2,
                    help="DeepSpeed ZeRO stage of both models (default 2; --cuda-graphs needs 0)")
    ap.add_argument("--ds-config", default=None,
                    help="a DeepSpeed JSON instead of ds_configs/zero2.json (e.g. to try other ZeRO bucket settings)")
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile every block of both models (hmscale.parallel.apply_compile)")
    ap.add_argument("--compile-mode", choices=("default", "reduce-overhead", "max-autotune-no-cudagraphs"),
                    default="default", help="with --compile: torch.compile's mode for both models' blocks "
                    "(reduce-overhead: each block's graphs replayed as CUDA graphs)")
    ap.add_argument("--grad-checks", default="hmscale",
                    help="ZeRO-1/2 gradient norm and overflow check, comma-separated, each model trained once per entry "
                         "in order: hmscale (hmscale.train.zero_foreach: one norm decides the overflow check, one host "
                         "read per step; the default), two-pass (its foreach overflow flag and foreach norm, each read "
                         "by DeepSpeed's step: two host reads) or deepspeed (its per-tensor loops)")
    ap.add_argument("--grad-buckets", default="hmscale",
                    help="ZeRO-1/2 gradient bucketing, comma-separated, each model trained once per entry in order "
                         "(e.g. hmscale,deepspeed,hmscale,deepspeed for an alternating A/B): hmscale "
                         "(hmscale.train.zero_buckets: a few tensor ops per bucket, the default) or deepspeed (its "
                         "per-tensor hook code)")
    ap.add_argument("--adam", default="auto",
                    help="Adam implementation(s), comma-separated, each model trained once per entry: auto (what "
                         "stage 2 runs: torch's fused AdamW on a GPU), fused, foreach (torch's Adam as DeepSpeed "
                         "builds it), deepspeed (hmscale.train.engine.resolve_adam)")
    ap.add_argument("--ce", choices=("auto", "fused", "rows"), default="auto",
                    help="the loss: auto (what stage 2 runs: the Triton cross-entropy kernel on a GPU), fused, or rows "
                         "(F.cross_entropy one sequence at a time under activation checkpointing)")
    ap.add_argument("--kd-topk", type=int, default=0,
                    help="add stage 2's KD term against k random cached teacher log-probs per position (weight 0.5)")
    ap.add_argument("--lora-rank", type=int, default=0,
                    help="the student as stage2.lora_rank=R trains it (adapters on in_proj / out_proj, teacher weights "
                         "frozen); tokens/s only (no MFU)")
    ap.add_argument("--sync-debug", action="store_true", help="report the host-device synchronisations of one step")
    ap.add_argument("--profile", action="store_true", help="print a per-kernel CUDA time table of one step per model")
    ap.add_argument("--gaps", action="store_true",
                    help="trace one step per model and print where the GPU sat idle, charged to the host's torch ops "
                         "and Python frames running meanwhile (benchmarks/gpu_gaps.py)")
    ap.add_argument("--phases", action="store_true",
                    help="time forward, backward and optimizer step of one extra step, the device drained between them "
                         "(with --profile also a host and device profile of that optimizer step)")
    ap.add_argument("--out", default=None,
                    help="JSON path (default benchmarks/results/train_throughput.json; none with --smoke)")
    args = ap.parse_args(argv)
    os.environ.setdefault("HMSCALE_NO_PROGRESS", "1")
    if args.compile_mode != "default" and not args.compile:
        ap.error("--compile-mode needs --compile")
    if args.cuda_graphs and args.zero_stage != 0:
        ap.error("--cuda-graphs needs --zero-stage 0 (the capture fails under DeepSpeed's ZeRO-1/2 optimizer)")

    from hmscale.train.engine import ADAM_CHOICES, init_distributed

    adams = args.adam.split(",")
    if any(a not in ADAM_CHOICES for a in adams):
        ap.error(f"--adam: {args.adam!r}; use entries of {', '.join(ADAM_CHOICES)}")
    checks = args.grad_checks.split(",")
    if any(c not in ("hmscale", "two-pass", "deepspeed") for c in checks):
        ap.error(f"--grad-checks: {args.grad_checks!r}; use entries of hmscale, two-pass, deepspeed")
    buckets = args.grad_buckets.split(",")
    if any(b not in ("hmscale", "deepspeed") for b in buckets):
        ap.error(f"--grad-buckets: {args.grad_buckets!r}; use entries of hmscale, deepspeed")

    if args.smoke:
        flavors, seq, mb, steps, warmup, vocab, bf16 = ["pythia-nano"], 64, 2, 2, 1, 512, False
        device = torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            print("train_throughput: no CUDA device; use --smoke on CPU", file=sys.stderr)
            return 2
        flavors, seq, mb, steps, warmup, vocab, bf16 = (args.flavors.split(","), args.seq, args.micro_batch,
                                                        args.steps, args.warmup, None, True)
        device = torch.device("cuda", 0)
    init_distributed(use_gpu=device.type == "cuda")
    rows = []
    t_all = time.perf_counter()
    for flavor in flavors:
        from hmscale.teacher.flavors import get_flavor

        v = vocab or get_flavor(flavor).vocab_size
        suffix = (" compiled" + ("" if args.compile_mode == "default" else f" ({args.compile_mode})")) if args.compile else ""
        pairs = [("hedgemamba", student_model)] + ([] if args.no_teacher else [("teacher-sdpa", teacher_model)])
        runs = [(pair, c, a, b) for pair in pairs for c in checks for a in adams for b in buckets]
        for (kind, make), check, adam, bucket in runs:
            torch.manual_seed(0)
            try:
                graphs = args.cuda_graphs and kind == "hedgemamba"
                name = (f"{flavor} {kind}{suffix}{' cuda-graphs' if graphs else ''}"
                        f"{'' if check == 'hmscale' else f' checks={check}'}{'' if bucket == 'hmscale' else ' deepspeed-buckets'}"
                        f"{'' if adams == ['auto'] else f' adam={adam}'}"
                        f"{'' if args.ce == 'auto' else f' ce={args.ce}'}{f' kd-top{args.kd_topk}' if args.kd_topk else ''}"
                        f"{f' lora-r{args.lora_rank}' if args.lora_rank and kind == 'hedgemamba' else ''}")
                r = bench(name, make(flavor, v), seq=seq, micro_batch=mb, steps=steps, warmup=warmup,
                          device=device, bf16=bf16, vocab=v, profile=args.profile,
                          compile_blocks=args.compile, sync_debug=args.sync_debug, ds_config=args.ds_config,
                          cuda_graphs=graphs, zero_stage=args.zero_stage, phases=args.phases,
                          grad_checks=check, grad_buckets=bucket == "hmscale", adam=adam,
                          fused_ce={"auto": None, "fused": True, "rows": False}[args.ce], kd_topk=args.kd_topk,
                          gaps=args.gaps, lora_rank=args.lora_rank if kind == "hedgemamba" else 0,
                          compile_mode=None if args.compile_mode == "default" else args.compile_mode)
            except torch.OutOfMemoryError as err:  # record it and go on with the next model
                gc.collect()
                torch.cuda.empty_cache()
                r = {"model": f"{flavor} {kind}", "error": f"out of memory: {str(err).splitlines()[0]}"}
                print(json.dumps(r), flush=True)
                rows.append(r)
                continue
            rows.append(r)
            print(json.dumps(r), flush=True)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": commit(), "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "seconds": time.perf_counter() - t_all, "smoke": args.smoke,
            "command": "python benchmarks/train_throughput.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    out = args.out or (None if args.smoke else str(REPO / "benchmarks" / "results" / "train_throughput.json"))
    if out:  # a smoke run leaves the recorded results alone
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"\n{meta['date']}, commit {meta['commit']}, {meta['device']}, torch {meta['torch']}, {meta['seconds']:.0f} s: `{meta['command']}`\n")
    print("| model | params | seq x micro batch | step | tokens/s | MFU | activations / token |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['model']} | {r['error']} | | | | | |")
            continue
        act = (f"{r['act_bytes_per_token'] / 1024:.1f} KiB" if r["act_bytes_per_token"] is not None
               else "n/a (graph pool)" if ("cuda-graphs" in r["model"] or "reduce-overhead" in r["model"]) else "n/a (CPU)")
        mfu = "n/a (LoRA)" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        print(f"| {r['model']} | {r['params'] / 1e6:.1f} M | {r['seq']} x {r['micro_batch']} | {r['step_ms']:.1f} ms "
              f"| {r['tokens_per_s']:,.0f} | {mfu} | {act} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
