"""Hedgehog feature map: ``phi(u) = softmax([W u + b, -(W u + b)])`` per head.

One map per layer, holding all heads: ``W`` (h, F, P), ``b`` (h, F), shared by the queries and keys
of a head. ``phi`` has ``2F`` dims (the SSD ``d_state``), and every feature is positive, so the
linear-attention scores ``phi(q) . phi(k)`` and their normaliser are positive.

Initialisation: ``W`` = identity when ``F == P``; ``[I; 0]`` (the head dims, then zero rows) when
``F > P``; ``F`` orthonormal rows (a fixed-seed random rotation, deterministic) when ``F < P``. ``b = 0``.
"""

from __future__ import annotations

import torch
from torch import nn

import kernels

from .fused_ops import compiled_glue_on_triton

__all__ = ["HedgehogFeatureMap", "feature_map_init"]


def feature_map_init(n_heads: int, head_dim: int, feature_dim: int) -> torch.Tensor:
    """The initial W (h, F, P) described in the module docstring (fp32)."""
    F, P = feature_dim, head_dim
    if F >= P:
        w = torch.zeros(F, P)
        w[:P] = torch.eye(P)
    else:
        gen = torch.Generator().manual_seed(0)
        q, _ = torch.linalg.qr(torch.randn(P, P, generator=gen))
        w = q[:F].contiguous()  # F orthonormal rows
    return w.unsqueeze(0).repeat(n_heads, 1, 1)


class HedgehogFeatureMap(nn.Module):
    """phi for all heads of one layer: (..., h, P) -> (..., h, 2F)."""

    def __init__(self, n_heads: int, head_dim: int, feature_dim: int | None = None):
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = head_dim
        self.feature_dim = feature_dim or head_dim
        self.weight = nn.Parameter(feature_map_init(n_heads, head_dim, self.feature_dim))
        self.bias = nn.Parameter(torch.zeros(n_heads, self.feature_dim))

    @property
    def out_dim(self) -> int:
        return 2 * self.feature_dim

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.copy_(feature_map_init(self.n_heads, self.head_dim, self.feature_dim))
            self.bias.zero_()

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        """u (..., h, P) -> phi(u) (..., h, 2F), returned in u's dtype.

        The projection runs in u's dtype (a bf16 model gets a bf16 tensor-core matmul with fp32
        accumulation, not an fp32 one); the bias add and the softmax run in fp32. On CUDA the whole map,
        projection included, is one Triton kernel each way (``kernels.hedgehog_feature_map``), inside compiled
        graphs too (as its custom op; ``HMSCALE_COMPILED_GLUE=inductor`` hands it to inductor's fusion instead:
        ``fused_ops.compiled_glue_on_triton``, the switch of the mixer's other glue). The plain version on CPU and
        with ``HMSCALE_SSD_BACKEND=torch``.
        """
        if kernels.glue_on_triton(u) or compiled_glue_on_triton(u):
            return kernels.hedgehog_feature_map(u, self.weight, self.bias)
        return kernels.hedgehog_feature_map_reference(u, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"heads={self.n_heads}, head_dim={self.head_dim}, feature_dim={self.feature_dim}"
