"""Parallelism applied from outside the (plain PyTorch) model code: dp x tp mesh, parallel linears,
tensor-parallel sharding of HedgeMamba (and of its LM head by vocabulary), and the mpu object DeepSpeed takes."""

from .compile import apply_compile, keep_gradients_out_of_graph_pool
from .cuda_graphs import apply_cuda_graphs
from .layers import ColumnParallelLinear, RowParallelLinear
from .mesh import ParallelMesh, build_mesh, trivial_mesh
from .mpu import MeshMPU, count_tp_shards_in_grad_norm
from .tp import apply_tensor_parallel, check_tp_divides, full_numel, gather_tensor_parallel_state_dict
from .vocab import VocabShard, shard_lm_head, whole_head_note

__all__ = [
    "apply_compile",
    "keep_gradients_out_of_graph_pool",
    "apply_cuda_graphs",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "ParallelMesh",
    "build_mesh",
    "trivial_mesh",
    "MeshMPU",
    "count_tp_shards_in_grad_norm",
    "apply_tensor_parallel",
    "check_tp_divides",
    "gather_tensor_parallel_state_dict",
    "full_numel",
    "VocabShard",
    "shard_lm_head",
    "whole_head_note",
]
