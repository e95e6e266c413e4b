"""Registers, spills and shared memory of every SSD (or glue, ``--op``) kernel launch, compiled for an H100/H200 (sm_90) on a CPU.

Tuning aid that costs no GPU time: it runs ``kernels.ssd`` forward and backward on CPU tensors with the Triton
launches intercepted, compiles each intercepted launch ahead of time for ``--arch`` with the same arguments,
constexprs, warps and stages the real call would use, and reads the register count and the stack (spill) bytes
of the cubin (cuobjdump, bundled with Triton). A tiling that spills here spills on the GPU (2026-12-01: the chunk-128 slowdown
was predicted this way); one that does not may still be slow, so timings stay on the GPU (``ssd.py --sweep``).

    python benchmarks/ssd_registers.py --shape 1.4b --chunk 128
    HMSCALE_CONV_CFG="bwd=32,64,4,512" python benchmarks/ssd_registers.py --op conv   # glue: conv | fm | fm-all | ce
    HMSCALE_SSD_CFG="scan=64,64,8" HMSCALE_SSD_DBC_CFG="16,32,3,8" python benchmarks/ssd_registers.py --chunk 128

Shapes are those of ``ssd.py --sweep`` (at a shorter L: registers do not depend on it). bf16 unless ``--dtype``.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

os.environ["TRITON_INTERPRET"] = "0"  # real JIT functions (their launches are intercepted), even under the test env

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SHAPES = {  # name: H, G, P, N, normalize (as in ssd.py's SWEEP_SHAPES)
    "410m": (16, 16, 64, 128, False),
    "1.4b": (16, 16, 128, 256, False),
    "1b_norm": (8, 8, 256, 512, True),  # Pythia-1b's training call (the paper's teacher): heads of 256, N = 2F = 512
    "160m_norm": (12, 12, 64, 128, True),
    "410m_norm": (16, 16, 64, 128, True),
    "mamba2": (64, 1, 64, 128, False),
}
_PTR = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.int32: "*i32",
        torch.int64: "*i64", torch.int8: "*i8"}


def _signature(fn, args, kwargs):
    """Triton signature, constexprs and divisibility attributes of one launch, as the JIT would specialise it."""
    sig, const, attrs = {}, {}, {}
    bound = dict(zip(fn.arg_names, args))
    bound.update({k: v for k, v in kwargs.items() if k in fn.arg_names})
    for i, p in enumerate(fn.params):
        name = p.name
        if p.is_constexpr:
            sig[name] = "constexpr"
            const[name] = bound[name] if name in bound else p.default
            continue
        v = bound[name]
        if isinstance(v, torch.Tensor):
            sig[name] = _PTR[v.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]  # torch allocations are 16-byte aligned
        elif isinstance(v, bool):
            sig[name] = "i1"
        elif isinstance(v, int):
            sig[name] = "i32" if -2**31 <= v < 2**31 else "i64"
            if v % 16 == 0 and not p.do_not_specialize:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: argument {name} of type {type(v).__name__} is not handled")
    return sig, const, attrs


def resource_usage(cubin: bytes) -> dict:
    """Registers, stack (spill) bytes and static shared memory of one compiled kernel (cuobjdump -res-usage on
    the cubin Triton built with its own ptxas)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        open(path, "wb").write(cubin)
        out = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"cuobjdump failed: {(out.stdout + out.stderr).strip()[:400]}")
    get = lambda key: int(m.group(1)) if (m := re.search(key + r":(\d+)", out.stdout)) else -1  # noqa: E731
    return {"regs": get("REG"), "stack": get("STACK"), "local": get("LOCAL")}


class Recorder:
    """Replaces ``JITFunction.__getitem__`` so that launches are recorded (not run)."""

    def __init__(self):
        self.launches = []

    def __enter__(self):
        self._orig = triton.runtime.jit.JITFunction.__getitem__
        rec = self

        def getitem(fn, grid):
            def launch(*args, **kwargs):
                rec.launches.append((fn, grid, args, kwargs))
            return launch
        triton.runtime.jit.JITFunction.__getitem__ = getitem
        return self

    def __exit__(self, *exc):
        triton.runtime.jit.JITFunction.__getitem__ = self._orig


def record_launches(H, G, P, N, norm, chunk, dtype, L, b=1):
    """The Triton launches of one fwd+bwd call, on CPU tensors, without running them."""
    import kernels.ssd_autograd as sa  # imported (kernels decorated as real JIT functions) before the flag below
    import kernels.ssd_triton_fwd as sf
    os.environ["TRITON_INTERPRET"] = "1"  # only lets ssd_triton accept CPU tensors: the launches are intercepted
    g = torch.Generator().manual_seed(0)
    x = torch.randn(b, L, H, P, generator=g).to(dtype).requires_grad_()
    dt = (torch.rand(b, L, H, generator=g) * 0.1).requires_grad_()
    A = (-torch.rand(H, generator=g)).requires_grad_()
    Bm = torch.randn(b, L, G, N, generator=g).to(dtype).requires_grad_()
    Cm = torch.randn(b, L, G, N, generator=g).to(dtype).requires_grad_()
    kw = dict(normalize=True, D=torch.randn(H, requires_grad=True)) if norm else {}
    # the CPU has no SM count: make the auto pass choice as it would be on an H200 (132 SMs)
    sf._sm_count = lambda device: 132
    with Recorder() as rec:
        y = sa.ssd_triton(x, dt, A, Bm, Cm, chunk_size=chunk, **kw)
        y.backward(torch.randn_like(y))
    return rec.launches


def record_glue_launches(op, dtype, L, b=1, p=64):
    """The Triton launches of one fwd+bwd call of a glue kernel at the 410m training widths (the conv over 3 x 1024
    channels, width 4; the feature map over 16 heads of ``p``, 64 at 410m), on CPU tensors, without running them."""
    import kernels.conv as kc  # decorated as real JIT functions before the flag below
    import kernels.cross_entropy as kce
    import kernels.feature_map as kf
    os.environ["TRITON_INTERPRET"] = "1"
    g = torch.Generator().manual_seed(0)
    with Recorder() as rec:
        if op == "conv":
            x = torch.randn(b, L, 3072, generator=g).to(dtype).requires_grad_()
            w = torch.randn(3072, 4, generator=g, requires_grad=True)
            bias = torch.zeros(3072, requires_grad=True)
            y, _ = kc._CausalConvTriton.apply(x, torch.zeros(b, 3, 3072, dtype=dtype), w, bias)
        elif op == "ce":  # stage 2's loss over the Pythia vocabulary: plain, with cached top-k KD, with live logits
            V = 50304
            z = torch.randn(b, L, V, generator=g).to(dtype).requires_grad_()
            ids = torch.randint(0, V, (b, L), generator=g)
            topk = torch.randint(0, V, (b, L, 8), generator=g)
            ce, kd = kce.next_token_loss_sums(z, ids)
            ce.backward()
            ce, kd = kce.next_token_loss_sums(z, ids, topk, torch.randn(b, L, 8, generator=g).log_softmax(-1), 2.0)
            (ce + kd).backward()
            ce, kd = kce.next_token_loss_sums(z, ids, teacher_logits=torch.randn(b, L, V, generator=g).to(dtype))
            y = ce + kd
            y.backward()
            return rec.launches
        elif op == "fm-all":  # every head / feature size the kernels take (kernel_fits), two heads each
            for P in (32, 64, 80, 128, 256):
                for F in (16, 64, 128, 256):
                    if kf.kernel_fits(dtype, P, F):
                        u = torch.randn(b, L, 2, P, generator=g).to(dtype).requires_grad_()
                        y = kf._HedgehogFeatureMap.apply(u, torch.randn(2, F, P, requires_grad=True),
                                                         torch.zeros(2, F, requires_grad=True))
                        y.backward(torch.randn_like(y))
            return rec.launches
        else:
            u = torch.randn(b, L, 16, p, generator=g).to(dtype).requires_grad_()
            y = kf._HedgehogFeatureMap.apply(u, torch.randn(16, p, p, requires_grad=True),
                                             torch.zeros(16, p, requires_grad=True))
        y.backward(torch.randn_like(y))
    return rec.launches


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--op", default="ssd", choices=("ssd", "conv", "fm", "fm-all", "ce"),
                    help="the SSD's kernels or a glue op's (ce: stage 2's loss)")
    ap.add_argument("--shape", default="1.4b", choices=sorted(SHAPES))
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--batch", type=int, default=8, help="batch (the fused-pass choice depends on it)")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--only", default="", help="comma-separated substrings: compile only the kernels they name")
    ap.add_argument("--dump", default="", help="a folder: write each compiled kernel's TTGIR, PTX and cubin there")
    args = ap.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    H, G, P, N, norm = SHAPES[args.shape]
    if args.op == "ssd":
        launches = record_launches(H, G, P, N, norm, args.chunk, dtype, args.seq, args.batch)
    else:
        launches = record_glue_launches(args.op, dtype, args.seq, p=P)
    cap = int(args.arch[3:5])
    target = GPUTarget("cuda", cap, 32)
    backend = triton.compiler.make_backend(target)
    what = (f"{args.shape} (H={H}, G={G}, P={P}, N={N}{', normalize' if norm else ''}), chunk {args.chunk}"
            if args.op == "ssd" else "fm at every head and feature size it takes" if args.op == "fm-all"
            else f"{args.op} at the 410m widths{f', heads of {P}' if args.op == 'fm' else ''}")
    print(f"# {what}, {args.dtype}, {args.arch}")
    print("| kernel | warps | stages | tiles | registers | stack (spill) bytes | shared KiB |")
    print("|---|---|---|---|---|---|---|")
    only = [t for t in args.only.split(",") if t]
    for fn, grid, a, kw in launches:
        if only and not any(t in fn.__name__ for t in only):
            continue
        sig, const, attrs = _signature(fn, a, kw)
        opts = {k: kw[k] for k in ("num_warps", "num_stages", "maxnreg") if k in kw}
        src = ASTSource(fn, sig, const, attrs)
        try:
            ck = triton.compile(src, target=target, options=backend.parse_options(opts).__dict__)
            rep = resource_usage(ck.asm["cubin"])
            if args.dump:
                os.makedirs(args.dump, exist_ok=True)
                for kind in ("ttgir", "ptx"):
                    with open(os.path.join(args.dump, f"{fn.__name__}.{kind}"), "w") as f:
                        f.write(ck.asm[kind])
                with open(os.path.join(args.dump, f"{fn.__name__}.cubin"), "wb") as f:
                    f.write(ck.asm["cubin"])
            smem = ck.metadata.shared / 1024
            tiles = ",".join(f"{k}={const[k]}" for k in ("Q", "BP", "BN", "BLOCK", "BL", "BC", "BLOCK_R", "BF")
                             if k in const)
            print(f"| {fn.__name__} | {ck.metadata.num_warps} | {ck.metadata.num_stages} | {tiles} | {rep['regs']} "
                  f"| {rep['stack']} | {smem:.0f} |", flush=True)
        except Exception as e:  # report and go on: one tiling that does not compile should not hide the rest
            print(f"| {fn.__name__} | | | | ERROR {type(e).__name__}: {str(e)[:200]} | | |", flush=True)


if __name__ == "__main__":
    main()
