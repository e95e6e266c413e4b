"""Column- and row-parallel linear layers (Megatron style), plain autograd.

- :class:`ColumnParallelLinear` holds a slice of the output features. Its input is replicated over the
  tp group: forward is the identity on it, backward all-reduces the input gradient (each rank only
  saw its slice of the outputs).
- :class:`RowParallelLinear` holds a slice of the input features and takes the matching slice of its
  input (``input_is_parallel``). Forward all-reduces the partial products, then adds the (replicated)
  bias once; backward is the identity.

With tp = 1 (no group) both are ordinary linears. Sharded parameters carry ``tensor_model_parallel``
(DeepSpeed's gradient-norm code looks for it) and ``tp_split_dim`` (for gathering a full state dict).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "copy_to_tp_region", "reduce_from_tp_region",
           "mark_tp_param"]


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


# Both run outside torch.compile graphs: dynamo would trace the in-place collectives into the graph, and
# a compiled tp=2 model trained to other losses than one GPU on H200s (eager matched). Kept opaque, the
# compiled pieces between them are local math, and the collectives keep their eager (verified) autograd.
@torch.compiler.disable
def copy_to_tp_region(x: torch.Tensor, group, tp_size: int) -> torch.Tensor:
    return x if tp_size == 1 else _CopyToTP.apply(x, group)


@torch.compiler.disable
def reduce_from_tp_region(x: torch.Tensor, group, tp_size: int) -> torch.Tensor:
    return x if tp_size == 1 else _ReduceFromTP.apply(x, group)


def mark_tp_param(p: torch.nn.Parameter, dim: int) -> torch.nn.Parameter:
    p.tensor_model_parallel = True
    p.model_parallel = True
    p.tp_split_dim = dim
    return p


class ColumnParallelLinear(nn.Module):
    """y_local = x W_local^T + b_local, W_local = rows ``index`` of the full weight."""

    def __init__(self, in_features: int, out_features_local: int, bias: bool = True, group=None, tp_size: int = 1,
                 device=None, dtype=None, reduce_input_grad: bool = True):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features_local
        self.group, self.tp_size = group, tp_size
        # False when the caller already put the input through copy_to_tp_region (one all-reduce of the
        # input gradient for several column-parallel layers reading the same input)
        self.reduce_input_grad = reduce_input_grad
        self.weight = mark_tp_param(nn.Parameter(torch.empty(out_features_local, in_features, device=device, dtype=dtype)), 0)
        self.bias = mark_tp_param(nn.Parameter(torch.zeros(out_features_local, device=device, dtype=dtype)), 0) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, index: torch.Tensor, mesh, reduce_input_grad: bool = True) -> "ColumnParallelLinear":
        w = linear.weight.detach()
        new = cls(linear.in_features, len(index), linear.bias is not None, mesh.tp_group, mesh.tp_size,
                  device=w.device, dtype=w.dtype, reduce_input_grad=reduce_input_grad)
        with torch.no_grad():
            new.weight.copy_(w[index])
            if linear.bias is not None:
                new.bias.copy_(linear.bias.detach()[index])
        new.weight.requires_grad_(linear.weight.requires_grad)
        if linear.bias is not None:
            new.bias.requires_grad_(linear.bias.requires_grad)
        return new

    def forward(self, x):
        if self.reduce_input_grad:
            x = copy_to_tp_region(x, self.group, self.tp_size)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self):
        return f"in={self.in_features}, out_local={self.out_features}, tp={self.tp_size}"


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_local W_local^T) + b, W_local = columns ``index`` of the full weight."""

    def __init__(self, in_features_local: int, out_features: int, bias: bool = True, group=None, tp_size: int = 1,
                 device=None, dtype=None):
        super().__init__()
        self.in_features = in_features_local
        self.out_features = out_features
        self.group, self.tp_size = group, tp_size
        self.weight = mark_tp_param(nn.Parameter(torch.empty(out_features, in_features_local, device=device, dtype=dtype)), 1)
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, index: torch.Tensor, mesh) -> "RowParallelLinear":
        w = linear.weight.detach()
        new = cls(len(index), linear.out_features, linear.bias is not None, mesh.tp_group, mesh.tp_size,
                  device=w.device, dtype=w.dtype)
        with torch.no_grad():
            new.weight.copy_(w[:, index])
            if linear.bias is not None:
                new.bias.copy_(linear.bias.detach())
        new.weight.requires_grad_(linear.weight.requires_grad)
        if linear.bias is not None:
            new.bias.requires_grad_(linear.bias.requires_grad)
        return new

    def forward(self, x):
        y = reduce_from_tp_region(F.linear(x, self.weight), self.group, self.tp_size)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self):
        return f"in_local={self.in_features}, out={self.out_features}, tp={self.tp_size}"
