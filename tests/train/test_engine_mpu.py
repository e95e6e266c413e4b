"""Engines built one after another in one process (stage 1 then stage 2 in one worker) each get their own
model-parallel unit; the distill summary line of stages that were skipped or trained nothing."""

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


def test_summary_line_of_skipped_and_empty_stages(tmp_path):
    from ray_jobs.distill import summary_line

    done = {"done": True, "final_loss": 5.5, "tokens": 100, "seconds": 1.0}
    line = summary_line({"stage2": {**done, "skipped": True}, "seconds": 0.0, "run_dir": str(tmp_path)})
    assert line == f"[distill] nothing to train: stage-2 already done (skipped; loss 5.5), model in {tmp_path}/stage2/hf"
    line = summary_line({"stage1": {**done, "skipped": True}, "stage2": {**done, "final_loss": 4.25},
                         "seconds": 2.0, "run_dir": str(tmp_path)})
    assert line == (f"[distill] done in 2.0 s: stage-1 already done (skipped; loss 5.5), student in {tmp_path}/stage1/student; "
                    f"stage-2 loss 4.25, model in {tmp_path}/stage2/hf")
    # a stage that trained no step in this call and has no loss to show: said, not a crash
    line = summary_line({"stage2": {**done, "final_loss": None}, "seconds": 0.5, "run_dir": str(tmp_path)})
    assert line == f"[distill] done in 0.5 s: stage-2 loss n/a, model in {tmp_path}/stage2/hf"
