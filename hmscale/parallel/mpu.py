"""The model-parallel unit DeepSpeed expects (``deepspeed.initialize(..., mpu=...)``), over a ParallelMesh.

Method names follow DeepSpeed/Megatron (both the old ``model_parallel`` and the newer
``tensor_model_parallel`` spellings); there is no pipeline parallelism (its size is 1).
ZeRO then partitions over ``get_data_parallel_group()``.
"""

from __future__ import annotations

from .mesh import ParallelMesh

__all__ = ["MeshMPU"]


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
