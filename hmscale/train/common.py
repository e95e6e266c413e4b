"""Pieces shared by the two stages: process layout (dp x tp), run-dir paths, seeding, HF export, step counts, the note
on a teacher cache shorter than a stage's rows."""

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


def stage_steps(cfg, stage: str, tokens_per_step: int) -> int:
    """Optimizer steps of ``stage``: its ``steps``, else its ``epochs`` passes over its share of the budget
    (``budget.stage1_tokens`` / ``stage2_tokens``). A share of nothing (``budget.split`` of ``[0.0, 1.0]`` or
    ``[1.0, 0.0]``, the paper's 0/100 and 100/0) is no step: the stage's model is exported as it starts (at least one
    step for any positive share)."""
    section, tokens = getattr(cfg, stage), getattr(cfg.budget, f"{stage}_tokens")
    if getattr(section, "steps", None):
        return int(section.steps)
    if tokens <= 0:
        return 0
    return max(1, int(getattr(section, "epochs", 1)) * tokens // max(tokens_per_step, 1))


def cached_kd(s2) -> bool:
    """Whether stage 2 (``cfg.stage2``) takes a KD term from the teacher cache's top-k log-probs."""
    return s2.kd_weight > 0 and getattr(s2, "kd_source", "cache") == "cache"


def stage2_uses_teacher(s2) -> bool:
    """Whether stage 2 (``cfg.stage2``) runs the live teacher while it trains: online KD, or hidden-state alignment.
    Else (KD from the cache's top-k, or no KD term) the teacher only builds the stage-1 student it converts, and may
    be let go before the stage-2 engine is built."""
    return ((s2.kd_weight > 0 and getattr(s2, "kd_source", "cache") == "online")
            or float(getattr(s2, "hidden_weight", 0.0)) > 0)


def free_released_memory() -> None:
    """After the last reference to a model is dropped: collect it now (a model in a reference cycle waits for the
    collector) and, on CUDA, hand its cached blocks back (``torch.cuda.empty_cache``) for the next engine."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _reads_from_cache(cfg, stage: str) -> bool:
    """Whether the stage draws its rows from the teacher cache: stage 1 with source=cache; stage 2 with cached KD (its
    top-k log-probs; without KD, or with online KD, it reads the data plan's rows)."""
    if stage == "stage1":
        return cfg.stage1.source == "cache" and cfg.cache.enabled
    return cached_kd(cfg.stage2) and cfg.cache.capture.topk > 0


def _stage_reads(cfg, stage: str, seq_len: int) -> int:
    """The tokens a stage reads (steps x tokens per step) as the config sets it (all workers)."""
    s1, s2, par = cfg.stage1, cfg.stage2, cfg.parallel
    if stage == "stage1":
        per_step = s1.micro_batch_size * (1 if s1.layer_parallel else par.num_workers) * seq_len
    else:
        per_step = s2.micro_batch_size * s2.grad_accum * max(1, par.num_workers // max(1, par.tp)) * seq_len
    return stage_steps(cfg, stage, per_step) * per_step


def short_cache_note(cfg, plan_meta: dict | None = None, reads: int | None = None, *,
                     stage: str = "stage1") -> str | None:
    """One line when ``stage`` reading from the teacher cache reads other rows than it does without it (None when
    it reads the same, or reads no cache): a ``cache.max_tokens`` below the tokens whose shards the stage draws from
    (``stage_tokens``: stage 1's share of the budget; stage 2's whole budget) caches fewer of the plan's shards than
    those, so a cached stage 1 (a stage 2 with cached KD) draws its rows from the shards held, revisiting them when it
    reads more than they hold, an online stage 1 (a stage 2 without KD or with online KD) from all of them. A warning,
    not a refusal: a short cache is a choice (fewer bytes, rows revisited), but it breaks the promise that every
    source gives the same rows, and says so.

    ``plan_meta``: the plan's num_shards, sequences_per_shard and seq_len (the cache's manifest's ``plan``); without it
    (``hmscale check``: no data yet) data.sequences_per_shard and data.seq_len, the corpus taken as long enough.
    ``reads``: the tokens the stage reads (steps x tokens per step); default from the config (``stage_steps``)."""
    from hmscale.teacher.cache.build import run_shard_ids, stage_shard_ids, stage_tokens

    tokens = stage_tokens(cfg, stage)  # (refuses a stage other than stage1 / stage2)
    c = cfg.cache
    if not _reads_from_cache(cfg, stage) or not c.max_tokens:
        return None
    meta = plan_meta or {"num_shards": 1 << 62, "sequences_per_shard": cfg.data.sequences_per_shard,
                         "seq_len": cfg.data.seq_len}
    share = stage_shard_ids(cfg, meta, stage)
    held = sorted(set(run_shard_ids(cfg, meta)) & set(share))
    if len(held) >= len(share):
        return None
    L = int(meta["seq_len"])
    if reads is None:
        reads = _stage_reads(cfg, stage, L)
    if reads <= 0:
        return None
    held_tokens = len(held) * int(meta["sequences_per_shard"]) * L  # (whole: the plan's last, short, is not held)
    passes = f"{reads / held_tokens:.1f}" if reads >= held_tokens else f"{reads / held_tokens:.2f}"
    if stage == "stage1":
        share_is, other, whole = (f"stage 1's {tokens:,}-token share of the budget", "an online stage 1",
                                  "with stage 1's whole share cached")
    else:
        share_is, other, whole = (f"the {tokens:,}-token budget stage 2 draws its rows from",
                                  "a stage 2 without cached KD (no KD, or online KD)", "with the whole budget cached")
    return (f"{stage[:-1]} {stage[-1]} reads {reads:,} tokens from a teacher cache holding {held_tokens:,} for it "
            f"(cache.max_tokens={c.max_tokens:,}: {len(held)} of the {len(share)} shards of {share_is}): "
            f"{passes} passes over them, on other rows than {other} reads (the two read the same rows only "
            f"{whole}); set cache.max_tokens to at least {tokens:,}, or unset it, to read the same rows")


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


def record_inputs(cfg, run_dir) -> None:
    """Write down (``INPUTS_FILE``) the inputs a stage reads by path (data.paths, a teacher or tokenizer folder) as
    absolute paths: the stage commands keep no results.json (the recipe's inputs_dir), and config.yaml keeps the
    inputs as given, so a later command from another folder could not tell which files a relative one named. Workers
    get them absolute from the driver (``with_absolute_inputs``); called directly, they are resolved from here."""
    from hmscale.atomic import atomic_write_json

    cfg = cfg.with_absolute_inputs()  # (the file is hmscale.run_identity.INPUTS_FILE, which reads the record)
    atomic_write_json(Path(run_dir) / "inputs.json", {"data.paths": list(cfg.data.paths),
                                                    "teacher.name_or_path": cfg.teacher.name_or_path,
                                                    "tokenizer.name_or_path": cfg.tokenizer.name_or_path})
