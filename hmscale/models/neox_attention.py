"""GPT-NeoX attention pieces in plain PyTorch, shared by the teacher capture and both students.

Shapes follow the kernels' convention: (batch, length, heads, head_dim).
The fused `query_key_value` weight is interleaved per head: for head i its output rows are
`[q_i | k_i | v_i]`, each `head_dim` long.
"""

from __future__ import annotations

import math

import torch


def rotary_fraction(config) -> float:
    """Fraction of each head's dims that rotary touches (transformers 5: rope_parameters; older: rotary_pct)."""
    params = getattr(config, "rope_parameters", None) or {}
    return float(params.get("partial_rotary_factor", getattr(config, "rotary_pct", 1.0)))


def rotary_ndims(config) -> int:
    return int(config.hidden_size // config.num_attention_heads * rotary_fraction(config))


def rope_type(config) -> str:
    """The rotary embedding's type ("default": plain; transformers 5 also builds linear, dynamic, yarn, ...), of a
    model's config or of config.json as read (where, as transformers reads it, the legacy rope_scaling wins)."""
    if isinstance(config, dict):
        params = config.get("rope_scaling") or config.get("rope_parameters") or {}
    else:  # (transformers 4 keeps the scaling in rope_scaling: no rope_parameters)
        params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return str(params.get("rope_type", params.get("type", "default")))


def check_default_rope(config, where: str) -> None:
    """One-line ValueError for a teacher config whose rotary embedding is scaled: the capture's q, k and both students
    compute the default (unscaled) rotary only, so they would silently not be the teacher's."""
    kind = rope_type(config)
    if kind != "default":
        raise ValueError(f"{where}: the teacher uses rope_type={kind!r}; hmscale's capture and students implement the "
                         "default (unscaled) rotary embedding only: use a teacher without rope scaling")


def rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(config, "rotary_emb_base", 10000.0)))


def rotary_cos_sin(positions: torch.Tensor, ndims: int, base: float, dtype=torch.float32):
    """cos, sin of shape (*positions.shape, ndims), NeoX layout (frequencies repeated twice)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, ndims, 2, dtype=torch.float32, device=positions.device) / ndims))
    freqs = positions.to(torch.float32)[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first cos.shape[-1] dims of x (b, l, h, p); cos/sin are (b or 1, l, r)."""
    r = cos.shape[-1]
    if r == 0:
        return x
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    x_rot, x_pass = x[..., :r], x[..., r:]
    return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)


def split_qkv(qkv: torch.Tensor, n_heads: int):
    """(b, l, 3*h*p) fused projection output -> q, k, v each (b, l, h, p)."""
    b, l, three_d = qkv.shape
    p = three_d // (3 * n_heads)
    qkv = qkv.view(b, l, n_heads, 3 * p)
    return qkv[..., :p], qkv[..., p : 2 * p], qkv[..., 2 * p :]


def positions_for(input_ids: torch.Tensor, offset: int = 0) -> torch.Tensor:
    return (torch.arange(input_ids.shape[1], device=input_ids.device) + offset)[None, :]


def qkv_with_rotary(attn_module, h: torch.Tensor, config, positions: torch.Tensor | None = None):
    """q, k (rotated) and v of a `GPTNeoXAttention` module for its LayerNorm-ed input h (b, l, d)."""
    n_heads = config.num_attention_heads
    q, k, v = split_qkv(attn_module.query_key_value(h), n_heads)
    if positions is None:
        positions = torch.arange(h.shape[1], device=h.device)[None, :]
    cos, sin = rotary_cos_sin(positions, rotary_ndims(config), rope_theta(config), dtype=h.dtype)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v


def softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal softmax attention, (b, l, h, p) in and out; the teacher's math, in fp32 accumulate."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale
    )
    return out.transpose(1, 2)
