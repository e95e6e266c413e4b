"""One-launch-per-group gradient norm and overflow check for DeepSpeed's ZeRO-1/2 optimizer.

DeepSpeed 0.19's ``DeepSpeedZeroOptimizer`` visits every gradient of its partition one tensor at a time in
two places of each optimizer step: the overflow check (``has_overflow_partitioned_grads_serial``: amax, amin,
isfinite, logical ops and an add per tensor) and the clipping norm (``get_grad_norm_direct``: an fp64 copy,
a norm and a device move per tensor). With the HedgeMamba student's 555 trainable tensors that is ~8,500 kernel
launches per step, and on the H200 the step's host time (~140 ms for the 410m student, against ~28 ms of device
work) was where the step's wall time went (BENCHMARKS.md, "Student training").

:func:`install` replaces both, on one optimizer instance, by ``torch._foreach_norm`` over the same tensors
(a handful of launches for all of them):

- overflow: any non-finite value, read from the max-abs norm of each tensor (exact in any dtype: NaN and
  +-inf propagate through it, and it cannot overflow as a sum of squares can);
- clipping norm: the same L2 norm, with the same tensor filtering (alignment padding, pipeline-replicated
  parameters, the model-parallel rule that counts a replicated parameter on tensor-parallel rank 0 only),
  the same all-reduces over the data- and model-parallel groups and the same invalid-norm sentinel (-1);
  accumulated in fp32 per tensor (DeepSpeed's loop casts each gradient to fp64 first) and summed in fp64.

Anything else (ZeRO-3, the CPU-offload path, norms other than L2) keeps DeepSpeed's own code.
Tests: tests/train/test_zero_foreach.py (same norms, same overflow decisions, same training losses).
"""

from __future__ import annotations

import types

import torch

__all__ = ["install", "grad_norm_foreach", "overflow_foreach"]


def _norm_inputs(opt, gradients, params):
    """The gradients DeepSpeed's ``get_grad_norm_direct`` counts, in its order (its generator/zip pairing kept)."""
    from deepspeed.runtime.constants import PIPE_REPLICATED
    from deepspeed.runtime.utils import is_model_parallel_parameter

    kept = []
    grads = (g for g in gradients if not getattr(g, "_zero_padding", False))
    for g, p in zip(grads, params):
        if hasattr(p, PIPE_REPLICATED) and p.ds_pipe_replicated:
            continue
        if is_model_parallel_parameter(p) or opt.model_parallel_rank == 0:
            kept.append(g.detach())
    return kept


def grad_norm_foreach(self, gradients, params, norm_type=2):
    """``get_grad_norm_direct`` for the L2 norm with one foreach norm (see the module docstring)."""
    from deepspeed import comm as dist
    from deepspeed.runtime.utils import mask_nan_or_inf_with_val_inplace

    if float(norm_type) != 2.0:
        return type(self).get_grad_norm_direct(self, gradients, params, norm_type)
    kept = _norm_inputs(self, gradients, params)
    if kept:
        norms = torch._foreach_norm(kept, 2, dtype=torch.float32)
        total_norm = torch.stack(norms).double().pow(2).sum().float().to(self.device)
    else:
        total_norm = torch.tensor(0.0, dtype=torch.float32, device=self.device)
    dist.all_reduce(total_norm, op=dist.ReduceOp.SUM, group=self.dp_process_group)
    self._model_parallel_all_reduce(tensor=total_norm, op=dist.ReduceOp.SUM)
    total_norm = total_norm.pow(0.5)
    mask_nan_or_inf_with_val_inplace(total_norm, device=self.device)
    return total_norm


def overflow_foreach(self):
    """``has_overflow_partitioned_grads_serial`` with one foreach max-abs norm per parameter group."""
    grads = [g.detach() for i in range(len(self.bit16_groups)) for g in self.averaged_gradients[i] if g is not None]
    grads = [g for g in grads if g.numel() > 0]
    if not grads:
        return torch.zeros([1], dtype=torch.bool, device=self.device)
    peak = torch.stack(torch._foreach_norm(grads, float("inf"), dtype=torch.float32))  # no per-tensor casts
    return (~torch.isfinite(peak)).any().reshape(1)


def install(optimizer) -> bool:
    """Use the foreach versions on this ZeRO-1/2 optimizer (no effect on any other optimizer, nor with CPU
    offload, whose overflow tracking happens during the backward). Returns whether they were installed."""
    try:
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    except ImportError:  # pragma: no cover - DeepSpeed is a dependency
        return False
    if not isinstance(optimizer, DeepSpeedZeroOptimizer) or getattr(optimizer, "cpu_offload", False):
        return False
    optimizer.get_grad_norm_direct = types.MethodType(grad_norm_foreach, optimizer)
    optimizer.has_overflow_partitioned_grads_serial = types.MethodType(overflow_foreach, optimizer)
    return True
