"""The mixer's glue around the SSD kernel: the Triton kernels where the kernels' backend is Triton (CUDA),
the plain PyTorch versions elsewhere (CPU). Inside ``torch.compile``d blocks the conv, the split + rotary and the
Hedgehog feature map run as the Triton kernels' custom ops (``HMSCALE_COMPILED_GLUE=triton``, the default) or as
the plain versions that inductor fuses (``inductor``); the switch is ``compiled_glue_on_triton``. In the compiled
410m step on one H200 the custom ops took 144.7 / 147.6 -> 128.2 / 130.4 ms, alternating in one call, and the 160m
step did not lose (BENCHMARKS.md, 2026-12-03 evening). The gate stays inductor's.

- `split_qkv_rotary(qkv, n_heads, cos, sin)`  the fused per-head ``[q|k|v]`` projection output ->
  rotated q, k and v (NeoX partial rotary: the first ``cos.shape[-1]`` dims of each head);
  ``kernels.split_qkv_rotary_triton`` or ``neox_attention.split_qkv`` + ``apply_rotary``.
- `causal_depthwise_conv(x, prev, weight, bias)`  ``y_t = b + sum_j w[:, j] x_{t-(W-1)+j}`` over
  ``[prev, x]`` (no document boundaries; the module's loop handles ``seq_idx``);
  ``kernels.causal_depthwise_conv_triton`` or ``kernels.causal_depthwise_conv_reference``.
- `sigmoid_gate(y, z)`  ``y * 2 sigmoid(z)``; ``kernels.sigmoid_gate_triton`` or ``kernels.sigmoid_gate_reference``.

The Hedgehog feature map makes the same choice (``compiled_glue_on_triton`` included) in
``feature_map.HedgehogFeatureMap``.
"""

from __future__ import annotations

import os

import torch

import kernels

from .neox_attention import apply_rotary, split_qkv

__all__ = ["split_qkv_rotary", "causal_depthwise_conv", "sigmoid_gate", "compiled_glue_on_triton"]


def compiled_glue_on_triton(tensor: torch.Tensor) -> bool:
    """Inside a compiled block on the Triton backend: the glue kernels (conv, split + rotary, Hedgehog feature map) as
    custom ops (``HMSCALE_COMPILED_GLUE=triton``, the default) or inductor's fusion of the plain references
    (``inductor``). False outside compiled blocks (there ``kernels.glue_on_triton`` decides)."""
    if not torch.compiler.is_compiling() or kernels.resolve_backend(tensor) != "triton":
        return False
    choice = os.environ.get("HMSCALE_COMPILED_GLUE", "triton").lower()
    if choice not in ("triton", "inductor"):
        raise ValueError(f"HMSCALE_COMPILED_GLUE must be triton or inductor, got {choice!r}")
    return choice == "triton"


def split_qkv_rotary(qkv: torch.Tensor, n_heads: int, cos: torch.Tensor, sin: torch.Tensor):
    """(b, l, 3*h*p) with per-head [q|k|v] -> q, k rotated on their first r = cos.shape[-1] dims, and v,
    each (b, l, h, p); cos/sin (b or 1, l, r) in the NeoX layout (the two halves repeat)."""
    r = cos.shape[-1]
    if r and not r % 2 and (kernels.glue_on_triton(qkv) or compiled_glue_on_triton(qkv)):
        return kernels.split_qkv_rotary_triton(qkv, n_heads, cos, sin)
    q, k, v = split_qkv(qkv, n_heads)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v


def causal_depthwise_conv(x: torch.Tensor, prev: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor):
    """x (b, l, C), prev (b, W-1, C) (the carried inputs), weight (C, W), bias (C) ->
    (y (b, l, C), the last W-1 inputs (b, W-1, C))."""
    if kernels.glue_on_triton(x) or compiled_glue_on_triton(x):
        return kernels.causal_depthwise_conv_triton(x, prev, weight, bias)
    return kernels.causal_depthwise_conv_reference(x, prev, weight, bias)


def sigmoid_gate(y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """``y * 2 sigmoid(z)``, z (same number of elements) read in y's layout; y's shape and dtype."""
    if kernels.glue_on_triton(y):
        return kernels.sigmoid_gate_triton(y, z)
    return kernels.sigmoid_gate_reference(y, z)
