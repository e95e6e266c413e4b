"""The model-parallel unit DeepSpeed expects (``deepspeed.initialize(..., mpu=...)``), over a ParallelMesh.

Method names follow DeepSpeed/Megatron (both the old ``model_parallel`` and the newer
``tensor_model_parallel`` spellings); there is no pipeline parallelism (its size is 1).
ZeRO then partitions over ``get_data_parallel_group()``.
"""

from __future__ import annotations

from .mesh import ParallelMesh

__all__ = ["MeshMPU", "count_tp_shards_in_grad_norm"]


class MeshMPU:
    def __init__(self, mesh: ParallelMesh):
        self.mesh = mesh

    # tensor (model) parallel
    def get_model_parallel_rank(self) -> int:
        return self.mesh.tp_rank

    def get_model_parallel_world_size(self) -> int:
        return self.mesh.tp_size

    def get_model_parallel_group(self):
        return self.mesh.tp_group

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self.mesh.tp_ranks[0]

    def get_model_parallel_src_rank(self) -> int:
        return self.mesh.tp_ranks[0]

    # data parallel
    def get_data_parallel_rank(self) -> int:
        return self.mesh.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.mesh.dp_size

    def get_data_parallel_group(self):
        return self.mesh.dp_group

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self.mesh.dp_ranks)

    # no pipeline parallelism
    def get_pipeline_model_parallel_world_size(self) -> int:
        return 1

    def get_pipeline_model_parallel_rank(self) -> int:
        return 0

    get_pipe_parallel_world_size = get_pipeline_model_parallel_world_size
    get_pipe_parallel_rank = get_pipeline_model_parallel_rank

    def __repr__(self) -> str:
        return f"MeshMPU({self.mesh!r})"


def count_tp_shards_in_grad_norm(optimizer, mpu) -> bool:
    """Make DeepSpeed's unfused low-precision optimizer (``FP16_UnfusedOptimizer``: ZeRO-0 with bf16, whatever Adam)
    count the tensor-parallel shards' gradients in its clipping norm. It hands the *gradients*, not the parameters, to
    ``get_weight_norm``, which keeps a tensor on a tp rank > 0 only when it carries the ``tensor_model_parallel`` mark:
    gradients never do, so tp rank 1's shards were left out and the global norm (and with it the clipping) was smaller
    than one GPU's (1.24 instead of 1.54 at tp=2). Before each step, the shards' gradients get the mark (the norm
    reads them as they are: same dtype, no copy). Returns whether the optimizer needed it."""
    if mpu is None or mpu.get_model_parallel_world_size() == 1:
        return False
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from deepspeed.runtime.utils import is_model_parallel_parameter

    if not isinstance(optimizer, FP16_UnfusedOptimizer):
        return False
    shards = [p for group in optimizer.fp16_groups for p in group if is_model_parallel_parameter(p)]
    step = optimizer.step

    def step_with_marked_gradients(*args, **kwargs):
        for p in shards:
            if p.grad is not None:
                p.grad.tensor_model_parallel = True
        return step(*args, **kwargs)

    optimizer.step = step_with_marked_gradients
    return True
