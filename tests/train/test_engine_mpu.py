"""Engines built one after another in one process (stage 1 then stage 2 in one worker) each get their own
model-parallel unit."""

import torch
import torch.distributed as dist


class _LayerParallelLikeMPU:
    """What stage 1's layer-parallel mpu reports on one of two workers: the whole world is the model-parallel
    group, the rank alone its data-parallel group."""

    def __init__(self):
        self.dp = dist.new_group([dist.get_rank()])

    def get_model_parallel_rank(self):
        return 0

    def get_model_parallel_world_size(self):
        return 2

    def get_model_parallel_group(self):
        return dist.group.WORLD

    def get_data_parallel_rank(self):
        return 0

    def get_data_parallel_world_size(self):
        return 1

    def get_data_parallel_group(self):
        return self.dp

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group


def test_an_engine_without_mpu_does_not_inherit_the_previous_engines():
    from deepspeed.utils import groups

    from hmscale.train.engine import OptimSpec, build_engine, init_distributed

    init_distributed(False)
    spec = OptimSpec(lr=1e-3, micro_batch_size=1, zero_stage=1, adam="foreach")
    mpu = _LayerParallelLikeMPU()
    first = build_engine(torch.nn.Linear(4, 4), spec, dp_world=1, mpu=mpu)
    assert first.mp_world_size == 2 and first.data_parallel_group is mpu.dp
    # DeepSpeed kept `mpu` in deepspeed.utils.groups.mpu: this one used to take its model-parallel size (and fail on
    # its own missing mpu: "'NoneType' object has no attribute 'get_model_parallel_rank'") and its groups
    second = build_engine(torch.nn.Linear(4, 4), spec, dp_world=1)
    assert second.mp_world_size == 1 and second.data_parallel_group is not mpu.dp and groups.mpu is None
    assert dist.get_world_size(second.data_parallel_group) == dist.get_world_size()

