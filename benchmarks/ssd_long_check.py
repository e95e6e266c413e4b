"""Long single sequences on the GPU: the Triton SSD against the float64 chunked reference, with the state passes
forced fused and forced split (``HMSCALE_SSD_PASS``), at the 1.4b and 410m HedgeMamba shapes with b = 1.

The full grid (``ssd_gpu_check.py``) runs l = 200; this checks the shapes where ``pass_mode``'s auto choice is
closest to its threshold, at the benchmark's 16K tokens. Prints the relative error (norm of the difference / norm
of the reference) of y and of every gradient; tolerances as in the grid (bf16 1e-2, fp32 1e-4 with tf32 off).

    python3 benchmarks/ssd_long_check.py [--l 16384]
    python3 benchmarks/ssd_long_check.py --device cpu --dtype fp32 --heads 2 --l 70   (a smoke run; --device cpu
                                                                                      sets TRITON_INTERPRET=1)
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

_CPU = any(a == "--device=cpu" or (a == "--device" and sys.argv[i + 1:i + 2] == ["cpu"])
           for i, a in enumerate(sys.argv))
if _CPU:  # the interpreter must be chosen before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _runinfo import header, need_cuda  # noqa: E402
from kernels.chunked_torch import ssd_chunked_torch  # noqa: E402
from kernels.ssd_autograd import ssd_triton  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
SHAPES = {  # name: H, P, N, normalize (one head per B/C group, as in HedgeMamba)
    "1.4b": (16, 128, 256, False),
    "410m_norm": (16, 64, 128, True),
}


def inputs(L, H, P, N, norm, dev="cuda", dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(1, L, H, P, device=dev, generator=g).to(dtype)
    dt = torch.rand(1, L, H, device=dev, generator=g) * 0.5 + 0.05
    A = -(torch.rand(H, device=dev, generator=g) + 0.05)
    B = torch.randn(1, L, H, N, device=dev, generator=g) / N ** 0.5
    C = torch.randn(1, L, H, N, device=dev, generator=g) / N ** 0.5
    kw = {}
    if norm:  # positive feature maps, as in the model, and the D skip
        B, C = torch.softmax(B * 4, -1), torch.softmax(C * 4, -1)
        kw["D"] = torch.randn(H, device=dev, generator=g)
    gy = torch.randn(1, L, H, P, device=dev, generator=g).to(dtype)
    return [x, dt, A, B.to(dtype), C.to(dtype)], kw, gy


def run(fn, ins, kw, gy, dtype=None):
    ins = [t.detach().to(dtype or t.dtype).requires_grad_() for t in ins]
    kw = {k: v.detach().to(dtype or v.dtype).requires_grad_() for k, v in kw.items()}
    y = fn(*ins, chunk_size=64, **kw)
    grads = torch.autograd.grad(y, ins + list(kw.values()), gy.to(y.dtype))
    names = ["dx", "ddt", "dA", "dB", "dC"] + ["d" + k for k in kw]
    return {"y": y.detach(), **dict(zip(names, grads))}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--l", type=int, default=16384, help="sequence length (one sequence)")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run under TRITON_INTERPRET=1 (small --l)")
    ap.add_argument("--heads", type=int, default=0, help="fewer heads than the shapes' (a quicker smoke run)")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"],
                    help="x, B, C dtype (fp32 on the CPU: the interpreter's bf16 dots are not exact); "
                         "tolerance 1e-2 / 1e-4")
    args = ap.parse_args()
    if args.device.startswith("cuda"):
        need_cuda("benchmarks/ssd_long_check.py", "--device cpu --dtype fp32 --heads 2 --l 70 is its CPU smoke run")
    elif not _CPU:
        ap.error("--device: cuda or cpu")
    print(header(args.device, f"{args.dtype}, b = 1, L = {args.l}"), flush=True)
    worst = 0.0
    print("| shape | L | passes | " + " | ".join(["y", "dx", "ddt", "dA", "dB", "dC", "dD"]) + " |")
    print("|---|---|---|" + "---|" * 7)
    for name, (H, P, N, norm) in SHAPES.items():
        H = args.heads or H
        ins, kw, gy = inputs(args.l, H, P, N, norm, args.device, DTYPES[args.dtype])
        ref = run(lambda *a, **k: ssd_chunked_torch(*a, normalize=norm, **k), ins, kw, gy, torch.float64)
        for mode in ("fused", "split"):
            os.environ["HMSCALE_SSD_PASS"] = mode
            got = run(lambda *a, **k: ssd_triton(*a, normalize=norm, **k), ins, kw, gy)
            errs = {k: ((got[k].double() - ref[k]).norm() / ref[k].norm()).item() for k in ref}
            assert all(torch.isfinite(got[k]).all() for k in got), f"{name} {mode}: non-finite output"
            worst = max(worst, *errs.values())
            cells = [f"{errs[k]:.2e}" if k in errs else "-" for k in ["y", "dx", "ddt", "dA", "dB", "dC", "dD"]]
            print(f"| {name} | {args.l} | {mode} | " + " | ".join(cells) + " |", flush=True)
        del ref
        if args.device == "cuda":
            torch.cuda.empty_cache()
    os.environ.pop("HMSCALE_SSD_PASS", None)
    tol = 1e-2 if args.dtype == "bf16" else 1e-4
    print(f"{'PASS' if worst <= tol else 'FAIL'}: worst relative error {worst:.2e} ({args.dtype} tolerance {tol:g})")
    sys.exit(0 if worst <= tol else 1)


if __name__ == "__main__":
    main()
