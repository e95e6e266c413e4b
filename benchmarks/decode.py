"""Generation throughput: HedgeMamba (recurrent state) vs its GPT-NeoX teacher (KV cache), one harness.

    python benchmarks/decode.py --flavor pythia-160m --contexts 1024 8192 32768 --batch 8 --new 64

For each context length: prefill the context, then time `--new` single-token decode steps.
Teacher: HF GPT-NeoX with its KV cache (SDPA), eager. HedgeMamba: eager (`forward` with the
recurrent cache, `ssd_step`) and with the whole step in one CUDA graph (hmscale.eval.graph_decode).
Weights are random (throughput does not depend on them); bf16 on CUDA. Prints a markdown table.
Needs a CUDA GPU unless ``--device cpu`` (fp32, eager only, no CUDA graph: a check that the script works):

    python benchmarks/decode.py --device cpu --flavor pythia-nano --contexts 32 64 --batch 2 --new 4
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _runinfo import header, need_cuda  # noqa: E402

# hmscale's models (transformers, ~seconds of imports) are imported in main(), after --help and the GPU check


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _kv_step(teacher):
    """One decode step of the HF teacher with its KV cache (the keyword is `cache` in newer transformers)."""
    import inspect

    key = "cache" if "cache" in inspect.signature(teacher.forward).parameters else "past_key_values"

    def step(tok, past):
        out = teacher(input_ids=tok, use_cache=True, **{key: past})
        past = getattr(out, "cache", None) or out.past_key_values
        return past, out.logits[:, -1].argmax(-1, keepdim=True)

    return step


@torch.no_grad()
def time_teacher(teacher, ctx_ids, new: int, dev) -> dict:
    step = _kv_step(teacher)
    past, tok = step(ctx_ids, None)
    for _ in range(3):  # warm-up steps (the cache grows by 3 tokens; negligible)
        past, tok = step(tok, past)
    _sync(dev)
    t0 = time.perf_counter()
    for _ in range(new):
        past, tok = step(tok, past)
    _sync(dev)
    dt = (time.perf_counter() - t0) / new
    c = teacher.config
    ctx = ctx_ids.shape[1] + new + 3
    kv = 2 * c.num_hidden_layers * ctx_ids.shape[0] * ctx * c.hidden_size * next(teacher.parameters()).element_size()
    return {"ms_per_token": dt * 1e3, "tokens_per_s": ctx_ids.shape[0] / dt, "state_bytes": kv}


@torch.no_grad()
def time_student_eager(student, ctx_ids, new: int, dev) -> dict:
    out = student(input_ids=ctx_ids, use_cache=True)
    cache, tok = out.cache, out.logits[:, -1].argmax(-1, keepdim=True)
    for _ in range(3):
        out = student(input_ids=tok, cache=cache, use_cache=True)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
    _sync(dev)
    t0 = time.perf_counter()
    for _ in range(new):
        out = student(input_ids=tok, cache=cache, use_cache=True)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
    _sync(dev)
    dt = (time.perf_counter() - t0) / new
    return {"ms_per_token": dt * 1e3, "tokens_per_s": ctx_ids.shape[0] / dt, "state_bytes": cache.nbytes()}


@torch.no_grad()
def time_student_graph(student, ctx_ids, new: int, dev) -> dict:
    from hmscale.eval.graph_decode import GraphDecoder

    dec = GraphDecoder(student, ctx_ids)
    tok = dec.next_logits.argmax(-1)
    for _ in range(3):
        tok = dec.step(tok).argmax(-1)
    _sync(dev)
    t0 = time.perf_counter()
    for _ in range(new):
        tok = dec.step(tok).argmax(-1)
    _sync(dev)
    dt = (time.perf_counter() - t0) / new
    return {"ms_per_token": dt * 1e3, "tokens_per_s": ctx_ids.shape[0] / dt, "state_bytes": dec.cache.nbytes()}


@torch.no_grad()
def check_graph_matches_eager(student, ctx_ids, n: int = 16) -> bool:
    """The CUDA-graph decoder's greedy tokens equal step-by-step eager decoding."""
    from hmscale.eval.graph_decode import GraphDecoder

    out = student(input_ids=ctx_ids, use_cache=True)
    cache, tok = out.cache, out.logits[:, -1].argmax(-1, keepdim=True)
    eager = [tok[:, 0]]
    for _ in range(n - 1):
        tok = student(input_ids=tok, cache=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        eager.append(tok[:, 0])
    graph = GraphDecoder(student, ctx_ids).greedy(n)
    return bool((torch.stack(eager, 1) == graph).float().mean() >= 0.99)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flavor", default="pythia-160m", help="the teacher's shape (hmscale.teacher.flavors)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 32768], help="context lengths to prefill")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new", type=int, default=64, help="decode steps timed per context")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (a check that the script works)")
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary size (default: the flavor's)")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cuda":
        need_cuda("benchmarks/decode.py", "--device cpu with small sizes checks the script on the CPU, e.g. "
                                          "--device cpu --flavor pythia-nano --contexts 32 64 --batch 2 --new 4")
    print(header(args.device), flush=True)
    from hmscale.models.convert import to_hedgehog, to_hedgemamba
    from hmscale.teacher.flavors import neox_config

    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    torch.manual_seed(0)
    max_ctx = max(args.contexts) + args.new + 16
    cfg = neox_config(args.flavor, vocab_size=args.vocab, max_position_embeddings=max_ctx)
    cfg._attn_implementation = "sdpa"
    from transformers import GPTNeoXForCausalLM

    teacher = GPTNeoXForCausalLM(cfg).eval()
    student = to_hedgemamba(to_hedgehog(teacher)).eval()
    teacher, student = teacher.to(dev, dtype), student.to(dev, dtype)
    name = "cuda" if dev.type == "cuda" else "cpu"
    print(f"# decode benchmark: {args.flavor}, batch {args.batch}, {args.new} new tokens, {dtype}, "
          f"{torch.cuda.get_device_name() if name == 'cuda' else 'CPU'}")
    if dev.type == "cuda":
        ids = torch.randint(0, cfg.vocab_size, (args.batch, 256), device=dev)
        print(f"graph decoder matches eager greedy decoding: {check_graph_matches_eager(student, ids)}")
    rows = []
    for ctx in args.contexts:
        ids = torch.randint(0, cfg.vocab_size, (args.batch, ctx), device=dev)
        t = time_teacher(teacher, ids, args.new, dev)
        torch.cuda.empty_cache() if dev.type == "cuda" else None
        s = time_student_eager(student, ids, args.new, dev)
        g = time_student_graph(student, ids, args.new, dev) if dev.type == "cuda" else None
        rows.append((ctx, t, s, g))
        torch.cuda.empty_cache() if dev.type == "cuda" else None
    print("| context | teacher ms/token | teacher tok/s | KV cache | HedgeMamba eager ms/token | tok/s | "
          "HedgeMamba graph ms/token | tok/s | state | graph / teacher | eager / teacher |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for ctx, t, s, g in rows:
        gm = f"{g['ms_per_token']:.3f} | {g['tokens_per_s']:.0f}" if g else "- | -"
        ratio_g = f"{g['tokens_per_s'] / t['tokens_per_s']:.1f}x" if g else "-"
        print(f"| {ctx} | {t['ms_per_token']:.3f} | {t['tokens_per_s']:.0f} | {t['state_bytes'] / 2**20:.0f} MiB | "
              f"{s['ms_per_token']:.3f} | {s['tokens_per_s']:.0f} | {gm} | {s['state_bytes'] / 2**20:.1f} MiB | "
              f"{ratio_g} | {s['tokens_per_s'] / t['tokens_per_s']:.1f}x |")
    base = rows[0]
    for label, idx in (("eager", 2), ("graph", 3)):
        if base[idx] is None:
            continue
        lat = [r[idx]["ms_per_token"] for r in rows]
        print(f"HedgeMamba {label} per-token latency, longest vs shortest context: {lat[-1] / lat[0]:.3f}x")


if __name__ == "__main__":
    main()
