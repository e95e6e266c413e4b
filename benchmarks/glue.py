"""The mixer's glue kernels at the training shapes: the Triton kernels against inductor's fusion of the plain
references (what a compiled training step runs by default), forward and forward+backward, with a floor.

    python3 benchmarks/glue.py                       # conv and feature map, pythia-160m and -410m shapes
    python3 benchmarks/glue.py --op conv --conv-cfg "" --conv-cfg "bwd=16,128,4,256"   # '' = the defaults

Shapes: micro batch 8 x seq 2048 (16K tokens), bf16, the mixer's conv over the 3 d qkv channels (width 4) and the
Hedgehog feature map of one of q / k (h heads, P = F = d / h: 64 at 160m and 410m, 256 at 1b, 128 at 1.4b). The
floor is the bytes each way must move (inputs read once, outputs written once) at the copy bandwidth measured in the
same run. ms are medians of triton.testing.do_bench;
``--profile`` adds the per-kernel CUDA time of one fwd+bwd call of each variant.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _runinfo import header, need_cuda  # noqa: E402
from kernels import causal_depthwise_conv_reference, hedgehog_feature_map_reference  # noqa: E402
from kernels.conv import causal_depthwise_conv_triton  # noqa: E402
from kernels.feature_map import hedgehog_feature_map  # noqa: E402
from ssd import kernel_times  # noqa: E402  (benchmarks/ssd.py, beside this script)

SHAPES = {"160m": (768, 12), "410m": (1024, 16), "1b": (2048, 8), "1.4b": (2048, 16)}  # hidden size, heads


def bench(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


def copy_bandwidth() -> float:
    x = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = bench(lambda: y.copy_(x))
    return 2 * x.numel() / (ms * 1e-3)


def conv_case(d, b, l, dtype=torch.bfloat16, W=4):
    c = 3 * d
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(b, l, c, device="cuda", generator=g).to(dtype).requires_grad_()
    prev = torch.zeros(b, W - 1, c, device="cuda", dtype=dtype)
    w = torch.randn(c, W, device="cuda", generator=g).requires_grad_()
    bias = torch.randn(c, device="cuda", generator=g).requires_grad_()
    gy = torch.randn(b, l, c, device="cuda", generator=g).to(dtype)
    nbytes = x.numel() * x.element_size()
    return (x, prev, w, bias), gy, {"fwd": 2 * nbytes, "fwd+bwd": 5 * nbytes}  # bwd reads x, dy; writes dx


def fm_case(d, h, b, l, dtype=torch.bfloat16):
    P = d // h
    g = torch.Generator(device="cuda").manual_seed(0)
    u = torch.randn(b, l, h, P, device="cuda", generator=g).to(dtype).requires_grad_()
    w = (torch.eye(P, device="cuda").repeat(h, 1, 1) + 0.1 * torch.randn(h, P, P, device="cuda", generator=g))
    w.requires_grad_()
    bias = (0.1 * torch.randn(h, P, device="cuda", generator=g)).requires_grad_()
    gy = torch.randn(b, l, h, 2 * P, device="cuda", generator=g).to(dtype)
    nu = u.numel() * u.element_size()
    # fwd: u in, phi (2x) out; bwd: phi, dphi in (2x each), u in, du out
    return (u, w, bias), gy, {"fwd": 3 * nu, "fwd+bwd": 3 * nu + 6 * nu}


def fwd_bwd(fn, ins, gy):
    def fwd():
        with torch.no_grad():
            return fn(*ins)

    def step():
        out = fn(*ins)
        y = out[0] if isinstance(out, tuple) else out
        grads = torch.autograd.grad(y, [t for t in ins if t.requires_grad], gy)
        return grads
    return fwd, step


def run_op(op, shape, variants, bw, profile, b=8, l=2048):
    d, h = SHAPES[shape]
    if op == "conv":
        ins, gy, nbytes = conv_case(d, b, l)
        ref, ours = causal_depthwise_conv_reference, causal_depthwise_conv_triton
        env = "HMSCALE_CONV_CFG"
    else:
        ins, gy, nbytes = fm_case(d, h, b, l)
        ref, ours = hedgehog_feature_map_reference, hedgehog_feature_map
        env = "HMSCALE_FM_CFG"
    rows = []
    compiled = torch.compile(ref)
    cands = [("inductor", compiled, None)] + [(f"triton {v or 'default'}", ours, v) for v in variants]
    for name, fn, cfg in cands:
        if env:
            os.environ[env] = cfg or ""
        fwd, step = fwd_bwd(fn, ins, gy)
        t0 = time.time()
        step()
        torch.cuda.synchronize()
        first = time.time() - t0
        ms_f, ms_fb = bench(fwd), bench(step)
        row = {"op": op, "shape": shape, "variant": name, "fwd_ms": ms_f, "fwd_bwd_ms": ms_fb, "first_s": first}
        if profile:
            row["kernels"] = kernel_times(step, label=lambda key: key[:60])
        rows.append(row)
    if env:
        os.environ.pop(env, None)
    floor = {k: v / bw * 1e3 for k, v in nbytes.items()}
    base = rows[0]["fwd_bwd_ms"]
    print(f"\n{op} at the {shape} training shape (b={b}, l={l}, bf16); floor fwd {floor['fwd']:.3f} ms, "
          f"fwd+bwd {floor['fwd+bwd']:.3f} ms at {bw / 1e12:.2f} TB/s")
    # at these sizes one eager call is host-bound: the kernels' own time (--profile) is what a compiled step pays
    print("| variant | fwd ms | fwd+bwd ms | vs inductor | x floor (fwd+bwd) | kernels fwd+bwd us | first call s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        gpu = f"{sum(r['kernels'].values()):.0f}" if profile else "-"
        print(f"| {r['variant']} | {r['fwd_ms']:.3f} | {r['fwd_bwd_ms']:.3f} | {base / r['fwd_bwd_ms']:.2f}x | "
              f"{r['fwd_bwd_ms'] / floor['fwd+bwd']:.2f} | {gpu} | {r['first_s']:.1f} |")
    if profile:
        for r in rows:
            ks = sorted(r["kernels"].items(), key=lambda kv: -kv[1])
            print(f"  {r['variant']}: " + ", ".join(f"{k} {v:.0f} us" for k, v in ks[:8]))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--op", choices=("conv", "fm", "all"), default="all")
    ap.add_argument("--shapes", default="160m,410m")
    ap.add_argument("--conv-cfg", action="append", default=None,
                    help="HMSCALE_CONV_CFG variants to time (repeatable; '' = the defaults)")
    ap.add_argument("--fm-cfg", action="append", default=None,
                    help="HMSCALE_FM_CFG variants of the feature map to time (repeatable)")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    need_cuda("benchmarks/glue.py", "it times CUDA kernels (on the CPU, ssd_registers.py --op conv|fm reads "
                                    "their registers)")
    print(header("cuda", f"triton {triton.__version__}, baseline inductor's fusion of the references"), flush=True)
    bw = copy_bandwidth()
    print(f"{time.strftime('%Y-%m-%d')}, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {triton.__version__}; copy bandwidth {bw / 1e12:.2f} TB/s")
    for shape in args.shapes.split(","):
        if args.op in ("conv", "all"):
            run_op("conv", shape, args.conv_cfg or [""], bw, args.profile)
        if args.op in ("fm", "all"):
            run_op("fm", shape, args.fm_cfg or [""], bw, args.profile)


if __name__ == "__main__":
    main()
