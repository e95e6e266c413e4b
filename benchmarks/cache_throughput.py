"""Teacher-cache throughput: caching a Pythia-160m-shaped teacher (random weights) vs its forward alone.

    python benchmarks/cache_throughput.py                      # CUDA when available: the full spec (all layers, bf16)
    python benchmarks/cache_throughput.py --layers 0,5,11 --dtype fp8_e4m3 --token-fraction 0.1   # a lighter spec
    python benchmarks/cache_throughput.py --host-only          # the write path alone (captures are random tensors)
    python benchmarks/cache_throughput.py --smoke              # tiny CPU run (seconds), checks the script works

Prints, for the capture spec it names: tokens/s of (1) the plain teacher forward (logits), (2) the
forward with the capture hooks, no writing, (3) the full cache path of the local engine (capture,
encode to the storage dtype on the device, non-blocking device->host copies into pinned buffers,
tar + sha256, fsync, rename; several shards in flight, `--writers`); the overhead of (3) over (1)
and whether it meets the <= 15 % target; bytes/token; the host write rate, and the rate the target
would need; where the host time went. The default is the full spec (every layer's attn_input and
per-head attn_output, bf16, all positions), so the headline number stays honest.

`--host-only` replaces the capture by random device tensors of the same shapes: (3) then measures
the device->host + write path alone (still against the real forward of (1)).

The shards go to a temporary directory (or --out; its filesystem is printed: a tmpfs measures the
host path without the disk) that is removed afterwards unless --keep; a final `verify_cache`
re-reads and checks everything (--no-verify skips it). `--probe-write` then times plain fsynced writes of the same
bytes to the same filesystem with as many threads as writers: what the filesystem gives without the cache's work.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _runinfo import header, need_cuda  # noqa: E402

# hmscale's cache engine and teacher (transformers, ~seconds of imports) are imported in main(), after --help and the
# GPU check

TARGET_PCT = 15.0


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _filesystem(path: Path) -> str:
    """'fstype on source' of the mount holding path (Linux), else '?'."""
    best, out = "", "?"
    try:
        real = os.path.realpath(path)
        for line in Path("/proc/mounts").read_text().splitlines():
            src, mnt, fstype = line.split()[:3]
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, out = mnt, f"{fstype} on {src} ({mnt})"
    except OSError:
        pass
    return out


def probe_write(root: Path, total_bytes: int, streams: int, block: int = 8 << 20) -> float:
    """GB/s of `streams` threads each writing its share of total_bytes (random bytes, `block` at a time) to its own
    file under root, then fsync, as the cache's writers do but with no tar, sha256 or device copies: the ceiling the
    filesystem gives the cache path. The files are removed."""
    from concurrent.futures import ThreadPoolExecutor

    buf = memoryview(np.random.default_rng(1).integers(0, 256, block, dtype=np.uint8).tobytes())
    per = max(block, total_bytes // streams)
    paths = [root / f".write-probe-{i}.tmp" for i in range(streams)]

    def one(path):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            left = per
            while left > 0:
                left -= os.write(fd, buf[:min(block, left)])
            os.fsync(fd)
        finally:
            os.close(fd)

    t = time.perf_counter()
    try:
        with ThreadPoolExecutor(streams) as ex:
            list(ex.map(one, paths))
        return per * streams / (time.perf_counter() - t) / 1e9
    finally:
        for path in paths:
            path.unlink(missing_ok=True)


def _random_capture(teacher, batch_size, seq_len, device, dtype):
    """A capture_fn returning fixed random tensors of the teacher's capture shapes (no teacher work)."""
    from hmscale.teacher.capture import LayerCapture

    c = teacher.config
    d, h = c.hidden_size, c.num_attention_heads
    g = torch.Generator(device=device).manual_seed(0)
    pre = {}

    def capture(_teacher, ids, layers=None):
        b = ids.shape[0]
        out = {}
        for i in layers:
            if i not in pre:
                pre[i] = LayerCapture(
                    attn_input=torch.randn(batch_size, seq_len, d, generator=g, device=device).to(dtype),
                    attn_output=torch.randn(batch_size, seq_len, h, d // h, generator=g, device=device).to(dtype))
            out[i] = LayerCapture(attn_input=pre[i].attn_input[:b], attn_output=pre[i].attn_output[:b])
        return out

    return capture


def teacher_override(flavor) -> str:
    """The config's teacher for the benchmark's flavour (its shape checks the capture spec; nothing is loaded): a
    miniature by name, a published size by its hub id (the registry knows its shape without the network)."""
    return f"teacher.flavor={flavor.name}" if flavor.miniature else f"teacher.name_or_path={flavor.hub_id}"


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
    ap.add_argument("--token-fraction", type=float, default=1.0,
                    help="fraction of positions whose attn_output is kept (attn_input always keeps every position)")
    ap.add_argument("--topk", type=int, default=0)
    ap.add_argument("--teacher-dtype", default=None, help="bfloat16 | float32 (default: bf16 on cuda, fp32 on cpu)")
    ap.add_argument("--writers", type=int, default=None,
                    help="shards written concurrently (default: the worker's, cores/2 in [2, 8] on a GPU, 1 on CPU)")
    ap.add_argument("--max-buffers", type=int, default=None, help="pinned buffer sets (default writers + 2)")
    ap.add_argument("--host-only", action="store_true", help="random captures instead of the teacher: the write path alone")
    ap.add_argument("--out", default=None, help="directory for the shards (default: a temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep the shards")
    ap.add_argument("--no-verify", action="store_true", help="skip the final re-read of every shard")
    ap.add_argument("--no-forward", action="store_true",
                    help="skip timing the forward alone and with the hooks (with --host-only: the write path alone, quick on a CPU)")
    ap.add_argument("--probe-write", action="store_true",
                    help="afterwards, time plain fsynced writes of the same bytes to the same filesystem, one file per "
                         "writer (no tar, sha256 or device copies): the filesystem's ceiling for the cache path")
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run: pythia-nano, 2048 tokens")
    ap.add_argument("--json", default=None, help="also write the results as JSON here")
    args = ap.parse_args(argv)

    if args.smoke:
        args.device, args.flavor = args.device or "cpu", "pythia-nano"
        args.tokens, args.seq_len = args.tokens or 2048, args.seq_len or 64
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    if cuda:
        need_cuda("benchmarks/cache_throughput.py --device cuda", "--device cpu (or --smoke) runs it on the CPU")
    print(header(str(device)), flush=True)
    from hmscale.config import build_config
    from hmscale.data.plan import ShardPlan
    from hmscale.teacher.cache import plan_cache, verify_cache
    from hmscale.teacher.cache.worker import ShardWorker
    from hmscale.teacher.capture import capture_layers
    from hmscale.teacher.flavors import get_flavor, neox_config
    from hmscale.teacher.whole_sequences import whole_sequences

    if cuda and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
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
    root.mkdir(parents=True, exist_ok=True)
    # cache.max_tokens: the plan (and its printed total) covers every shard the benchmark writes, not the default budget's
    cfg = build_config({}, [f"cache.root={root}", f"cache.max_tokens={n_seq * seq_len}",
                            f"cache.batch_size={args.batch_size}", f"cache.capture.layers={layers}",
                            f"cache.capture.dtype={args.dtype}", f"cache.capture.token_fraction={args.token_fraction}",
                            f"cache.capture.topk={args.topk}", teacher_override(get_flavor(args.flavor))])
    t0 = time.perf_counter()
    cp = plan_cache(cfg, plan, teacher)
    t_plan = time.perf_counter() - t0
    spec = cp.spec
    n_params = sum(p.numel() for p in teacher.parameters()) / 1e6
    kept = spec.kept_positions(seq_len)
    lay = list(spec.layers)
    lay_s = f"[{lay[0]}..{lay[-1]}]" if lay == list(range(lay[0], lay[-1] + 1)) and len(lay) > 2 else str(lay)
    spec_line = (f"{len(lay)} of {cp.shape.n_layers} layers {lay_s}, {'+'.join(spec.tensors)}, {spec.dtype}, "
                 f"token fraction {spec.token_fraction:g} (attn_output rows kept {kept}/{seq_len}), top-k {spec.topk}")
    print(f"device    : {device} ({torch.cuda.get_device_name(device) if cuda else 'cpu'}), torch {torch.__version__}, "
          f"{os.cpu_count()} cores")
    print(f"teacher   : {args.flavor} ({n_params:,.1f}M params, {str(tdtype).replace('torch.', '')}, random weights)")
    print(f"data      : {n_seq} x {seq_len} = {n_seq * seq_len:,} tokens, batch {args.batch_size}, "
          f"{args.sequences_per_shard} sequences/shard ({plan.num_shards} shards)")
    print(f"capture   : {spec_line}{'  [HOST-ONLY: random captures, no teacher work]' if args.host_only else ''}")
    print(f"planned   : {cp.bytes_per_token:,.0f} bytes/token, {cp.total_bytes / 1e9:.2f} GB (fingerprint + plan {t_plan:.1f} s)")
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

    t_fwd = t_cap = None
    if not args.no_forward:
        with torch.no_grad():
            with whole_sequences(teacher):  # the teacher's forward as hmscale runs it (capture does the same)
                t_fwd = timed(lambda b: teacher(input_ids=b, use_cache=False).logits, reps=3)
            t_cap = timed(lambda b: capture_layers(teacher, b, layers=list(spec.layers), qkv=False), reps=3)

    capture_fn = _random_capture(teacher, args.batch_size, seq_len, device, tdtype) if args.host_only else None
    worker = ShardWorker(teacher, plan, spec, cp.cache_dir, batch_size=args.batch_size, device=device,
                         capture_fn=capture_fn, writer_threads=args.writers, max_buffers=args.max_buffers)
    worker.warm_up()  # on the worker's launcher thread, where every timed forward runs
    t_pin = worker.reserve_buffers()  # pinning is paid once per worker, not per shard: outside the timing
    pool = worker._pool
    print(f"writers   : {worker.writer_threads} shard{'s' if worker.writer_threads > 1 else ''} in flight"
          + (f", {pool._made} pinned buffer sets ({pool.bytes / 1e9:.1f} GB, pinned in {t_pin:.1f} s, before timing)" if pool else "")
          + f"; out: {cp.cache_dir.parent} ({_filesystem(root)})")
    _sync(device)
    t = time.perf_counter()
    infos = worker.run_shards(range(plan.num_shards))
    _sync(device)
    t_cache = time.perf_counter() - t
    written = sum(i.bytes for i in infos)
    spent = {}
    for i in infos:
        for k, v in i.stats.items():
            spent[k] = spent.get(k, 0.0) + v

    # the manifest as build_cache would write it, then a full re-read check
    from hmscale.teacher.cache.format import layout_json
    from hmscale.teacher.cache.manifest import Manifest

    m = Manifest.new(cp.cache_dir, key=cp.key,
                     teacher={"fingerprint": cp.fingerprint, "n_layers": cp.shape.n_layers, "d_model": cp.shape.d_model,
                              "n_heads": cp.shape.n_heads, "head_dim": cp.shape.head_dim,
                              "vocab_size": cp.shape.vocab_size, "flavor": args.flavor},
                     plan={"hash": plan.hash, "num_shards": plan.num_shards, "seq_len": plan.seq_len,
                           "sequences_per_shard": plan.sequences_per_shard},
                     capture=spec.to_json(), layout={"fields": layout_json(cp.fields), "seq_len": seq_len,
                                                     "kept_positions": kept, "bytes_per_token": cp.bytes_per_token},
                     config_hash="bench")
    for i in infos:
        m.add_shard(i)
    m.set_requested(range(plan.num_shards))
    m.update_complete()
    m.save()
    report, t_verify = None, None
    if not args.no_verify:
        t = time.perf_counter()
        report = verify_cache(cp.cache_dir)
        t_verify = time.perf_counter() - t

    fwd_tok_s = n_tok / t_fwd if t_fwd else None
    bpt = written / n_tok
    overhead = 100 * (t_cache / t_fwd - 1) if t_fwd else None
    need_gb_s = bpt * fwd_tok_s / (1 + TARGET_PCT / 100) / 1e9 if t_fwd else None
    res = {
        "device": str(device), "gpu": torch.cuda.get_device_name(device) if cuda else None, "torch": torch.__version__,
        "teacher": args.flavor, "teacher_dtype": str(tdtype), "tokens": n_tok, "seq_len": seq_len,
        "batch_size": args.batch_size, "sequences_per_shard": args.sequences_per_shard, "shards": plan.num_shards,
        "layers": lay, "tensors": list(spec.tensors), "dtype": spec.dtype, "token_fraction": spec.token_fraction,
        "topk": spec.topk, "host_only": args.host_only, "writers": worker.writer_threads,
        "pinned_gb": (pool.bytes / 1e9) if pool else 0.0, "pin_s": t_pin, "out_fs": _filesystem(root),
        "forward_tok_s": fwd_tok_s, "capture_tok_s": n_tok / t_cap if t_cap else None,
        "cache_tok_s": n_tok / t_cache, "overhead_pct": overhead,
        "capture_overhead_pct": 100 * (t_cap / t_fwd - 1) if t_fwd else None, "target_pct": TARGET_PCT,
        "target_met": overhead <= TARGET_PCT if t_fwd else None, "bytes_per_token": bpt, "planned_bytes_per_token": cp.bytes_per_token,
        "planned_gb": cp.total_bytes / 1e9, "written_gb": written / 1e9, "write_gb_s": written / t_cache / 1e9, "needed_write_gb_s": need_gb_s,
        "host_seconds": spent, "verify_gb_s": (written / t_verify / 1e9) if t_verify else None,
        "verify_ok": report.ok if report else None,
    }
    if args.probe_write:  # after the cache path and its verify: the same bytes, the same streams, plain writes
        res["probe_write_gb_s"] = probe_write(cp.cache_dir.parent, written, worker.writer_threads)
    cap_note = "capture with random tensors" if args.host_only else "capture"
    if t_fwd:
        print(f"forward alone      : {fwd_tok_s:>12,.0f} tokens/s")
        print(f"forward + capture  : {res['capture_tok_s']:>12,.0f} tokens/s  ({res['capture_overhead_pct']:+.1f}%)")
        print(f"cache path         : {res['cache_tok_s']:>12,.0f} tokens/s  ({cap_note}; overhead {overhead:+.1f}% vs forward "
              f"alone; target <= {TARGET_PCT:.0f}%: {'met' if res['target_met'] else 'NOT met'})")
    else:
        print(f"cache path         : {res['cache_tok_s']:>12,.0f} tokens/s  ({cap_note}; forward not timed)")
    print(f"bytes/token        : {bpt:>12,.0f}  (planned {cp.bytes_per_token:,.0f}); {written / 1e9:.3f} GB written")
    print(f"host write rate    : {res['write_gb_s']:>12.3f} GB/s"
          + (f"  (the <= {TARGET_PCT:.0f}% target needs {need_gb_s:.2f} GB/s at this spec: "
             f"bytes/token x forward tok/s / 1.15)" if t_fwd else ""))
    if spent:
        print("host time (s, summed over shards, overlapping): "
              + ", ".join(f"{k.replace('_s', '')} {v:.2f}" for k, v in sorted(spent.items()))
              + f"; wall {t_cache:.2f}")
    if args.probe_write:
        print(f"write probe        : {res['probe_write_gb_s']:>12.3f} GB/s  ({worker.writer_threads} threads writing "
              f"{written / 1e9:.3f} GB of plain fsynced files on the same filesystem: the cache path's ceiling there)")
    if report is not None:
        print(f"verify             : {'ok' if report.ok else 'FAILED'} at {res['verify_gb_s']:.2f} GB/s")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    if not args.keep:
        shutil.rmtree(cp.cache_dir if args.out else root, ignore_errors=True)
    return 0 if report is None or report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
