"""Gradient bucketing for DeepSpeed's ZeRO-1/2 optimizer with a few tensor ops per bucket instead of per tensor.

DeepSpeed 0.19's ``DeepSpeedZeroOptimizer`` runs, for every trainable tensor in every backward (ZeRO-2: from
each parameter's gradient hook; ZeRO-1: at the accumulation boundary), ``reduce_independent_p_g_buckets_and_
remove_grads`` (a narrow, a copy into the bucket and ~20 attribute and bookkeeping calls) and, when the bucket is
flushed, ``copy_grads_in_partition`` (another narrow and copy). On the H200 that host work, ~75 us per tensor,
is where a 160m HedgeMamba step's GPU sat idle (279 tensors: 22 ms of idle inside the backward's hooks;
BENCHMARKS.md, "Student training", 2026-12-03 evening).

:func:`install` replaces both methods on one optimizer instance:

- the hook's part only records the gradient (its offset in the bucket); the gradient stays where autograd put
  it until the flush (at most one bucket's worth longer, ``reduce_bucket_size`` elements);
- the flush copies all recorded gradients into the bucket with one ``torch._foreach_copy_``, reduces the bucket
  as DeepSpeed does (``average_tensor``), and copies the partition's gradients into ``grads_in_partition`` with
  one more foreach copy. With one data-parallel rank (the reduction is the identity) the gradients go straight
  from autograd's tensors to ``grads_in_partition``, one copy instead of DeepSpeed's two, each at its place in the
  partition's own order, so that the step reads the buffer as the flat gradient partition (one conversion to fp32)
  instead of concatenating the ~300 gradient views first.
  Each parameter's ``.grad`` then aliases the same storage DeepSpeed's own code would have given it, so the
  epilogue, gradient accumulation, clipping and the step are DeepSpeed's, unchanged.

Only the plain configuration is taken over: contiguous gradients, no ``overlap_comm``, no CPU offload, no MoE,
ZenFlow, Muon or the fp32 compact gradient buffer (``grad_accum_dtype`` other than the parameters' dtype).
Anything else keeps DeepSpeed's own methods (``install`` returns False).
Tests: tests/train/test_zero_buckets.py (the same gradients, losses and parameters as DeepSpeed's own code,
ZeRO-1 and 2, one and two ranks, several flushes per backward, an oversized tensor, gradient accumulation).
"""

from __future__ import annotations

import types

import torch

__all__ = ["install", "supported"]


def _name(param) -> str:
    return str(getattr(param, "ds_name", None) or tuple(param.shape))


def _already_reduced(param) -> RuntimeError:
    return RuntimeError(f"ZeRO gradient bucketing: the gradient of parameter {_name(param)} was reduced twice in "
                        "one backward (DeepSpeed's ZeRO-1/2 supports one gradient per parameter and backward)")


def record_gradient(self, param, i):
    """Bucket one parameter's gradient (stands in for ``reduce_independent_p_g_buckets_and_remove_grads``)."""
    numel = param.numel()
    if numel == 0:
        return
    grad = self.get_gradient_for_reduction(param)
    comm_dtype = self.get_param_comm_dtype(param)
    bucket = self.ipg_buckets[comm_dtype]
    if bucket.elements + numel > self.reduce_bucket_size:
        self.reduce_ipg_grads(comm_dtype=comm_dtype)
    if not getattr(param, "ds_grad_is_ready", True):
        return
    param_id = self.get_param_id(param)
    if self.params_already_reduced[param_id]:
        raise _already_reduced(param)
    if grad is None:
        raise RuntimeError(f"ZeRO gradient bucketing: parameter {_name(param)}'s gradient hook ran without a gradient")
    if numel > self.reduce_bucket_size:  # alone in its bucket, reduced in place (as DeepSpeed does)
        self.extra_large_param_to_reduce[comm_dtype] = param
    elif not self._hm_identity:  # copied into the bucket at the flush (with one rank: no bucket, see below)
        self._hm_pending.setdefault(comm_dtype, []).append((bucket.elements, grad))
    bucket.elements += numel
    bucket.grads.append(grad)
    bucket.params.append((i, param.param_idx_in_group, param_id))


def _move_into(grads, flat: torch.Tensor, offsets=None) -> None:
    """Copy the gradients into ``flat`` (back to back, or at ``offsets``), then point each gradient at its copy:
    one foreach copy and, back to back, one split for all the destination views."""
    if not grads:
        return
    sizes = [g.numel() for g in grads]
    if offsets is None:
        dests = torch.split(flat.narrow(0, 0, sum(sizes)), sizes)
    else:
        dests = [flat.narrow(0, off, n) for off, n in zip(offsets, sizes)]
    torch._foreach_copy_(dests, [g.view(-1) for g in grads])
    for g, d in zip(grads, dests):
        g.data = d.view_as(g)


def _is_identity(self) -> bool:
    """A reduction over one rank is the identity (DeepSpeed divides by 1.0 and reduces to itself)."""
    from deepspeed import comm as dist

    return dist.get_world_size(group=self.dp_process_group) == 1 and getattr(self, "sequence_parallel_size", 1) == 1


def _partition_buffer(self) -> torch.Tensor:
    if self.grads_in_partition is None:  # allocated on first use, as DeepSpeed's copy_grads_in_partition does
        from deepspeed.accelerator import get_accelerator

        total = sum(p.numel() for group in self.params_in_partition for p in group)
        self.grads_in_partition_offset = 0
        self.grads_in_partition = torch.empty(int(total), dtype=self.dtype,
                                              device=get_accelerator().current_device_name())
    return self.grads_in_partition.view(-1)


def flush_buckets(self, comm_dtype=None):
    """Reduce the bucket(s) and keep this rank's partition (stands in for ``reduce_ipg_grads``)."""
    from deepspeed.runtime.torch_autocast import sort_dtypes

    dtypes = [comm_dtype] if comm_dtype is not None else sort_dtypes(self.ipg_buckets.keys())
    identity = self._hm_identity
    for dt in dtypes:
        if identity:  # nothing to reduce (and nothing pending): the gradients go straight to the partition buffer
            self.extra_large_param_to_reduce.pop(dt, None)
            continue
        bucket = self.ipg_buckets[dt]
        pending = self._hm_pending.pop(dt, [])
        buf = bucket.buffer[bucket.index] if bucket.buffer else None
        _move_into([g for _, g in pending], buf, [off for off, _ in pending])
        if dt in self.extra_large_param_to_reduce:
            if len(bucket.params) != 1:
                raise RuntimeError("ZeRO gradient bucketing: an oversized gradient shares its bucket")
            g = self.get_gradient_for_reduction(self.extra_large_param_to_reduce.pop(dt))
            self.average_tensor(g.view(-1), dt)
        elif bucket.elements:
            self.average_tensor(buf.narrow(0, 0, bucket.elements), dt)
    for dt in dtypes:
        bucket = self.ipg_buckets[dt]
        keep = []
        for group_idx, idx_in_group, param_id in bucket.params:
            param = self.bit16_groups[group_idx][idx_in_group]
            if self.params_already_reduced[param_id]:
                raise _already_reduced(param)
            self.params_already_reduced[param_id] = True
            if self.is_param_in_current_partition[param_id]:
                keep.append(param)
            elif self.partition_gradients:  # ZeRO-2 frees the gradients other ranks own
                self.clear_grad_attribute(param)
        if keep:
            flat = _partition_buffer(self)
            grads = [self.get_gradient_for_reduction(p) for p in keep]
            start = self.grads_in_partition_offset
            if identity:  # in the partition's own order: the step's flat gradient partition is then this buffer
                offsets = _partition_offsets(self)
                _move_into(grads, flat, [offsets[self.get_param_id(p)] for p in keep])
            else:
                _move_into(grads, flat.narrow(0, start, flat.numel() - start))
            self.grads_in_partition_offset = start + sum(g.numel() for g in grads)
        bucket.clear()


def _partition_offsets(self) -> dict:
    """With one rank, each parameter's offset in ``grads_in_partition`` when the buffer is laid out in the
    partition's own order (group by group, parameter by parameter: the order of the fp32 master partition)
    rather than in the order the gradients arrive."""
    offsets = getattr(self, "_hm_offsets", None)
    if offsets is None:
        offsets, at = {}, 0
        for group in self.params_in_partition:
            for p in group:
                offsets[self.get_param_id(p)] = at
                at += p.numel()
        self._hm_offsets = offsets
    return offsets


def _in_order_view(tensors):
    """One 1-d view of the tensors when each starts where the one before it ends, in one storage; else None."""
    if not tensors:
        return None
    first = tensors[0]
    storage, at = first.untyped_storage().data_ptr(), first.storage_offset()
    for t in tensors:
        if (t.dtype != first.dtype or not t.is_contiguous() or t.storage_offset() != at
                or t.untyped_storage().data_ptr() != storage):
            return None
        at += t.numel()
    return first.as_strided((at - first.storage_offset(),), (1,), first.storage_offset())


def preflattened_partition(self, group_idx):
    """``_get_preflattened_grad_partition``: with one rank, the gradient buffer itself when the group's averaged
    gradients are its consecutive views and fill the partition, so the step converts it to fp32 directly instead
    of first concatenating ~300 views into a copy (DeepSpeed's flatten); DeepSpeed's answer otherwise."""
    flat = type(self)._get_preflattened_grad_partition(self, group_idx)
    if flat is not None or not self._hm_identity:
        return flat
    view = _in_order_view(self.averaged_gradients.get(group_idx) or [])
    if view is None or view.numel() != int(self.partition_size[group_idx]):
        return None
    return view


def supported(optimizer) -> bool:
    """Whether ``optimizer`` is a ZeRO-1/2 optimizer in the configuration :func:`install` takes over."""
    try:
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    except ImportError:  # pragma: no cover - DeepSpeed is a dependency
        return False
    if not isinstance(optimizer, DeepSpeedZeroOptimizer):
        return False
    o = optimizer
    plain = (o.contiguous_gradients and not o.overlap_comm and not getattr(o, "cpu_offload", False)
             and not getattr(o, "zenflow", False) and not getattr(o, "has_moe_layers", False)
             and not getattr(o, "use_grad_accum_attribute", False)
             and getattr(o, "autoep_folding_tp_group", None) is None)
    return plain and not any(o._use_compact_grad_partition_buffer(i) for i in range(len(o.bit16_groups)))


def install(optimizer) -> bool:
    """Use the bucketed versions on this optimizer when :func:`supported`; returns whether they were installed."""
    if not supported(optimizer):
        return False
    optimizer._hm_pending = {}
    optimizer._hm_identity = _is_identity(optimizer)
    optimizer.reduce_independent_p_g_buckets_and_remove_grads = types.MethodType(record_gradient, optimizer)
    optimizer.reduce_ipg_grads = types.MethodType(flush_buckets, optimizer)
    optimizer._get_preflattened_grad_partition = types.MethodType(preflattened_partition, optimizer)
    return True
