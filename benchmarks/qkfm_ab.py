"""The fused split + rotary + q/k feature map (kernels/qk_feature_map.py) against the split kernel then the feature
map kernel on q and on k, at the 160m and 410m training shapes (8 x 2048 tokens, bf16): per-kernel CUDA time of one
fwd+bwd call (torch.profiler, us), the fused op under several HMSCALE_QKFM_CFG backward tilings.

    python3 benchmarks/qkfm_ab.py
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hmscale.models.neox_attention import rotary_cos_sin  # noqa: E402
from kernels.feature_map import hedgehog_feature_map  # noqa: E402
from kernels.qk_feature_map import qk_feature_maps_triton  # noqa: E402
from kernels.rotary import split_qkv_rotary_triton  # noqa: E402
from ssd import kernel_times  # noqa: E402

CFGS = ["", "bwd=16,4,256", "bwd=16,4,128", "bwd=16,4,64", "bwd=16,2,256", "bwd=16,2,64", "bwd=16,8,128",
        "bwd=32,4,64", "bwd=32,8,64"]


def apart(qkv, h, cos, sin, w, b):
    q, k, v = split_qkv_rotary_triton(qkv, h, cos, sin)
    return hedgehog_feature_map(q, w, b), hedgehog_feature_map(k, w, b), v


def main():
    for name, d, h in (("160m", 768, 12), ("410m", 1024, 16)):
        p = d // h
        g = torch.Generator(device="cuda").manual_seed(0)
        qkv = torch.randn(8, 2048, 3 * d, device="cuda", generator=g).bfloat16().requires_grad_()
        cos, sin = rotary_cos_sin(torch.arange(2048, device="cuda")[None], p // 4, 10000.0, dtype=torch.bfloat16)
        w = (torch.randn(h, p, p, device="cuda", generator=g) / p ** 0.5).requires_grad_()
        b = torch.zeros(h, p, device="cuda", requires_grad=True)
        grads = [torch.randn(8, 2048, h, n, device="cuda", generator=g).bfloat16() for n in (2 * p, 2 * p, p)]

        def times(fn):
            kt = kernel_times(lambda: torch.autograd.backward(fn(qkv, h, cos, sin, w, b), grads), iters=5,
                              label=lambda k: k if k.startswith("_") else "torch")
            return " ".join(f"{k} {v:.0f}" for k, v in sorted(kt.items(), key=lambda kv: -kv[1]) if k != "torch")

        print(f"{name} apart: {times(apart)}", flush=True)
        for c in CFGS:
            os.environ["HMSCALE_QKFM_CFG"] = c
            print(f"{name} fused {c or 'default'}: {times(qk_feature_maps_triton)}", flush=True)
        os.environ["HMSCALE_QKFM_CFG"] = ""
        print(f"{name} apart again: {times(apart)}", flush=True)


if __name__ == "__main__":
    main()
