"""Low-rank adapters (LoRA) on a model's linear layers, for a stage 2 that keeps the teacher's weights frozen (as
LoLCATs fine-tunes a linearised model).

A wrapped layer computes ``x W^T + b + s (x A^T) B^T`` with ``s = alpha / r``, A (r, in) random, B (out, r) zero:
at step 0 it is the layer it wraps, bit for bit, so stage 2 still starts from the stage-1 model exactly. W and b keep
their parameter names (``in_proj.weight`` stays ``in_proj.weight``; the adapters add ``in_proj.lora_A`` and
``in_proj.lora_B``), so everything that reads the model's weights by name still finds them. ``merged_state_dict``
folds the adapters into W for export: the saved model is a plain HedgeMamba.

Plain PyTorch, applied from outside the model code (``hmscale.train.stage2``), like parallelism.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LoRALinear", "apply_lora", "lora_targets_available", "merged_state_dict", "is_lora_param"]

LORA_PARAM_NAMES = ("lora_A", "lora_B")


def _acc(t: torch.Tensor) -> torch.Tensor:
    """fp32, or float64 kept: the precision the adapter is folded in."""
    return t if t.dtype == torch.float64 else t.float()


def is_lora_param(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in LORA_PARAM_NAMES


class LoRALinear(nn.Module):
    """``base`` (an ``nn.Linear``) plus a rank-``rank`` update scaled by ``alpha / rank``; shares base's parameters."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, generator: torch.Generator | None = None):
        super().__init__()
        if rank <= 0:
            raise ValueError(f"LoRA rank must be positive, got {rank}")
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.rank = int(rank)
        self.scaling = float(alpha) / self.rank
        w = base.weight
        a = torch.empty(self.rank, self.in_features, dtype=torch.float32)
        bound = 1.0 / math.sqrt(self.in_features)  # nn.Linear's default scale for a fan-in of in_features
        a.uniform_(-bound, bound, generator=generator)
        self.lora_A = nn.Parameter(a.to(device=w.device, dtype=w.dtype))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, self.rank, device=w.device, dtype=w.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        return y + F.linear(F.linear(x, self.lora_A), self.lora_B) * self.scaling

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}, scaling={self.scaling:g}"


def lora_targets_available(model: nn.Module) -> list[str]:
    """The names (last component) of the model's linear layers that adapters can wrap."""
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear) and name})


def apply_lora(model: nn.Module, targets, rank: int, alpha: float, seed: int = 0) -> list[str]:
    """Wrap every ``nn.Linear`` whose name ends in one of ``targets`` (e.g. ``in_proj``, ``dense_h_to_4h``) in place;
    returns the wrapped modules' full names. The base weights are left as they are (the caller freezes them)."""
    targets = list(targets)
    if not targets:
        raise ValueError("LoRA: no target layers given; name some linear layers (e.g. in_proj, out_proj)")
    available = lora_targets_available(model)
    unknown = [t for t in targets if t not in available]
    if unknown:
        raise ValueError(f"LoRA targets {unknown} match no linear layer of {type(model).__name__}; "
                         f"choose from {', '.join(available)}")
    gen = torch.Generator().manual_seed(seed)
    wrapped = []
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and child_name in targets:
                setattr(module, child_name, LoRALinear(child, rank, alpha, generator=gen))
                wrapped.append(f"{name}.{child_name}" if name else child_name)
    return wrapped


def merged_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (the model's state dict, e.g. gathered for export) with every adapter folded into its layer's
    weight and the ``lora_A`` / ``lora_B`` entries removed. ``state`` must hold full (not sharded) tensors."""
    out = dict(state)
    for name, m in model.named_modules():
        if not isinstance(m, LoRALinear):
            continue
        prefix = f"{name}." if name else ""
        a, b = out.pop(prefix + "lora_A"), out.pop(prefix + "lora_B")
        w = out[prefix + "weight"]
        out[prefix + "weight"] = (_acc(w) + m.scaling * (_acc(b) @ _acc(a))).to(w.dtype)
    return out
