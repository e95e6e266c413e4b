"""Autograd functions with hand-written backwards for the mixer's glue around the SSD kernel.

Plain autograd of slicing code is wasteful on the GPU: every ``x[..., a:b]`` in the forward becomes a
zero-filled full-size gradient buffer plus a copy in the backward, and the buffers are then summed.
These functions write each gradient once. Their references are the plain-PyTorch versions they
replace (`neox_attention.split_qkv` + `apply_rotary`, `CausalDepthwiseConv`'s loop); tests compare both.

- `split_qkv_rotary(qkv, n_heads, cos, sin)`  the fused per-head ``[q|k|v]`` projection output ->
  rotated q, k and v (NeoX partial rotary: the first ``cos.shape[-1]`` dims of each head).
- `causal_depthwise_conv(x, prev, weight, bias)`  ``y_t = b + sum_j w[:, j] x_{t-(W-1)+j}`` over
  ``[prev, x]`` (no document boundaries; the module's loop handles ``seq_idx``).

Inside a ``torch.compile``d block both fall back to plain code, which inductor fuses (with a generated
backward) into the surrounding graph. On CUDA both are Triton kernels (``kernels.split_qkv_rotary_triton``,
``kernels.causal_depthwise_conv_triton``): one pass each way instead of the several here.
"""

from __future__ import annotations

import torch

import kernels

__all__ = ["split_qkv_rotary", "causal_depthwise_conv"]


def _rope_into(out: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, transpose: bool) -> None:
    """out[...] = R(x) (or R^T(x)) for x, out (b, l, h, p); cos/sin (b|1, l, 1, r), NeoX halves equal."""
    r = cos.shape[-1]
    half = r // 2
    c, s = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., :half], x[..., half:r]
    o1, o2 = out[..., :half], out[..., half:r]
    sign = -1.0 if not transpose else 1.0
    # forward: o1 = x1 c - x2 s, o2 = x2 c + x1 s;  transpose: o1 = x1 c + x2 s, o2 = x2 c - x1 s
    torch.mul(x1, c, out=o1)
    o1.addcmul_(x2, s, value=sign)
    torch.mul(x2, c, out=o2)
    o2.addcmul_(x1, s, value=-sign)
    if r < x.shape[-1]:
        out[..., r:].copy_(x[..., r:])


class _SplitQKVRotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, cos, sin, n_heads: int):
        b, l, three_d = qkv.shape
        p = three_d // (3 * n_heads)
        x = qkv.view(b, l, n_heads, 3 * p)
        cos4, sin4 = cos[:, :, None, :].to(qkv.dtype), sin[:, :, None, :].to(qkv.dtype)
        q = torch.empty(b, l, n_heads, p, dtype=qkv.dtype, device=qkv.device)
        k = torch.empty_like(q)
        _rope_into(q, x[..., :p], cos4, sin4, transpose=False)
        _rope_into(k, x[..., p:2 * p], cos4, sin4, transpose=False)
        v = x[..., 2 * p:]
        ctx.save_for_backward(cos4, sin4)
        ctx.dims = (b, l, n_heads, p)
        return q, k, v

    @staticmethod
    def backward(ctx, gq, gk, gv):
        cos4, sin4 = ctx.saved_tensors
        b, l, h, p = ctx.dims
        dtype = next(g for g in (gq, gk, gv) if g is not None).dtype
        dx = torch.empty(b, l, h, 3 * p, dtype=dtype, device=cos4.device)
        for i, g in enumerate((gq, gk)):
            if g is None:
                dx[..., i * p:(i + 1) * p].zero_()
            else:
                _rope_into(dx[..., i * p:(i + 1) * p], g, cos4, sin4, transpose=True)
        if gv is None:
            dx[..., 2 * p:].zero_()
        else:
            dx[..., 2 * p:].copy_(gv)
        return dx.view(b, l, 3 * h * p), None, None, None


def split_qkv_rotary(qkv: torch.Tensor, n_heads: int, cos: torch.Tensor, sin: torch.Tensor):
    """(b, l, 3*h*p) with per-head [q|k|v] -> q, k rotated on their first r = cos.shape[-1] dims, and v,
    each (b, l, h, p); cos/sin (b or 1, l, r) in the NeoX layout (the two halves repeat)."""
    r = cos.shape[-1]
    if 0 < r and not r % 2 and not torch.compiler.is_compiling() and kernels.resolve_backend(qkv) == "triton":
        return kernels.split_qkv_rotary_triton(qkv, n_heads, cos, sin)  # CUDA: one kernel each way
    if r == 0 or r % 2 or torch.compiler.is_compiling():
        # the plain version: inductor fuses it (and derives its backward) inside a compiled block, where
        # the autograd function's out= writes into views would break the graph
        from hmscale.models.neox_attention import apply_rotary, split_qkv

        q, k, v = split_qkv(qkv, n_heads)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v
    return _SplitQKVRotary.apply(qkv, cos, sin, n_heads)


class _CausalDepthwiseConv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, prev, weight, bias):
        b, l, c = x.shape
        W = weight.shape[1]
        xp = torch.cat([prev.to(x.dtype), x], dim=1)  # (b, W-1+l, C)
        w = weight.to(x.dtype)
        y = xp[:, W - 1:] * w[:, W - 1]
        for j in range(W - 1):
            y.addcmul_(xp[:, j:j + l], w[:, j])
        y.add_(bias.to(x.dtype))
        ctx.save_for_backward(xp, w)
        ctx.meta = (l, W, weight.dtype, bias.dtype, prev.dtype)
        return y, xp[:, xp.shape[1] - (W - 1):]

    @staticmethod
    def backward(ctx, g, g_state):
        xp, w = ctx.saved_tensors
        l, W, w_dtype, b_dtype, prev_dtype = ctx.meta
        g = g.contiguous()
        dxp = torch.zeros_like(xp)
        for j in range(W):
            dxp[:, j:j + l].addcmul_(g, w[:, j])
        if g_state is not None:
            dxp[:, xp.shape[1] - (W - 1):].add_(g_state)
        dw = torch.stack([(xp[:, j:j + l] * g).sum((0, 1), dtype=torch.float32) for j in range(W)], dim=1)
        db = g.sum((0, 1), dtype=torch.float32)
        return dxp[:, W - 1:], dxp[:, :W - 1].to(prev_dtype), dw.to(w_dtype), db.to(b_dtype)


def causal_depthwise_conv(x: torch.Tensor, prev: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor):
    """x (b, l, C), prev (b, W-1, C) (the carried inputs), weight (C, W), bias (C) ->
    (y (b, l, C), the last W-1 inputs (b, W-1, C)). Triton where the kernels' backend is (CUDA), the plain
    version inside compiled graphs, else the autograd function above (CPU)."""
    if torch.compiler.is_compiling():  # inside a compiled block inductor fuses the plain version
        return kernels.causal_depthwise_conv_reference(x, prev, weight, bias)
    if kernels.resolve_backend(x) == "triton":
        return kernels.causal_depthwise_conv_triton(x, prev, weight, bias)
    return _CausalDepthwiseConv.apply(x, prev, weight, bias)
