"""Pieces shared by the two stages: process layout (dp x tp), run-dir paths, seeding, HF export."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hmscale.train.engine import TrainingError, barrier, device_for, init_distributed


@dataclass
class Layout:
    rank: int
    world: int
    dp_rank: int
    dp_size: int
    tp_rank: int
    tp_size: int
    device: torch.device
    mesh: Any = None  # hmscale.parallel mesh when tp > 1
    mpu: Any = None  # what DeepSpeed gets as `mpu`


def seed_everything(seed: int):
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def setup_layout(cfg, *, tp: int | None = None, zero_stage: int | None = None) -> Layout:
    """Join the process group and split it into dp x tp (tp groups are consecutive ranks)."""
    par = cfg.parallel
    tp = par.tp if tp is None else tp
    zero_stage = par.zero if zero_stage is None else zero_stage  # (a ds_config file's own stage, when it names one)
    if tp > 1 and zero_stage >= 3:
        via = (f" (parallel.ds_config {Path(par.ds_config).name} sets it)" if zero_stage != par.zero_stage else "")
        raise TrainingError(f"parallel: tensor parallelism (tp={tp}) works with ZeRO 0, 1 or 2, not ZeRO {zero_stage}"
                            f"{via}; set parallel.tp=1, or ZeRO <= 2")
    rank, world = init_distributed(par.use_gpu)
    device = device_for(par.use_gpu)
    if world % tp:
        raise TrainingError(f"parallel.tp: {tp} does not divide the {world} workers; set num_workers to a multiple of tp")
    if tp == 1:
        return Layout(rank, world, rank, world, 0, 1, device)
    from hmscale.parallel import MeshMPU, build_mesh

    mesh = build_mesh(tp=tp)
    return Layout(rank, world, mesh.dp_rank, mesh.dp_size, mesh.tp_rank, mesh.tp_size, device, mesh, MeshMPU(mesh))


def stage_dir(run_dir, stage: str) -> Path:
    return Path(run_dir) / stage


def export_hf(engine, out_dir: Path, layout: Layout, zero_stage: int, extra_files: dict[str, str] | None = None):
    """save_pretrained of the trained module (ZeRO-3 params gathered, tp shards gathered) by rank 0."""
    import deepspeed

    from hmscale.models.lora import merged_state_dict

    module = engine.module
    out_dir = Path(out_dir)
    params = list(module.parameters())

    def _save():
        if layout.tp_size > 1:
            from hmscale.parallel import gather_tensor_parallel_state_dict

            state = gather_tensor_parallel_state_dict(module, layout.mesh)
        else:
            state = {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
        state = merged_state_dict(module, state)  # LoRA adapters folded in (none: unchanged)
        if layout.rank == 0:
            tmp = out_dir.with_name(out_dir.name + ".tmp")
            if tmp.exists():
                import shutil

                shutil.rmtree(tmp)
            module.save_pretrained(str(tmp), state_dict=state, safe_serialization=True)
            for name, text in (extra_files or {}).items():
                (tmp / name).write_text(text)
            if out_dir.exists():
                import shutil

                shutil.rmtree(out_dir)
            os.replace(tmp, out_dir)

    if zero_stage >= 3:
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            _save()
    else:
        _save()
    barrier()
    return out_dir


def is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0
