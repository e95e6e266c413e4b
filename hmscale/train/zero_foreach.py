"""One-launch-per-group gradient norm and overflow check for DeepSpeed's ZeRO-1/2 optimizer.

DeepSpeed 0.19's ``DeepSpeedZeroOptimizer`` visits every gradient of its partition one tensor at a time in
two places of each optimizer step: the overflow check (``has_overflow_partitioned_grads_serial``: amax, amin,
isfinite, logical ops and an add per tensor) and the clipping norm (``get_grad_norm_direct``: an fp64 copy,
a norm and a device move per tensor). With the HedgeMamba student's 555 trainable tensors that is ~8,500 kernel
launches per step, and on the H200 the step's host time (~140 ms for the 410m student, against ~28 ms of device
work) was where the step's wall time went (BENCHMARKS.md, "Student training").

:func:`install` replaces both, on one optimizer instance:

- clipping norm: the L2 norm over the same tensors (alignment padding, pipeline-replicated parameters and the
  model-parallel rule that counts a replicated parameter on tensor-parallel rank 0 only filtered as DeepSpeed
  does), the same all-reduces over the data- and model-parallel groups (skipped for a one-rank group) and the
  same invalid-norm sentinel (-1). When the gradients are views tiling one contiguous buffer (ZeRO-1/2's
  partition, as the engines build it) it is one fp64 reduction over that buffer; otherwise one
  ``torch._foreach_norm`` (fp32 per tensor, summed in fp64);
- overflow: when the norm counts every gradient (no tensor-parallel replicas left out, no MoE, no Muon), the
  norm decides it (``has_overflow_by_norm``: non-finite exactly when some gradient is) and is read by the host
  once for both of DeepSpeed's questions, the overflow flag and the norm's validity, which its step otherwise
  answers with two device synchronisations; else any non-finite value, read from one foreach max-abs norm.

Anything else (ZeRO-3, the CPU-offload path, norms other than L2) keeps DeepSpeed's own code.
Tests: tests/train/test_zero_foreach.py (same norms, same overflow decisions, same training losses).
"""

from __future__ import annotations

import math
import types

import torch

__all__ = ["install", "grad_norm_foreach", "overflow_foreach", "has_overflow_by_norm"]


def _norm_inputs(opt, gradients, params):
    """The gradients DeepSpeed's ``get_grad_norm_direct`` counts, in its order (its generator/zip pairing kept)."""
    from deepspeed.runtime.constants import PIPE_REPLICATED
    from deepspeed.runtime.utils import is_model_parallel_parameter

    kept = []
    grads = [g for g in gradients if not getattr(g, "_zero_padding", False)]
    all_mp_rank0 = opt.model_parallel_rank == 0
    for g, p in zip(grads, params):
        if hasattr(p, PIPE_REPLICATED) and p.ds_pipe_replicated:
            continue
        if all_mp_rank0 or is_model_parallel_parameter(p):
            kept.append(g)
    return kept


def _one_flat_view(tensors):
    """One 1-d view covering exactly these tensors' elements when they tile one contiguous range of one storage
    (ZeRO-2's contiguous gradient buffer: the partition's gradients are views of it, adjacent in some order);
    None otherwise. The norm of that view is the norm of the set."""
    if not tensors:
        return None
    first = tensors[0]
    dtype, storage = first.dtype, first.untyped_storage().data_ptr()
    spans = []
    for t in tensors:
        if t.dtype != dtype or not t.is_contiguous() or t.untyped_storage().data_ptr() != storage:
            return None
        spans.append((t.storage_offset(), t.numel()))
    spans.sort()
    at = spans[0][0]
    for off, n in spans:
        if off != at:  # a gap or an overlap
            return None
        at += n
    base = spans[0][0]
    if at * first.element_size() > first.untyped_storage().nbytes():
        return None
    return first.as_strided((at - base,), (1,), base)


def _sum_of_squares(tensors) -> torch.Tensor:
    """The sum of squares of all elements as a 0-d fp32 tensor: one fp64 reduction over a flat view, else fp32
    per tensor (one foreach norm) summed in fp64."""
    flat = _one_flat_view(tensors)
    if flat is not None:  # one reduction kernel for the whole partition
        return torch.linalg.vector_norm(flat, 2, dtype=torch.float64).pow(2).float()
    norms = torch._foreach_norm(tensors, 2, dtype=torch.float32)
    return torch.stack(norms).double().pow(2).sum().float()


def _all_reduce(opt, tensor, op, group):
    from deepspeed import comm as dist

    if group is None or dist.get_world_size(group=group) > 1:  # a one-rank group's reduce is the identity
        dist.all_reduce(tensor, op=op, group=group)
    opt._model_parallel_all_reduce(tensor=tensor, op=op)


def _group_norm(self, kept):
    from deepspeed import comm as dist

    if kept:
        total_norm = _sum_of_squares(kept).to(self.device)
    else:
        total_norm = torch.tensor(0.0, dtype=torch.float32, device=self.device)
    _all_reduce(self, total_norm, dist.ReduceOp.SUM, self.dp_process_group)
    total_norm = total_norm.pow(0.5)
    # DeepSpeed's invalid-norm sentinel, as its mask_nan_or_inf_with_val_inplace sets it, but without a device
    # synchronisation (its masked_fill_ with a tensor value reads that value on the host)
    return torch.where(torch.isfinite(total_norm), total_norm, torch.full_like(total_norm, -1.0))


def grad_norm_foreach(self, gradients, params, norm_type=2):
    """``get_grad_norm_direct`` for the L2 norm with one foreach norm (one reduction when the gradients are
    views of one contiguous buffer; see the module docstring)."""
    if float(norm_type) != 2.0:
        return type(self).get_grad_norm_direct(self, gradients, params, norm_type)
    return _group_norm(self, _norm_inputs(self, gradients, params))


def overflow_foreach(self):
    """``has_overflow_partitioned_grads_serial`` with one foreach max-abs norm per parameter group."""
    grads = [g for i in range(len(self.bit16_groups)) for g in self.averaged_gradients[i] if g is not None]
    grads = [g for g in grads if g.numel() > 0]
    if not grads:
        return torch.zeros([1], dtype=torch.bool, device=self.device)
    peak = torch.stack(torch._foreach_norm(grads, float("inf"), dtype=torch.float32))  # no per-tensor casts
    return (~torch.isfinite(peak)).any().reshape(1)


def _norm_can_decide_overflow(opt) -> bool:
    """Whether, on every rank alike, the clipping norm counts every gradient: no tensor-parallel group (whose
    replicated parameters count on rank 0 only), no pipeline-replicated parameter, no MoE averaging, a norm
    computed at all. Decided once, at install, so that all ranks take the same collectives."""
    from deepspeed.comm import pg_utils
    from deepspeed.runtime.constants import PIPE_REPLICATED

    if not getattr(opt, "compute_grad_norm", True) or getattr(opt, "has_moe_layers", False):
        return False
    if pg_utils.is_parallel(getattr(opt, "model_parallel_group", None)):
        return False
    return not any(hasattr(p, PIPE_REPLICATED) and p.ds_pipe_replicated for group in opt.bit16_groups for p in group)


def _kept_groups(self) -> list | None:
    """Each group's gradients for a norm that decides the overflow check; None where this step cannot (a Muon
    update to rescale, which DeepSpeed's ``scaled_global_norm`` does, or no decision at install)."""
    if not self._hm_norm_decides_overflow:
        return None
    muon = getattr(self, "_muon_update_lacks_loss_scale", None)
    if muon is not None and any(muon(i) for i in range(len(self.bit16_groups))):
        return None
    kept = []
    for i in range(len(self.bit16_groups)):
        grads = self.averaged_gradients.get(i) or []
        kept.append(_norm_inputs(self, grads, self.params_in_partition[i]))
    return kept


def has_overflow_by_norm(self, partition_gradients=True):
    """``has_overflow`` decided by the clipping norm, computed once for both uses and read with one host copy.

    DeepSpeed's step asks twice, each time waiting for the device: the overflow flag (any non-finite gradient,
    ``.item()``) and then whether the clipping norm is invalid (``bool``). The L2 norm of the partition's
    gradients is non-finite exactly when some gradient is (NaN and +-inf propagate through a sum of squares; a
    finite sum too large for fp32 makes it inf, which DeepSpeed's invalid-norm test rejects in the same step),
    so when the norm counts every gradient the two answers are one: the norm is computed here, copied to the
    host once, and kept for the ``scaled_global_norm`` call that follows in the same step (as a 0-d CPU tensor,
    so that DeepSpeed's invalid-norm test and clipping need no further device synchronisation)."""
    from deepspeed.runtime.utils import combine_grad_norm_groups

    self._hm_norm_stash = None
    kept_groups = _kept_groups(self)
    if kept_groups is None:
        return type(self).has_overflow(self, partition_gradients)
    norm = combine_grad_norm_groups([_group_norm(self, kept) for kept in kept_groups]).cpu()  # the one sync
    value = float(norm)
    overflow = not math.isfinite(value) or value < 0
    if not overflow:
        self._hm_norm_stash = (tuple(self.averaged_gradients.get(i) for i in range(len(kept_groups))), norm)
    return overflow


def scaled_global_norm_stashed(self, norm_type=2):
    """``scaled_global_norm``: the norm the overflow check of this step already computed, if it did (and the
    gradient lists are still the ones it saw); DeepSpeed's otherwise."""
    stash, self._hm_norm_stash = getattr(self, "_hm_norm_stash", None), None
    if stash is not None and norm_type == 2:
        lists, norm = stash
        if len(lists) == len(self.bit16_groups) and all(a is self.averaged_gradients.get(i) for i, a in enumerate(lists)):
            return norm
    return type(self).scaled_global_norm(self, norm_type)


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
    optimizer.has_overflow = types.MethodType(has_overflow_by_norm, optimizer)  # falls back where it cannot
    optimizer.scaled_global_norm = types.MethodType(scaled_global_norm_stashed, optimizer)
    optimizer._hm_norm_stash = None
    optimizer._hm_norm_decides_overflow = _norm_can_decide_overflow(optimizer)
    return True
