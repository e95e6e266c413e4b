"""The mixer's conv + qkv split + rotary, forward and forward+backward, at a training shape: the fused kernel
(``kernels.conv_split_rotary_triton``) against the two Triton kernels it replaces (``causal_depthwise_conv_triton``
then ``split_qkv_rotary_triton``, the eager path before it) and against inductor's fusion of the plain
composition (what a compiled block ran before it), measured in the same run with ``triton.testing.do_bench``.

    python3 benchmarks/conv_rotary.py                  # 410m training call: 8 x 2048 tokens, 16 heads of 64, W=4
    python3 benchmarks/conv_rotary.py --heads 12       # 160m
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--rotary", type=int, default=16)
    ap.add_argument("--width", type=int, default=4)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("conv_rotary: needs a CUDA device", file=sys.stderr)
        return 2
    from triton.testing import do_bench

    from hmscale.models.neox_attention import apply_rotary, rotary_cos_sin, split_qkv
    from kernels.conv import causal_depthwise_conv_triton
    from kernels.conv_rotary import conv_split_rotary_triton
    from kernels.reference import causal_depthwise_conv_reference
    from kernels.rotary import split_qkv_rotary_triton

    b, l, h, p, r, W = args.batch, args.seq, args.heads, args.head_dim, args.rotary, args.width
    dev, dt = "cuda", torch.bfloat16
    c3 = 3 * h * p
    g = torch.Generator(device=dev).manual_seed(0)
    qkv = torch.randn(b, l, c3, device=dev, dtype=dt, generator=g).requires_grad_()
    weight = (torch.randn(c3, W, device=dev, generator=g) / W ** 0.5).to(dt).requires_grad_()
    bias = (0.1 * torch.randn(c3, device=dev, generator=g)).to(dt).requires_grad_()
    cos, sin = rotary_cos_sin(torch.arange(l, device=dev)[None], r, 10000.0, dtype=dt)
    grads = [torch.randn(b, l, h, p, device=dev, dtype=dt, generator=g) for _ in range(3)]
    prev = torch.zeros(b, W - 1, c3, device=dev, dtype=dt)

    def fused(x, w, bb):
        return conv_split_rotary_triton(x, w, bb, h, cos, sin)

    def two_kernels(x, w, bb):
        c, _ = causal_depthwise_conv_triton(x, prev, w, bb)
        return split_qkv_rotary_triton(c, h, cos, sin)

    def plain(x, w, bb):
        c, _ = causal_depthwise_conv_reference(x, prev, w, bb)
        q, k, v = split_qkv(c, h)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    inductor = torch.compile(plain, dynamic=False)
    bytes_moved = qkv.numel() * 2 * 2  # read qkv, write q, k, v (bf16): the forward's floor
    print(f"# conv + split + rotary, b={b} l={l} h={h} P={p} r={r} W={W}, bf16, {torch.cuda.get_device_name(0)}, "
          f"torch {torch.__version__}")
    print("| implementation | fwd ms | fwd+bwd ms | fwd GB/s (qkv in, q/k/v out) | max |diff| vs plain (fwd) |")
    print("|---|---|---|---|---|")
    ref = [o.float() for o in plain(qkv, weight, bias)]
    for name, fn in (("fused (kernels.conv_rotary)", fused), ("conv then split+rotary (2 Triton kernels)", two_kernels),
                     ("inductor (torch.compile of the plain steps)", inductor)):
        with torch.no_grad():
            outs = fn(qkv, weight, bias)
        diff = max((o.float() - rr).abs().max().item() for o, rr in zip(outs, ref))

        def fwd():
            with torch.no_grad():
                fn(qkv, weight, bias)

        def fwd_bwd():
            outs = fn(qkv, weight, bias)
            torch.autograd.backward(outs, grads)

        fwd_bwd()  # compile / warm
        t_f = do_bench(fwd, warmup=10, rep=50)
        t_fb = do_bench(fwd_bwd, warmup=10, rep=50, grad_to_none=[qkv, weight, bias])
        print(f"| {name} | {t_f:.3f} | {t_fb:.3f} | {bytes_moved / t_f / 1e6:.0f} | {diff:.2e} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
