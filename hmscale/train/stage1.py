"""Stage 1: train the Hedgehog feature maps (attention transfer), layer-local.

The loss of layer l is `1 - cos(o_lin, o_teacher)` (`hmscale.models.hedgehog_loss`) on that layer's
teacher attention input only, so:
- `stage1.source=cache`: batches come from the teacher cache (the layers' `attn_input`, and their
  `attn_output` when cached, else the teacher output is recomputed from attn_input); no model forward.
- `stage1.source=online`: the live teacher runs on token batches and its per-layer inputs are captured.
- `stage1.layer_parallel=true`: layer l trains on worker l % world (each worker reads only its
  layers from the cache); otherwise every worker trains all layers on its share of the data (ZeRO dp).
- `stage1.epochs=E`: E passes over the stage's token share (`budget.stage1_tokens`): the rows a one-pass
  run reads first, reshuffled each pass (no new tokens; phi is tiny and converges slowly in one pass).
- `stage1.transfer=mixer`: instead of the Hedgehog linear attention, each layer's whole HedgeMamba mixer
  (`convert.to_mixer_student`: feature maps plus the conv, dt/A/D and gate of `stage2.components`, from their
  exact identity init; the teacher's qkv/dense frozen inside it) is aligned with the teacher's attention
  output, through its gated per-head output; the added parts at `stage1.new_params_lr_scale` x lr. Stage 2
  then starts from that model itself (same components required). Layer-local all the same (layer_parallel
  too: each worker trains its layers' mixers).

The logged `loss` is the mean over layers; `layer_loss/<l>` per layer.

Run dir (`<run_dir>/stage1/`):
  checkpoints/step_XXXXXXXX/   DeepSpeed state (tag `state`) + meta.json
  metrics.jsonl, tb/           loss, layer_loss/<l>, lr, grad_norm
  student/feature_maps.safetensors   the phi weights (`{layer}.weight` (h, F, P), `{layer}.bias` (h, F))
  student/mixers.safetensors   instead, with transfer=mixer: every mixer's recurrent parts (`{layer}.{name}`)
  student/student.json         teacher reference (name_or_path or saved copy), feature_dim, shapes, losses,
                               transfer (and, for transfer=mixer, the components)
  student/teacher/             a saved copy of the teacher when it has no name_or_path (miniatures)
  summary.json
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from hmscale.atomic import atomic_write_json
from hmscale.train.common import record_inputs, seed_everything, setup_layout, short_cache_note, stage_dir, stage_steps
from hmscale.train.data import BatchPlan, CacheSource, Sampler, get_batch, plan_rows, token_share
from hmscale.train.engine import (Checkpointer, MetricsLogger, OptimSpec, TrainingError, barrier, build_engine,
                                   resumed_totals, train_loop)


class LayerParallelMPU:
    """DeepSpeed `mpu` for layer-parallel stage 1: every rank holds different parameters (the
    "model-parallel" group is the whole world), the data-parallel group of a rank is itself."""

    def __init__(self):
        rank, world = dist.get_rank(), dist.get_world_size()
        self._rank, self._world = rank, world
        self._mp_group = dist.group.WORLD
        self._dp_group = None
        for r in range(world):  # every rank must create every group
            g = dist.new_group([r])
            if r == rank:
                self._dp_group = g

    def get_model_parallel_rank(self):
        return self._rank

    def get_model_parallel_world_size(self):
        return self._world

    def get_model_parallel_group(self):
        return self._mp_group

    def get_data_parallel_rank(self):
        return 0

    def get_data_parallel_world_size(self):
        return 1

    def get_data_parallel_group(self):
        return self._dp_group

    # newer DeepSpeed spellings
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group


class Stage1Trainable(nn.Module):
    """What DeepSpeed sees: what stage 1 trains in `layers`. transfer=attention: only the feature maps (the
    teacher's attention modules are held outside the module tree: frozen, never partitioned). transfer=mixer:
    the HedgeMamba mixers of `mixer_model` (only their recurrent parts require grad; their in_proj/out_proj are
    frozen copies of the teacher's), each aligned with the teacher's attention output through its
    gated per-head output."""

    def __init__(self, student, layers: list[int], owners: dict[int, int], world: int, mixer_model=None):
        super().__init__()
        self.layers = list(layers)
        if mixer_model is None:
            self.maps = nn.ModuleDict({str(l): student.feature_maps[l] for l in self.layers})
            self.mixers = None
        else:
            self.mixers = nn.ModuleDict({str(l): mixer_model.backbone.layers[l].mixer for l in self.layers})
            self._rope = (mixer_model.config.rotary_ndims, mixer_model.config.rotary_emb_base)
            # ZeRO-3 gathers a module's own parameters when its forward runs; stage 1 calls the mixers'
            # head_outputs, not their forward, so their direct parameters (A, D, ...) are gathered with this
            # module's forward instead (submodules such as in_proj and the conv are called and gather themselves;
            # DeepSpeed 0.19.8 was seen to fetch unregistered ones on access too, this does not rely on that)
            import deepspeed

            for mixer in self.mixers.values():
                for p in mixer.parameters(recurse=False):
                    deepspeed.zero.register_external_parameter(self, p)
        self._attn = {l: student.layers[l].attention for l in self.layers}
        self._config = student.config
        self._chunk = getattr(student, "chunk_size", 64)
        self._n_layers = student.config.num_hidden_layers
        # backward: every layer's loss weighs 1/n_layers whatever the layout (same gradients as one worker);
        # logging: scaled so that the mean over ranks is each layer's mean over the ranks that own it
        self._log_scale = {l: world / owners[l] for l in self.layers}

    def forward(self, attn_inputs: dict, targets: dict, positions: torch.Tensor | None = None):
        """attn_inputs {l: (b, L, d)}; targets {l: (b, m, h, p) at `positions` or None}.
        Returns (sum over this worker's layers of loss_l / n_layers, for backward;
        per-layer losses (n_layers,), scaled for the cross-rank mean, for logging)."""
        from hmscale.models.hedgehog import hedgehog_layer_output, hedgehog_loss

        per_layer = torch.zeros(self._n_layers)
        total = 0.0
        rope = None  # the mixers' rotary tables: the same for every layer, built once per call
        for l in self.layers:
            attn = self._attn[l]
            x = attn_inputs[l].to(next(attn.parameters()).dtype)
            tgt = targets.get(l)
            if self.mixers is None:
                o_lin, o_t = hedgehog_layer_output(attn, self.maps[str(l)], x, self._config, with_teacher=tgt is None,
                                                   chunk_size=self._chunk)
            else:
                if rope is None:
                    rope = self._rope_tables(x)
                o_lin, o_t = self._mixer_output(l, attn, x, rope, with_teacher=tgt is None)
            if tgt is not None:
                if positions is not None and tgt.shape[1] != o_lin.shape[1]:
                    o_lin = torch.gather(o_lin, 1, positions[:, :, None, None].expand(-1, -1, *o_lin.shape[2:]))
                o_t = tgt
            loss_l = hedgehog_loss(o_lin, o_t.to(o_lin.dtype))
            per_layer[l] = loss_l.detach().float().cpu() * self._log_scale[l]
            total = total + loss_l / self._n_layers
        return total, per_layer

    def _rope_tables(self, x: torch.Tensor):
        from hmscale.models.neox_attention import rotary_cos_sin

        positions = torch.arange(x.shape[1], device=x.device)[None]
        return rotary_cos_sin(positions, *self._rope, dtype=x.dtype)

    def _mixer_output(self, l: int, attn, x: torch.Tensor, rope, with_teacher: bool):
        from hmscale.models.hedgehog import teacher_attention_output

        mixer = self.mixers[str(l)]
        o_t = teacher_attention_output(attn, x, self._config) if with_teacher else None
        return mixer.head_outputs(x.to(mixer.in_proj.weight.dtype), rope), o_t


def _teacher_ref(cfg, teacher) -> str | None:
    ref = cfg.teacher.name_or_path or getattr(teacher, "name_or_path", None) or getattr(teacher.config, "_name_or_path", "")
    return str(ref) if ref else None


def export_student(student, out_dir: Path, cfg, teacher, extra: dict | None = None, mixer_model=None) -> Path:
    """feature_maps.safetensors (transfer=attention) or mixers.safetensors (transfer=mixer: every mixer's
    recurrent parts, `<layer>.<name>`) + student.json (+ a saved teacher when it has no reference); rank 0 only."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if mixer_model is None:
        fname = "feature_maps.safetensors"
        state = {k: v.detach().float().cpu().contiguous() for k, v in student.feature_maps.state_dict().items()}
        extra = {"transfer": "attention", **(extra or {})}
    else:
        from hmscale.models.convert import recurrent_state

        fname = "mixers.safetensors"
        state = {k: v.contiguous() for k, v in recurrent_state(mixer_model).items()}
        components = {k: getattr(mixer_model.config, k) for k in cfg.stage2.components.model_dump()}
        extra = {"transfer": "mixer", "components": components, **(extra or {})}
    tmp = out_dir / f"{fname}.tmp"
    save_file(state, str(tmp))
    os.replace(tmp, out_dir / fname)
    ref = _teacher_ref(cfg, teacher)
    if ref is None or not (ref and (Path(ref).exists() or "/" in ref)):
        teacher.save_pretrained(str(out_dir / "teacher"))
        ref = "teacher"  # relative to the student directory
    try:
        from hmscale.teacher.fingerprint import teacher_fingerprint

        fp = teacher_fingerprint(teacher)
    except Exception:
        fp = None
    tcfg = teacher.config
    meta = {
        "format": "hmscale-hedgehog-student/1",
        "teacher": ref,
        "teacher_fingerprint": fp,
        "teacher_dtype": cfg.teacher.dtype,
        "feature_dim": int(student.feature_dim),
        "n_layers": int(tcfg.num_hidden_layers),
        "n_heads": int(tcfg.num_attention_heads),
        "head_dim": int(tcfg.hidden_size // tcfg.num_attention_heads),
        **(extra or {}),
    }
    atomic_write_json(out_dir / "student.json", meta)
    return out_dir


def load_stage1_student(run_dir_or_student_dir, teacher=None, cfg=None):
    """The student exported by stage 1 (`<run_dir>/stage1/student` or that directory itself): the Hedgehog
    student (transfer=attention), or the HedgeMamba model with the trained mixers (transfer=mixer)."""
    from safetensors.torch import load_file

    from hmscale.models.convert import to_hedgehog

    d = Path(run_dir_or_student_dir)
    if not (d / "student.json").exists():
        d = d / "stage1" / "student"
    if not (d / "student.json").exists():
        raise TrainingError(_no_student_line(run_dir_or_student_dir))
    meta = json.loads((d / "student.json").read_text())
    if teacher is None:
        from hmscale.teacher.load import load_teacher

        ref = meta["teacher"]
        path = d / ref if not Path(ref).is_absolute() and (d / ref).exists() else ref
        teacher = load_teacher(path, dtype=meta.get("teacher_dtype", "float32"))
    _check_student_teacher(d, meta, teacher)
    if meta.get("transfer") == "mixer":
        from hmscale.models.convert import load_recurrent_state, to_mixer_student

        model = to_mixer_student(teacher, meta["components"], meta["feature_dim"])
        load_recurrent_state(model, load_file(str(d / "mixers.safetensors")))
        return model
    student = to_hedgehog(teacher, feature_dim=meta["feature_dim"])
    state = load_file(str(d / "feature_maps.safetensors"))
    student.load_feature_map_state_dict({k: v.to(next(student.feature_maps.parameters()).dtype) for k, v in state.items()})
    return student


def _no_student_line(given) -> str:
    """Why there is no stage-1 student to load, in one line: not trained yet, or (its summary says done) its export was
    lost, which `hmscale stage1` would skip as done."""
    summary = Path(given) / "stage1" / "summary.json"
    try:
        done = json.loads(summary.read_text()).get("done", False)
    except (OSError, ValueError, AttributeError):
        done = False
    if done:
        return (f"no stage-1 student under {str(given)!r}: stage 1 finished there ({summary}) but its export "
                f"{Path(given) / 'stage1' / 'student'} is gone; put it back, or train stage 1 again in a new output_dir")
    return f"no stage-1 student under {str(given)!r}; run `hmscale stage1` first"


class TeacherMismatch(TrainingError, ValueError):
    """The stage-1 student was trained against another teacher than the one given (a ValueError too: `hmscale eval`,
    which loads the student to score it, reports those in one line)."""


def _check_student_teacher(student_dir: Path, meta: dict, teacher) -> None:
    """Refuse (one line) a teacher other than the one the stage-1 student was trained against (student.json's
    ``teacher_fingerprint``: its config and every weight): its feature maps (or mixers) put on another teacher's weights
    made a stage 2 that silently started from another model than stage 1's, e.g. after a time-capped miniature was
    pretrained again (a moved or emptied data.cache_dir, another machine) or a teacher folder was replaced."""
    want = meta.get("teacher_fingerprint")
    if not want:  # (a student exported without one: nothing to compare)
        return
    from hmscale.teacher.fingerprint import teacher_fingerprint

    have = teacher_fingerprint(teacher)
    if have != want:
        raise TeacherMismatch(
            f"the stage-1 student in {student_dir} was trained against teacher {want[:12]}, but the teacher loaded now "
            f"is {have[:12]} (pretrained again, or its folder replaced): its feature maps would run on other weights; "
            "use the teacher stage 1 ran with (a pretrained miniature is kept under the data.cache_dir it ran with), "
            "or rerun stage 1 in a new output_dir")


def online_source(cfg, plan):
    """The rows stage 1 reads from the live teacher: those of the plan's shards stage 1 draws from
    (``stage_shard_ids``), as a cached run reads them from its cache, so that online and cached stage 1 train on
    the same rows in the same steps (an fp32 cache gives the online run's losses)."""
    from hmscale.teacher.cache.build import plan_meta, stage_shard_ids

    return plan_rows(plan, stage_shard_ids(cfg, plan_meta(plan), "stage1"))


def _check_cache_tensors(tensors, where: str) -> None:
    """Stage 1 trains from each layer's cached attn_input (attn_output is recomputed when not cached): refuse a
    cache without it in one line, before any training (it was a KeyError 'layer0.attn_input' at the first step)."""
    if "attn_input" not in tensors:
        raise TrainingError(f"{where}: {list(tensors)} lacks attn_input, which stage 1 trains from; capture "
                            "[attn_input, attn_output] (cache.capture.tensors) or set stage1.source=online")


def _get_teacher(cfg, data, layout):
    from hmscale.teacher import get_teacher

    return get_teacher(cfg, data, device=str(layout.device))


def run_stage1(
    cfg,
    run_dir: str | os.PathLike,
    *,
    data=None,
    teacher=None,
    cache_dir: str | os.PathLike | None = None,
    source=None,
    resume: bool = True,
    resume_from: str | os.PathLike | None = None,
    stop_at_step: int | None = None,
    on_checkpoint: Callable[[int, Path, dict], None] | None = None,
    fault_hook: Callable[[int], None] | None = None,
    export: bool = True,
) -> dict:
    """Train phi on this process's share (of the data, or of the layers); returns a summary dict.

    cache_dir: a built teacher cache (stage1.source=cache); None with source=cache builds/reuses it
               (`build_cache`, rank 0) — pass data/teacher to avoid rebuilding them.
    source: rows to train from (a train.data source); overrides cache_dir / data (tests).
    Other arguments as in `run_stage2`.
    """
    s1, par = cfg.stage1, cfg.parallel
    out = stage_dir(run_dir, "stage1")
    zero = par.zero  # the stage DeepSpeed runs (a ds_config file's own)
    layout = setup_layout(cfg, tp=1, zero_stage=zero)
    seed_everything(cfg.seed)
    out.mkdir(parents=True, exist_ok=True)
    if layout.rank == 0:  # (the stage commands keep no results.json: where relative inputs were read)
        record_inputs(cfg, run_dir)
    mode = s1.source if source is None else ("cache" if isinstance(source, CacheSource) else "online")

    if data is None and (mode == "online" and source is None or teacher is None):
        from hmscale.data import prepare_data

        data = prepare_data(cfg)
    if teacher is None:
        teacher = _get_teacher(cfg, data, layout)
    teacher.to(layout.device)
    from hmscale.models.convert import to_hedgehog

    student = to_hedgehog(teacher, feature_dim=s1.feature_dim)
    mixer_model = None
    if s1.transfer == "mixer":
        from hmscale.models.convert import to_mixer_student

        mixer_model = to_mixer_student(teacher, cfg.stage2.components, s1.feature_dim)
    n_layers = teacher.config.num_hidden_layers

    # which layers this worker trains
    if s1.layer_parallel and layout.world > 1:
        if layout.world > n_layers:
            raise TrainingError(f"stage1.layer_parallel: {layout.world} workers for {n_layers} layers; use at most {n_layers} workers or layer_parallel=false")
        mine = [l for l in range(n_layers) if l % layout.world == layout.rank]
        owners = {l: 1 for l in range(n_layers)}
        mpu = LayerParallelMPU()
        dp_rank, dp_size = 0, 1
        for l in mine:  # this rank's own parameters: the grad norm sums them over the "model-parallel" world
            owned = student.feature_maps[l] if mixer_model is None else mixer_model.backbone.layers[l].mixer
            for p in owned.parameters():
                if p.requires_grad:
                    p.model_parallel = True
                    p.tensor_model_parallel = True
    else:
        mine = list(range(n_layers))
        owners = {l: layout.world for l in range(n_layers)}
        mpu, dp_rank, dp_size = None, layout.rank, layout.world
    zero_stage, ds_config = par.zero_stage, par.ds_config
    if mpu is not None and zero >= 3:
        # a layer-parallel worker's data-parallel group is itself: ZeRO-3 has nothing to partition there (ZeRO-2
        # holds the same bytes), and DeepSpeed's ZeRO-3 requires every rank to trace the same modules each step, so
        # workers with different numbers of layers (3 layers on 2 workers) failed at the first step with
        # "Detected a disagreement on list length between rank0 and rank1". Stage 1 runs ZeRO-2 then (stage 2 keeps 3).
        zero, zero_stage, ds_config = 2, 2, None
        if layout.rank == 0:
            print("stage1: layer-parallel workers each hold their own layers whole (ZeRO-3 would partition nothing): "
                  "stage 1 runs ZeRO-2 (ds_configs/zero2.json); stage 2 keeps the configured ZeRO-3", flush=True)

    cache_plan = None  # the data plan of the cache this stage opens (its manifest's), when it opens one
    if source is None:
        if mode == "cache":
            if cache_dir is None:
                from hmscale.config import stage1_cache_problem

                if problem := stage1_cache_problem(cfg):  # (before a teacher pass for a cache stage 1 cannot use)
                    raise TrainingError(problem)
                cache_dir = _ensure_cache(cfg, data, teacher, layout)
            from hmscale.teacher.cache import open_for_run

            reader = open_for_run(cfg, cache_dir, stage="stage1")
            cache_plan = reader.manifest.data["plan"]
            _check_cache_tensors(reader.spec.tensors, f"the teacher cache {cache_dir}")
            missing = [l for l in mine if l not in reader.layers]
            if missing:
                raise TrainingError(f"the teacher cache {cache_dir} has no layers {missing}; set cache.capture.layers=all and rebuild")
            source = CacheSource(reader, layers=mine, topk=False)
        else:
            source = online_source(cfg, data.plan)
    if s1.epochs > 1 and not s1.steps:
        # several passes over the stage's token share: the rows a one-pass run would read, revisited
        source = token_share(source, cfg.budget.stage1_tokens, seed=cfg.seed + 1) or source
    cached = isinstance(getattr(source, "source", source), CacheSource)

    module = Stage1Trainable(student, mine, owners, layout.world, mixer_model).to(layout.device)
    params = None
    if mixer_model is not None:  # the feature maps at stage1.lr, the conv, dt/A/D and gate at its multiple
        from hmscale.models.hedgemamba import param_kind

        groups = {"feature_map": [], "added": []}
        for mixer in module.mixers.values():
            for name, p in mixer.named_parameters():
                if p.requires_grad:
                    groups[param_kind(f"mixer.{name}")].append(p)
        params = [{"params": groups["feature_map"], "lr": s1.lr, "name": "feature_map"}]
        if groups["added"]:
            params.append({"params": groups["added"], "lr": s1.lr * s1.new_params_lr_scale, "name": "new"})
    # the tokens each layer trains on per step (the budget's unit): layer-parallel workers read the same rows
    tokens_per_step = s1.micro_batch_size * dp_size * source.seq_len
    total_steps = stage_steps(cfg, "stage1", tokens_per_step)
    note = cache_plan and short_cache_note(cfg, cache_plan, reads=total_steps * tokens_per_step, stage="stage1")
    if note and layout.rank == 0:
        print(f"stage1: note: {note}", flush=True)
    spec = OptimSpec(lr=s1.lr, micro_batch_size=s1.micro_batch_size, grad_accum=1, warmup_steps=s1.warmup_steps,
                     total_steps=total_steps, min_lr_ratio=s1.min_lr_ratio, weight_decay=0.0, grad_clip=1.0,
                     zero_stage=zero_stage, bf16=False, ds_config=ds_config,
                     adam=par.adam, stage="stage1", on_gpu=layout.device.type == "cuda")
    engine = build_engine(module, spec, dp_world=dp_size, mpu=mpu, params=params)

    ckpt = Checkpointer(out / "checkpoints", keep=par.keep_checkpoints, rank=layout.rank)
    start_step, resumed = 0, None
    load_from = Path(resume_from) if resume_from else (ckpt.latest() if resume else None)
    if load_from is not None:
        Checkpointer.check_layout(load_from, "stage1", zero_stage=zero, dp=dp_size,
                                  mp=layout.world if mpu is not None else 1, samples_per_step=s1.micro_batch_size * dp_size,
                                  mp_what="layer-parallel workers")
        client = Checkpointer.load(engine, load_from)
        start_step = int(client.get("step", 0))
        resumed = resumed_totals(load_from, client, start_step * tokens_per_step)
    # layer-parallel: every rank reads the same rows (its own layers of them)
    sampler = Sampler(source.num_sequences, seed=cfg.seed + 1)
    bplan = BatchPlan(s1.micro_batch_size, 1, dp_rank, dp_size)
    logger = MetricsLogger(out, "stage1", total_steps, start_step, rank=layout.rank, progress=True)
    if layout.rank == 0 and start_step == 0:
        # every layer's, not this rank's: a layer-parallel worker's module holds only its own layers (rank 0's count
        # was 2 of 3 layers on 2 workers); the other layers' copies here are whole, unpartitioned
        every_layer = (student.feature_maps[l] if mixer_model is None else mixer_model.backbone.layers[l].mixer
                       for l in range(n_layers))
        logger.log(0, {"event": "start", "mode": "cache" if cached else "online", "layer_parallel": mpu is not None,
                       "transfer": s1.transfer, "zero_stage": zero,
                       "trainable_params": sum(getattr(p, "ds_numel", p.numel()) for m in every_layer
                                               for p in m.parameters() if p.requires_grad),  # (ZeRO-3: ds_numel)
                       "total_steps": total_steps,
                       "tokens_per_step": tokens_per_step}, kind="event")

    def micro_step(step: int, micro: int):
        batch = get_batch(source, sampler, bplan, step, micro, layout.device)
        if cached:
            inputs = {l: batch[f"layer{l}.attn_input"] for l in mine}
            targets = {l: batch.get(f"layer{l}.attn_output") for l in mine}
            targets = {l: t for l, t in targets.items() if t is not None}
            positions = batch.get("positions")
        else:
            from hmscale.teacher.capture import capture_layers

            with torch.no_grad():
                caps = capture_layers(teacher, batch["input_ids"], layers=mine, qkv=False)
            inputs = {l: caps[l].attn_input for l in mine}
            targets = {l: caps[l].attn_output for l in mine}
            positions = None
        loss, per_layer = engine(inputs, targets, positions)
        # one extra per layer, named as logged: a 1-element tensor extra is logged under its bare name (a one-layer
        # teacher's `layer_loss/0` was `layer_loss`)
        extras = {f"layer_loss/{l}": per_layer[l] for l in range(n_layers)}
        return loss, {**extras, "loss": per_layer.sum() / n_layers}

    def client_state(step):
        return {"step": step, "samples_seen": bplan.samples_seen(step), "stage": "stage1", "total_steps": total_steps,
                "layers": mine}

    try:
        res = train_loop(
            name="stage1", engine=engine, micro_step=micro_step, total_steps=total_steps, grad_accum=1,
            start_step=start_step, checkpointer=ckpt, checkpoint_every=par.checkpoint_every, logger=logger,
            client_state=client_state, tokens_per_step=tokens_per_step, stop_at_step=stop_at_step,
            on_checkpoint=on_checkpoint, fault_hook=fault_hook, resumed=resumed,
        )
    finally:
        logger.close()
    done = res.end_step >= total_steps
    summary = {"stage": "stage1", "done": done, "mode": "cache" if cached else "online",
               "layer_parallel": mpu is not None, "start_step": start_step, "end_step": res.end_step,
               "total_steps": total_steps, "tokens": res.stage_tokens, "seconds": res.stage_seconds,
               "resumed_seconds": float(res.resumed.get("seconds", 0.0)),  # (earlier attempts')
               "final_loss": res.final_loss, "losses": res.losses,
               "checkpoint": res.last_checkpoint}
    if done and export:
        meta = {"steps": total_steps, "final_loss": summary["final_loss"]}
        if mixer_model is None:
            _gather_feature_maps(engine, student, mine, layout, zero)
        else:
            mixer_model = _gather_mixers(engine, mixer_model, mine, layout, zero, teacher, cfg)
        if layout.rank == 0:
            export_student(student, out / "student", cfg, teacher, meta, mixer_model=mixer_model)
        barrier()
        summary["student"] = str(out / "student")
    if layout.rank == 0:
        atomic_write_json(out / "summary.json", {k: v for k, v in summary.items() if k != "losses"})
    barrier()
    summary["student_model"] = (student if mixer_model is None else mixer_model) if done else None
    return summary


def _gather_feature_maps(engine, student, mine, layout, zero_stage):
    """Bring every layer's trained phi into `student` on rank 0 (ZeRO-3 gather, layer-parallel gather)."""
    import deepspeed

    params = list(engine.module.parameters())
    ctx = deepspeed.zero.GatheredParameters(params, modifier_rank=None) if zero_stage >= 3 else _null()
    with ctx:
        local = {l: {k: v.detach().cpu().clone() for k, v in student.feature_maps[l].state_dict().items()} for l in mine}
    if layout.world > 1 and len(mine) < student.config.num_hidden_layers:
        gathered = [None] * layout.world
        dist.all_gather_object(gathered, local)
        states = {l: st for part in gathered for l, st in part.items()}
    else:
        states = local
    if zero_stage >= 3:
        # the engine's modules hold partitioned (empty) parameters: give the student fresh, full ones
        from hmscale.models.feature_map import HedgehogFeatureMap

        old = student.feature_maps
        fresh = nn.ModuleList(HedgehogFeatureMap(m.n_heads, m.head_dim, m.feature_dim) for m in old)
        student.feature_maps = fresh.to(next(student.teacher.parameters()).device)
    for l, st in states.items():
        student.feature_maps[l].load_state_dict(st)


def _gather_mixers(engine, mixer_model, mine, layout, zero_stage, teacher, cfg):
    """A fresh mixer student (no engine hooks on its parameters) holding every layer's trained recurrent parts
    (ZeRO-3 gather, layer-parallel gather)."""
    import deepspeed

    from hmscale.models.convert import load_recurrent_state, recurrent_state, to_mixer_student

    params = list(engine.module.parameters())
    ctx = deepspeed.zero.GatheredParameters(params, modifier_rank=None) if zero_stage >= 3 else _null()
    with ctx:
        state = recurrent_state(mixer_model, layers=mine)
    if layout.world > 1 and len(mine) < mixer_model.config.num_hidden_layers:
        gathered = [None] * layout.world
        dist.all_gather_object(gathered, state)
        state = {k: v for part in gathered for k, v in part.items()}
    fresh = to_mixer_student(teacher, cfg.stage2.components, cfg.stage1.feature_dim)
    load_recurrent_state(fresh, state)
    return fresh


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _ensure_cache(cfg, data, teacher, layout):
    """Build (rank 0) or reuse the teacher cache; every rank gets its directory."""
    from hmscale.teacher.cache import build_cache

    box = [None]
    if layout.rank == 0:
        # this worker's own device: the other ranks wait in the broadcast below
        box[0] = str(build_cache(cfg, data, teacher, engine="local", device=layout.device))
    if dist.is_initialized() and layout.world > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]
