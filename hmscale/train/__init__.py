"""Student training: stage 1 (Hedgehog feature maps) and stage 2 (HedgeMamba) on DeepSpeed ZeRO workers.

Entry points
    run_stage1(cfg, run_dir, *, data=None, teacher=None, cache_dir=None, source=None, resume=True,
               resume_from=None, stop_at_step=None, on_checkpoint=None, fault_hook=None, export=True) -> dict
    run_stage2(cfg, run_dir, *, data=None, teacher=None, student=None, model=None, source=None, cache_dir=None,
               resume=True, resume_from=None, stop_at_step=None, on_checkpoint=None, fault_hook=None,
               export=True) -> dict
    ray_jobs.distill.run_distill(cfg, run_dir=None, *, stages=("stage1", "stage2"), log=print,
               storage_path=None) -> dict            # parallel.engine = local | ray
    python -m ray_jobs.distill --config X [-s k=v ...] [--run-dir D] [--stages stage1,stage2]
    hmscale stage1 X [-s k=v]  /  hmscale stage2 X [-s k=v]

Both stages are plain functions of one process: they join the process group that exists (Ray Train's,
torchrun's) or make a one-process one, so the same code runs locally and on N workers.

Run directory (`output_dir`, or --run-dir)
    config.yaml                          the resolved config
    stage1/checkpoints/step_XXXXXXXX/    DeepSpeed checkpoint (tag `state`: model + ZeRO optimizer shards,
                                         client state with step / samples_seen) + meta.json (written last:
                                         a checkpoint is complete when it exists); the newest
                                         `parallel.keep_checkpoints` are kept
    stage1/metrics.jsonl, stage1/tb/     loss (mean over layers), layer_loss/<l>, lr, grad_norm, tokens_per_s
    stage1/student/                      feature_maps.safetensors (`<layer>.weight` (h, F, P), `<layer>.bias`),
                                         student.json (teacher reference, feature_dim, shapes), teacher/ (a
                                         saved copy only when the teacher has no loadable reference)
    stage1/summary.json
    stage2/checkpoints/step_XXXXXXXX/    as for stage 1
    stage2/metrics.jsonl, stage2/tb/     loss, ce, kd, lr, grad_norm, tokens_per_s; eval lines: val_loss, val_ppl
    stage2/hf/                           the final HedgeMamba, `save_pretrained` (safetensors + config),
                                         `AutoModelForCausalLM.from_pretrained(dir)` after `import hmscale.models`
    stage2/summary.json
    ray/                                 Ray Train's storage (reported checkpoints), engine=ray only

Engine (`engine.py`): a ds_configs/*.json (default zero{parallel.zero_stage}.json) filled with the recipe's
micro batch, accumulation, lr, weight decay, clipping, bf16 and ZeRO stage; a warmup + cosine LambdaLR;
the tp mpu (`hmscale.parallel.MeshMPU`) when parallel.tp > 1 (ZeRO 0-2 only). A NaN/inf loss on any rank
stops every rank before the weights change, with a one-line `NonFiniteLoss` naming the step and the last
good checkpoint (which is kept).
"""

from hmscale.train.engine import NonFiniteLoss, TrainingError

__all__ = ["NonFiniteLoss", "TrainingError", "run_stage1", "run_stage2"]


def __getattr__(name):  # lazy: importing hmscale.train does not pull in DeepSpeed or the models
    if name == "run_stage1":
        from hmscale.train.stage1 import run_stage1

        return run_stage1
    if name == "run_stage2":
        from hmscale.train.stage2 import run_stage2

        return run_stage2
    raise AttributeError(name)
