"""Teacher-cache throughput: caching a Pythia-160m-shaped teacher (random weights) vs its forward alone.

    python benchmarks/cache_throughput.py                      # CUDA when available, else a CPU smoke run
    python benchmarks/cache_throughput.py --device cuda --tokens 131072 --layers all
    python benchmarks/cache_throughput.py --smoke              # tiny CPU run (seconds), checks the script works

Prints tokens/s for (1) the plain teacher forward (logits), (2) the forward with the capture hooks,
no writing, (3) the full cache path of the local engine (capture, encode to the storage dtype,
device->host, tar + sha256, fsync, rename), the overhead of (3) over (1), bytes/token, and the
write rate. The shards go to a temporary directory (or --out) that is removed afterwards
unless --keep; a final `verify_cache` re-reads and checks everything.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hmscale.config import build_config  # noqa: E402
from hmscale.data.plan import ShardPlan  # noqa: E402
from hmscale.teacher.cache import plan_cache, verify_cache  # noqa: E402
from hmscale.teacher.cache.worker import ShardWorker  # noqa: E402
from hmscale.teacher.capture import capture_layers  # noqa: E402
from hmscale.teacher.flavors import neox_config  # noqa: E402


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=None, help="cuda | cpu (default: cuda when available)")
    ap.add_argument("--flavor", default="pythia-160m")
    ap.add_argument("--tokens", type=int, default=None, help="tokens to cache (default: 131072 on cuda, 8192 on cpu)")
    ap.add_argument("--seq-len", type=int, default=None, help="default 2048 on cuda, 256 on cpu")
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per teacher forward")
    ap.add_argument("--sequences-per-shard", type=int, default=16)
    ap.add_argument("--layers", default="all", help="'all' or a comma list, e.g. 0,5,11")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "fp8_e4m3"], help="storage dtype")
    ap.add_argument("--token-fraction", type=float, default=1.0)
    ap.add_argument("--topk", type=int, default=0)
    ap.add_argument("--teacher-dtype", default=None, help="bfloat16 | float32 (default: bf16 on cuda, fp32 on cpu)")
    ap.add_argument("--out", default=None, help="directory for the shards (default: a temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep the shards")
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run: pythia-nano, 2048 tokens")
    ap.add_argument("--json", default=None, help="also write the results as JSON here")
    args = ap.parse_args(argv)

    if args.smoke:
        args.device, args.flavor = args.device or "cpu", "pythia-nano"
        args.tokens, args.seq_len = args.tokens or 2048, args.seq_len or 64
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    tokens = args.tokens or (131072 if cuda else 8192)
    seq_len = args.seq_len or (2048 if cuda else 256)
    tdtype = getattr(torch, args.teacher_dtype or ("bfloat16" if cuda else "float32"))
    torch.manual_seed(0)

    from transformers import GPTNeoXForCausalLM

    vocab = 50304 if args.flavor.startswith("pythia-") and not args.smoke else 512
    mcfg = neox_config(args.flavor, vocab_size=vocab)
    mcfg._attn_implementation = "sdpa"
    teacher = GPTNeoXForCausalLM(mcfg).to(device=device, dtype=tdtype).eval().requires_grad_(False)

    n_seq = max(1, tokens // seq_len)
    rng = np.random.default_rng(0)
    stream = rng.integers(1, vocab, size=n_seq * seq_len).astype(np.int32)
    doc_lens = np.full(n_seq, seq_len, dtype=np.int64)
    plan = ShardPlan(stream, doc_lens, seq_len, args.sequences_per_shard, source="benchmark-random")
    layers = "all" if args.layers == "all" else "[" + args.layers + "]"

    root = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="hmscale-cache-bench-"))
    cfg = build_config({}, [f"cache.root={root}", f"cache.batch_size={args.batch_size}", f"cache.capture.layers={layers}",
                            f"cache.capture.dtype={args.dtype}", f"cache.capture.token_fraction={args.token_fraction}",
                            f"cache.capture.topk={args.topk}", "teacher.flavor=pythia-nano"])
    t0 = time.perf_counter()
    cp = plan_cache(cfg, plan, teacher)
    t_plan = time.perf_counter() - t0
    print(f"device={device} ({torch.cuda.get_device_name(device) if cuda else 'cpu'}), teacher={args.flavor} "
          f"({sum(p.numel() for p in teacher.parameters()) / 1e6:.0f}M params, {tdtype}), {n_seq} x {seq_len} tokens, "
          f"batch {args.batch_size}, {len(cp.spec.layers)} layers {args.dtype}, fraction {args.token_fraction}, top-k {args.topk}")
    print(f"planned: {cp.bytes_per_token:,.0f} bytes/token, {cp.total_bytes / 1e9:.2f} GB (fingerprint + plan {t_plan:.1f} s)")
    free = shutil.disk_usage(root).free
    if cp.total_bytes > 0.8 * free:
        print(f"refusing: {cp.total_bytes / 1e9:.1f} GB would not fit in {free / 1e9:.1f} GB free under {root}; lower --tokens")
        return 1

    batches = [torch.from_numpy(plan.sequences(i, i + args.batch_size)[0]).long().to(device)
               for i in range(0, n_seq, args.batch_size)]
    n_tok = n_seq * seq_len

    def timed(fn, reps=1):
        fn(batches[0])  # warm-up
        _sync(device)
        best = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            for b in batches:
                fn(b)
            _sync(device)
            best = min(best, time.perf_counter() - t)
        return best

    with torch.no_grad():
        t_fwd = timed(lambda b: teacher(input_ids=b, use_cache=False).logits, reps=3)
        t_cap = timed(lambda b: capture_layers(teacher, b, layers=list(cp.spec.layers), qkv=False), reps=3)

    worker = ShardWorker(teacher, plan, cp.spec, cp.cache_dir, batch_size=args.batch_size, device=device)
    worker.forward_batch(plan.sequences(0, args.batch_size)[0])  # warm-up
    _sync(device)
    t = time.perf_counter()
    infos = [worker.run_shard(s) for s in range(plan.num_shards)]
    _sync(device)
    t_cache = time.perf_counter() - t
    written = sum(i.bytes for i in infos)

    # the manifest as build_cache would write it, then a full re-read check
    from hmscale.teacher.cache.build import Manifest
    from hmscale.teacher.cache.format import layout_json

    m = Manifest.new(cp.cache_dir, key=cp.key, teacher={"fingerprint": cp.fingerprint}, plan={"hash": plan.hash},
                     capture=cp.spec.to_json(), layout={"fields": layout_json(cp.fields), "seq_len": seq_len,
                                                        "kept_positions": cp.spec.kept_positions(seq_len)}, config_hash="bench")
    for i in infos:
        m.add_shard(i)
    m.set_requested(range(plan.num_shards))
    m.update_complete()
    m.save()
    t = time.perf_counter()
    report = verify_cache(cp.cache_dir)
    t_verify = time.perf_counter() - t

    res = {
        "device": str(device), "teacher": args.flavor, "tokens": n_tok, "seq_len": seq_len, "batch_size": args.batch_size,
        "layers": len(cp.spec.layers), "dtype": args.dtype, "token_fraction": args.token_fraction, "topk": args.topk,
        "forward_tok_s": n_tok / t_fwd, "capture_tok_s": n_tok / t_cap, "cache_tok_s": n_tok / t_cache,
        "overhead_pct": 100 * (t_cache / t_fwd - 1), "capture_overhead_pct": 100 * (t_cap / t_fwd - 1),
        "bytes_per_token": written / n_tok, "planned_bytes_per_token": cp.bytes_per_token,
        "write_gb_s": written / t_cache / 1e9, "verify_gb_s": written / t_verify / 1e9, "verify_ok": report.ok,
    }
    print(f"forward alone      : {res['forward_tok_s']:>12,.0f} tokens/s")
    print(f"forward + capture  : {res['capture_tok_s']:>12,.0f} tokens/s  ({res['capture_overhead_pct']:+.1f}%)")
    print(f"cache (local eng.) : {res['cache_tok_s']:>12,.0f} tokens/s  (overhead {res['overhead_pct']:+.1f}% vs forward alone)")
    print(f"bytes/token        : {res['bytes_per_token']:>12,.0f}  (planned {cp.bytes_per_token:,.0f}); "
          f"written {written / 1e9:.2f} GB at {res['write_gb_s']:.2f} GB/s")
    print(f"verify             : {'ok' if report.ok else 'FAILED'} at {res['verify_gb_s']:.2f} GB/s")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    if not args.keep and not args.out:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
