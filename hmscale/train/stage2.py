"""Stage 2: convert the stage-1 Hedgehog student into HedgeMamba and fine-tune it.

Everything but the input embeddings (and an LM head tied to them, as a tied teacher's) trains, with
`stage2.ce_weight` x next-token cross-entropy plus `stage2.kd_weight` x a KD term (temperature
T = `stage2.kd_temperature`), averaged over tokens:
- `stage2.kd_source=cache`: cached top-k teacher log-probs,
  `kd = -T^2 * sum_k softmax(lp_teacher/T)_k * log_softmax(z_student/T)[id_k]`
  (the teacher distribution renormalised over its top k);
- `stage2.kd_source=online`: the live teacher's full-vocabulary logits on the same batch (no grad; bf16
  autocast when parallel.bf16 on GPU), `kd = T^2 * KL(softmax(z_teacher/T) || softmax(z_student/T))`.
Plus `stage2.hidden_weight` x `hidden_alignment`: the relative MSE between the student's and the live
teacher's residual streams after each inner layer (logged as `hidden`; needs the teacher, as online KD).
`stage2.epochs=E`: E passes over the stage's token share (`budget.stage2_tokens`), the rows a one-pass run
reads first, reshuffled each pass (more compute, no new tokens).

Run dir (`<run_dir>/stage2/`):
  checkpoints/step_XXXXXXXX/   DeepSpeed state (tag `state`) + meta.json (step, samples_seen, loss)
  metrics.jsonl, tb/           train (loss, ce, kd, hidden, lr, grad_norm, tokens_per_s) and eval (val_loss, val_ppl)
  hf/                          the final model, `save_pretrained` (HF format, loads with from_pretrained)
  summary.json                 steps, tokens and seconds (a resumed stage: over every attempt), final train / val loss
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

import kernels
from hmscale.atomic import atomic_write_json
from hmscale.teacher.whole_sequences import whole_sequences
from hmscale.train.common import (Layout, cached_kd, export_hf, free_released_memory, record_inputs, seed_everything,
                                  setup_layout, short_cache_note, stage2_uses_teacher, stage_dir, stage_steps)
from hmscale.train.data import BatchPlan, CacheSource, Sampler, get_batch, plan_rows, token_share
from hmscale.train.engine import (
    Checkpointer,
    MetricsLogger,
    OptimSpec,
    TrainingError,
    barrier,
    build_engine,
    resumed_totals,
    train_loop,
)


def _row_losses(logits_row, target_row, ids_row, tlp_row, temperature: float, teacher_row=None):
    """Sums over one sequence's positions (fp32 math): cross-entropy and KD (zero when there is no teacher):
    cached top-k (ids_row, tlp_row) or the live teacher's full logits (teacher_row)."""
    z = logits_row.float()
    ce = F.cross_entropy(z, target_row, reduction="sum")
    T = float(temperature)
    if teacher_row is not None:
        t_lp = torch.log_softmax(teacher_row.float() / T, dim=-1)
        s_lp = torch.log_softmax(z / T, dim=-1)
        return ce, (t_lp.exp() * (t_lp - s_lp)).sum() * (T * T)
    if ids_row is None:
        return ce, torch.zeros((), device=z.device)
    p_t = torch.softmax(tlp_row.float() / T, dim=-1)
    s_lp = torch.log_softmax(z / T, dim=-1).gather(-1, ids_row)
    return ce, -(p_t * s_lp).sum() * (T * T)


def _row_losses_vocab_parallel(shard, logits_row, target_row, ids_row, tlp_row, temperature: float,
                               teacher_row=None):
    """`_row_losses` for this rank's vocabulary slice of the logits (`hmscale.parallel.vocab`): the same
    sums on every rank of the tp group, gradients into the local slice."""
    from hmscale.parallel.vocab import vocab_gather, vocab_logsumexp, vocab_shard_sum

    z = logits_row.float()
    lse = vocab_logsumexp(z, shard)
    ce = (lse - vocab_gather(z, target_row[:, None], shard)[:, 0]).sum()
    T = float(temperature)
    if teacher_row is None and ids_row is None:
        return ce, torch.zeros((), device=z.device)
    zt = z / T if T != 1.0 else z
    lse_t = vocab_logsumexp(zt, shard) if T != 1.0 else lse
    if teacher_row is not None:
        # KL(p || q) = sum_v p_v log p_v - sum_v p_v zt_v + lse_t   (q = softmax(zt), sum_v p_v = 1)
        t_lp = torch.log_softmax(teacher_row.float() / T, dim=-1)
        p = t_lp.exp()
        cross = vocab_shard_sum((p[:, shard.start:shard.end] * zt).sum(-1), shard)
        return ce, ((p * t_lp).sum(-1) - cross + lse_t).sum() * (T * T)
    p_t = torch.softmax(tlp_row.float() / T, dim=-1)
    s_lp = vocab_gather(zt, ids_row, shard) - lse_t[:, None]
    return ce, -(p_t * s_lp).sum() * (T * T)


def causal_lm_losses(logits: torch.Tensor, input_ids: torch.Tensor, batch: dict, kd_weight: float,
                     temperature: float = 1.0, *, ce_weight: float = 1.0,
                     teacher_logits: torch.Tensor | None = None, vocab_shard=None,
                     fused_ce: bool | None = None) -> tuple[torch.Tensor, dict]:
    """(ce_weight * ce + kd_weight * kd, {"ce", "kd"}) for next-token prediction, token means, fp32 math.

    KD targets: `teacher_logits` (b, l, V) when given (full-vocabulary KL), else the batch's cached
    top-k (`topk_ids`, `topk_logprobs`). Computed one sequence at a time under activation checkpointing:
    only the model's own (bf16) logits stay alive for the backward; the fp32 copy, log-softmax and KD
    terms of a row are recomputed. `vocab_shard`: the logits are this rank's vocabulary slice of a
    vocabulary-parallel LM head (`hmscale.parallel.vocab.VocabShard`). On the Triton backend (CUDA), without a
    vocabulary shard: `kernels.next_token_loss_sums`, cross-entropy and the KD term (cached top-k or the live
    teacher's logits) in one kernel each way over all rows, no fp32 copy of the logits (`fused_ce=False` keeps
    the per-sequence path; `True` asks for the kernel, an error where it cannot apply).
    """
    kd_on = kd_weight > 0
    online = kd_on and teacher_logits is not None
    if kd_on and not online and "topk_ids" not in batch:
        raise TrainingError("stage2.kd_weight > 0 needs teacher log-probs: set stage2.kd_source=online (the live "
                            "teacher), or cache.capture.topk > 0 and rebuild the cache, or set stage2.kd_weight=0")
    if online and teacher_logits.shape[:2] != logits.shape[:2]:
        raise TrainingError(f"teacher logits {tuple(teacher_logits.shape)} do not match the student's {tuple(logits.shape)}")
    b, l = input_ids.shape
    n = b * (l - 1)
    cached = kd_on and not online
    kernel_applies = vocab_shard is None
    if fused_ce and not kernel_applies:
        raise TrainingError("fused_ce=True: the fused loss does not take a vocabulary-parallel head")
    if fused_ce or (fused_ce is None and kernel_applies and kernels.resolve_backend(logits) == "triton"):
        # one kernel each way over the whole (b, l, V) logits: cross-entropy and the KD term
        ce_sum, kd_sum = kernels.next_token_loss_sums(
            logits, input_ids, batch["topk_ids"] if cached else None, batch["topk_logprobs"] if cached else None,
            temperature, teacher_logits=teacher_logits if online else None)
    else:
        ce_sum, kd_sum = _per_sequence_loss_sums(logits, input_ids, batch, cached, online, temperature,
                                                 teacher_logits, vocab_shard)
    ce = ce_sum / n
    extras = {"ce": ce.detach()}
    loss = ce * ce_weight if ce_weight != 1.0 else ce
    if kd_on:
        kd = kd_sum / n
        extras["kd"] = kd.detach()
        loss = loss + kd_weight * kd
    return loss, extras


def _per_sequence_loss_sums(logits, input_ids, batch, cached, online, temperature, teacher_logits, vocab_shard):
    """(ce_sum, kd_sum) one sequence at a time, each under activation checkpointing (fp32 math per row)."""
    from torch.utils.checkpoint import checkpoint

    ce_sum = kd_sum = 0.0
    vocab = vocab_shard.vocab_size if vocab_shard is not None else logits.shape[-1]
    row_fn = _row_losses if vocab_shard is None else functools.partial(_row_losses_vocab_parallel, vocab_shard)
    for i in range(input_ids.shape[0]):
        args = (logits[i, :-1], input_ids[i, 1:],
                batch["topk_ids"][i, :-1] if cached else None,  # the teacher's prediction at t is for token t+1
                batch["topk_logprobs"][i, :-1] if cached else None, temperature,
                teacher_logits[i, :-1, :vocab] if online else None)
        if torch.is_grad_enabled() and logits.requires_grad:
            ce_i, kd_i = checkpoint(row_fn, *args, use_reentrant=False)
        else:
            ce_i, kd_i = row_fn(*args)
        ce_sum = ce_sum + ce_i
        kd_sum = kd_sum + kd_i
    return ce_sum, kd_sum


def hidden_alignment(student_hidden, teacher_hidden) -> torch.Tensor:
    """Mean over the intermediate layers' residual streams (after layers 1..L-1; the embeddings are shared,
    and the last entry is the final LayerNorm's output, which the logits' own loss already steers) of
    ||h_s - h_t||^2 / mean ||h_t||^2, token means, fp32."""
    if student_hidden is None or teacher_hidden is None or len(student_hidden) != len(teacher_hidden):
        raise TrainingError("stage2.hidden_weight: the student and the teacher must return one hidden state per layer")
    terms = []
    for hs, ht in zip(student_hidden[1:-1], teacher_hidden[1:-1]):
        hs, ht = hs.float(), ht.float()
        terms.append(((hs - ht) ** 2).sum(-1).mean() / (ht ** 2).sum(-1).mean().clamp_min(1e-6))
    if not terms:
        return torch.zeros((), device=student_hidden[0].device)
    return torch.stack(terms).mean()


def freeze_embeddings(model: torch.nn.Module) -> int:
    """requires_grad=False on the input embeddings; returns the number of frozen parameters.

    A head tied to them (``config.tie_word_embeddings``, as ``to_hedgemamba`` converts a tied teacher) is the same
    Parameter and freezes with them: it is not trained through the shared weight (the model keeps the teacher's one
    matrix, and the export's head is the embedding). An untied head (Pythia's) trains."""
    emb = model.get_input_embeddings()
    n = 0
    for p in emb.parameters():
        p.requires_grad_(False)
        n += p.numel()
    return n


def freeze_all_but_mixers(model: torch.nn.Module) -> int:
    """requires_grad=False on every parameter outside the blocks' sequence mixers (``*.mixer.*``: what replaced
    attention); returns the number of parameters newly frozen."""
    n = 0
    mixers = 0
    for name, p in model.named_parameters():
        if ".mixer." in name:
            mixers += 1
        elif p.requires_grad:
            p.requires_grad_(False)
            n += p.numel()
    if not mixers:
        raise TrainingError(f"stage2.trainable=mixers: {type(model).__name__} has no '.mixer.' parameters")
    return n


def apply_stage2_lora(model: torch.nn.Module, s2, seed: int = 0) -> tuple[int, list[str]]:
    """stage2.lora_rank > 0: wrap the ``stage2.lora_targets`` layers with adapters (``hmscale.models.lora``) and
    freeze every teacher weight, the wrapped layers' own weights included; what trains: the adapters, HedgeMamba's
    added recurrent parts and the feature maps. Returns (parameters newly frozen, the wrapped layers' names)."""
    from hmscale.models.hedgemamba import param_kind
    from hmscale.models.lora import apply_lora, is_lora_param

    if "lm_head" in s2.lora_targets and getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        raise TrainingError("stage2.lora_targets: lm_head is tied to the input embeddings in this model (its export "
                            "would drop the folded adapter); leave lm_head out")
    try:
        wrapped = apply_lora(model, s2.lora_targets, s2.lora_rank, s2.lora_alpha, seed=seed)
    except ValueError as e:
        raise TrainingError(f"stage2.lora_targets: {e}") from None
    bases = {f"{w}.{k}" for w in wrapped for k in ("weight", "bias")}
    n = 0
    for name, p in model.named_parameters():
        train = is_lora_param(name) or (param_kind(name) != "teacher" and name not in bases)
        if p.requires_grad and not train:
            p.requires_grad_(False)
            n += p.numel()
    return n, wrapped


def param_groups(model: torch.nn.Module, lr: float, new_scale: float = 1.0, feature_map_scale: float = 1.0):
    """The trainable parameters as optimizer groups: the teacher's weights at `lr`, HedgeMamba's added
    recurrent parts (`ADDED_PARAM_NAMES`) at `lr * new_scale`, the feature maps at `lr * feature_map_scale`.
    Plain parameter list when both scales are 1 (one group, as before). Components switched off have no
    parameters, so their group is absent (the same config serves every ablation)."""
    from hmscale.models.hedgemamba import param_kind

    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if new_scale == 1.0 and feature_map_scale == 1.0:
        return [p for _, p in params]
    from hmscale.models.lora import is_lora_param

    buckets = {"base": [], "new": [], "feature_map": []}
    for name, p in params:
        # a LoRA adapter (``<layer>.lora_A``) trains at its layer's lr: one on the gate's z_proj or the SSM's dt_proj
        # is an added part's update, not a teacher weight's
        kind = param_kind(name.rsplit(".", 1)[0] + ".weight" if is_lora_param(name) else name)
        buckets[{"added": "new", "feature_map": "feature_map", "teacher": "base"}[kind]].append(p)
    scales = {"base": 1.0, "new": new_scale, "feature_map": feature_map_scale}
    # a group with no parameters (e.g. the Hedgehog-only ablation: no gate, conv or SSM) is left out;
    # the base group comes first: the logged lr is group 0's
    return [{"params": buckets[k], "lr": lr * scales[k], "name": k} for k in ("base", "new", "feature_map") if buckets[k]]


def _online_kd(s2) -> bool:
    return s2.kd_weight > 0 and getattr(s2, "kd_source", "cache") == "online"


def _source_for(cfg, data, cache_dir):
    """Stage-2 rows: the cache (tokens + top-k) when given, else the data plan. With online KD the data plan
    wins over a given cache (which may hold only stage 1's rows)."""
    if cache_dir is not None and not (_online_kd(cfg.stage2) and data is not None):
        from hmscale.teacher.cache import open_for_run

        return CacheSource(open_for_run(cfg, cache_dir, stage="stage2"), topk=cached_kd(cfg.stage2))
    if data is None:
        raise TrainingError("stage 2 needs training data: pass data=prepare_data(cfg) or a cache directory")
    if cached_kd(cfg.stage2):
        raise TrainingError("stage2.kd_weight > 0 with kd_source=cache needs the teacher cache (top-k log-probs); "
                            "enable cache and set cache.capture.topk, or set stage2.kd_source=online")
    from hmscale.teacher.cache.build import plan_meta, stage_shard_ids

    # the rows of the shards stage 2 draws from, as a top-k cache holds them: with or without KD, the same rows
    return plan_rows(data.plan, stage_shard_ids(cfg, plan_meta(data.plan), "stage2"))


def _kd_teacher(cfg, teacher, student, data, layout):
    """The live teacher for online KD (frozen, eval, on this worker's device): the given one, the
    stage-1 student's, or the run's (`get_teacher`)."""
    if teacher is None and student is not None:
        teacher = getattr(student, "teacher", None)
    if teacher is None:
        if data is None:
            raise TrainingError("stage2.kd_source=online needs the teacher: pass teacher= (or data= to load the run's teacher)")
        from hmscale.teacher import get_teacher

        teacher = get_teacher(cfg, data, device=str(layout.device), log=lambda *a, **k: None)
    teacher.to(layout.device).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    return teacher


def build_stage2_model(cfg, run_dir, *, teacher=None, student=None):
    """HedgeMamba from the stage-1 student (given, or loaded from run_dir/stage1): converted from the Hedgehog
    student (stage1.transfer=attention), or the stage-1 HedgeMamba itself (transfer=mixer), every weight
    trainable again."""
    from hmscale.models.convert import to_hedgemamba
    from hmscale.models.hedgemamba import HedgeMambaForCausalLM

    if student is None:
        from hmscale.train.stage1 import load_stage1_student

        student = load_stage1_student(run_dir, teacher=teacher, cfg=cfg)
    if not isinstance(student, HedgeMambaForCausalLM):
        return to_hedgemamba(student, cfg.stage2.components)
    want = cfg.stage2.components.model_dump()
    got = {k: getattr(student.config, k) for k in want}
    if got != want:
        diff = ", ".join(f"{k}={got[k]} (stage 2: {want[k]})" for k in want if got[k] != want[k])
        raise TrainingError(f"stage2.components: the stage-1 mixers were trained with {diff}; "
                            "rerun stage 1 with the same stage2.components, or use stage1.transfer=attention")
    for p in student.parameters():
        p.requires_grad_(True)
    return student


def _graph_step_begin() -> None:
    """Before each forward of the student: with parallel.compile_mode=reduce-overhead torch's CUDA-graph trees must
    know that a new step starts (the previous micro-batch's or validation's graph outputs may then be reused);
    elsewhere it does nothing."""
    torch.compiler.cudagraph_mark_step_begin()


@torch.no_grad()
def validation_loss(engine, val_tokens, layout: Layout, micro_batch_size: int, max_sequences: int) -> dict:
    """Mean next-token CE over the first max_sequences validation rows, split over dp ranks."""
    if val_tokens is None or len(val_tokens) == 0:
        return {}
    rows = np.asarray(val_tokens)[:max_sequences]
    # every row once over the dp ranks (the last `len(rows) % dp` were dropped: the loss depended on the number of
    # workers and was not the exported model's on the same rows); each rank runs the same number of forwards (ZeRO-3
    # and tp gather inside them), a rank short of rows repeating its last one, uncounted
    n = len(rows)
    per = -(-n // layout.dp_size)
    lo = layout.dp_rank * per
    counted = np.arange(lo, lo + per) < n
    mine = rows[np.minimum(np.arange(lo, lo + per), n - 1)]
    was_training = engine.module.training
    engine.module.eval()
    total = torch.zeros(2, dtype=torch.float64)
    shard = getattr(engine.module, "vocab_shard", None)
    if shard is not None:
        from hmscale.parallel.vocab import vocab_gather, vocab_logsumexp
    for i in range(0, len(mine), micro_batch_size):
        x = torch.as_tensor(mine[i : i + micro_batch_size], dtype=torch.long, device=layout.device)
        _graph_step_begin()
        logits = engine(input_ids=x).logits
        keep = counted[i : i + micro_batch_size]
        if not keep.any():
            continue
        if not keep.all():
            keep = torch.as_tensor(keep, device=layout.device)
            logits, x = logits[keep], x[keep]
        if shard is None and kernels.resolve_backend(logits) == "triton":  # no fp32 copy of the logits
            nll = kernels.next_token_loss_sums(logits, x)[0]
        elif shard is None:
            logits = logits[:, :-1].float()
            nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum")
        else:
            logits = logits[:, :-1].float()  # this rank's vocabulary slice (vocabulary-parallel LM head)
            nll = (vocab_logsumexp(logits, shard) - vocab_gather(logits, x[:, 1:, None], shard)[..., 0]).sum()
        total += torch.tensor([nll.item(), x[:, 1:].numel()], dtype=torch.float64)
    if was_training:
        engine.module.train()
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        t = total.float().to(layout.device if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(t)
        total = t.double().cpu() / max(layout.tp_size, 1)
    loss = float(total[0] / max(total[1], 1))
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0))}


def run_stage2(
    cfg,
    run_dir: str | os.PathLike,
    *,
    data=None,
    teacher=None,
    student=None,
    model: torch.nn.Module | None = None,
    source=None,
    cache_dir: str | os.PathLike | None = None,
    resume: bool = True,
    resume_from: str | os.PathLike | None = None,
    stop_at_step: int | None = None,
    on_checkpoint: Callable[[int, Path, dict], None] | None = None,
    fault_hook: Callable[[int], None] | None = None,
    export: bool = True,
) -> dict:
    """Fine-tune HedgeMamba on this process's share of the data; returns a summary dict.

    model: a ready causal LM to train instead of converting `student` (tests, benchmarks).
    source: rows to train on (ArraySource/PlanSource/CacheSource); default: the cache when
            cache_dir is given, else `data.plan`.
    resume: continue from the newest complete checkpoint in run_dir/stage2/checkpoints.
    resume_from: an explicit checkpoint directory (e.g. Ray Train's restored checkpoint).
    stop_at_step: stop (with a checkpoint) before this step, as if interrupted.
    """
    s2, par = cfg.stage2, cfg.parallel
    out = stage_dir(run_dir, "stage2")
    layout = setup_layout(cfg)
    zero = par.zero  # the stage DeepSpeed runs (a ds_config file's own)
    seed_everything(cfg.seed)
    out.mkdir(parents=True, exist_ok=True)
    if layout.rank == 0:  # (the stage commands keep no results.json: where relative inputs were read)
        record_inputs(cfg, run_dir)

    if model is None:
        model = build_stage2_model(cfg, run_dir, teacher=teacher, student=student)
    if not stage2_uses_teacher(s2) and (teacher is not None or student is not None):
        # no live teacher in this stage (KD from the cache, or none): the teacher (and the stage-1 student around it)
        # only built the model; let go of them before the engine (on a GPU the frozen teacher stayed resident through
        # the stage). The caller must not hold them either (ray_jobs.distill.train_func hands them over)
        teacher = student = None
        free_released_memory()
    frozen = freeze_embeddings(model)
    if getattr(s2, "trainable", "all") == "mixers":
        frozen += freeze_all_but_mixers(model)
    lora_layers: list[str] = []
    if getattr(s2, "lora_rank", 0):
        n, lora_layers = apply_stage2_lora(model, s2, seed=cfg.seed)
        frozen += n
    if layout.tp_size > 1:
        from hmscale import parallel as hp

        # the LM head by vocabulary rows too whenever tp divides the vocabulary (Pythia's 50,304 always)
        model = hp.apply_tensor_parallel(model, layout.mesh,
                                         vocab_parallel=model.config.vocab_size % layout.tp_size == 0)
        note = hp.whole_head_note(model.config.vocab_size, layout.tp_size)
        if note and layout.rank == 0:
            print(f"stage2: note: {note}", flush=True)
    model.to(layout.device)
    model.train()
    if par.compile:
        from hmscale.parallel import apply_compile

        apply_compile(model, mode=None if par.compile_mode == "default" else par.compile_mode)
        if par.compile_mode == "reduce-overhead" and zero < 2:
            from hmscale.parallel import keep_gradients_out_of_graph_pool

            keep_gradients_out_of_graph_pool(model)  # param.grad accumulates over micro-batches there

    cache_plan = None  # the data plan of the cache this stage opens (its manifest's), when it opens one
    if source is None:
        source = _source_for(cfg, data, cache_dir)
        if isinstance(source, CacheSource):
            cache_plan = source.reader.manifest.data["plan"]
    if cached_kd(s2) and not source.has_topk:
        raise TrainingError("stage2.kd_weight > 0 but the training rows carry no teacher top-k; set cache.capture.topk > 0 "
                            "or stage2.kd_source=online")
    hidden_weight = float(getattr(s2, "hidden_weight", 0.0))
    kd_teacher = _kd_teacher(cfg, teacher, student, data, layout) if _online_kd(s2) or hidden_weight > 0 else None
    if kd_teacher is not None and kd_teacher.config.vocab_size < model.config.vocab_size:
        raise TrainingError(f"stage2 (online KD / hidden alignment): the teacher has {kd_teacher.config.vocab_size} tokens, "
                            f"the student {model.config.vocab_size}; they must share the vocabulary")
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if par.bf16 and layout.device.type == "cuda"
                else contextlib.nullcontext())
    if getattr(s2, "epochs", 1) > 1 and not s2.steps:
        # several passes over the stage's token share: the rows a one-pass run would read, revisited
        source = token_share(source, cfg.budget.stage2_tokens, seed=cfg.seed + 2) or source
    seq_len = source.seq_len
    tokens_per_step = s2.micro_batch_size * s2.grad_accum * layout.dp_size * seq_len
    total_steps = stage_steps(cfg, "stage2", tokens_per_step)
    note = cache_plan and short_cache_note(cfg, cache_plan, reads=total_steps * tokens_per_step, stage="stage2")
    if note and layout.rank == 0:  # (a cache shorter than the budget: other rows than without cached KD, revisited)
        print(f"stage2: note: {note}", flush=True)
    spec = OptimSpec(
        lr=s2.lr, micro_batch_size=s2.micro_batch_size, grad_accum=s2.grad_accum, warmup_steps=s2.warmup_steps,
        total_steps=total_steps, min_lr_ratio=s2.min_lr_ratio, weight_decay=s2.weight_decay, grad_clip=s2.grad_clip,
        zero_stage=par.zero_stage, bf16=par.bf16, ds_config=par.ds_config, adam=par.adam, stage="stage2",
        on_gpu=layout.device.type == "cuda",
    )
    groups = param_groups(model, s2.lr, getattr(s2, "new_params_lr_scale", 1.0), getattr(s2, "feature_map_lr_scale", 1.0))
    engine = build_engine(model, spec, dp_world=layout.dp_size, mpu=layout.mpu, params=groups)
    if getattr(par, "cuda_graphs", False):  # after deepspeed.initialize: the graphs read the final parameters
        from hmscale.parallel import apply_cuda_graphs

        emb_grad = any(p.requires_grad for p in model.get_input_embeddings().parameters())
        apply_cuda_graphs(engine.module, s2.micro_batch_size, seq_len, inputs_require_grad=emb_grad)

    ckpt = Checkpointer(out / "checkpoints", keep=getattr(par, "keep_checkpoints", 2), rank=layout.rank)
    start_step, resumed = 0, None
    load_from = Path(resume_from) if resume_from else (ckpt.latest() if resume else None)
    if load_from is not None:
        Checkpointer.check_layout(load_from, "stage2", zero_stage=zero, dp=layout.dp_size, mp=layout.tp_size,
                                  samples_per_step=s2.micro_batch_size * s2.grad_accum * layout.dp_size)
        client = Checkpointer.load(engine, load_from)
        start_step = int(client.get("step", 0))
        resumed = resumed_totals(load_from, client, start_step * tokens_per_step)
    sampler = Sampler(source.num_sequences, seed=cfg.seed + 2)
    bplan = BatchPlan(s2.micro_batch_size, s2.grad_accum, layout.dp_rank, layout.dp_size)
    logger = MetricsLogger(out, "stage2", total_steps, start_step, rank=layout.rank,
                           progress=getattr(cfg, "_progress", True))
    if layout.rank == 0 and start_step == 0:
        from hmscale.parallel import full_numel

        # the whole model's count, not this rank's: a tensor-parallel shard counts as the parameter it is a slice of
        # (it read about 1/tp of the tp=1 count); ZeRO-3 has partitioned the parameters by now: ds_numel is the size
        n_train = sum(full_numel(p, layout.tp_size) for p in model.parameters() if p.requires_grad)
        logger.log(0, {"event": "start", "trainable_params": n_train, "frozen_params": frozen,
                       "total_steps": total_steps, "tokens_per_step": tokens_per_step,
                       "zero_stage": zero, "tp": layout.tp_size, "dp": layout.dp_size,
                       "lora_layers": len(lora_layers)}, kind="event")

    def micro_step(step: int, micro: int):
        batch = get_batch(source, sampler, bplan, step, micro, layout.device)
        x = batch["input_ids"]
        t_logits = t_hidden = None
        if kd_teacher is not None:
            with torch.no_grad(), autocast, whole_sequences(kd_teacher):
                t_out = kd_teacher(input_ids=x, use_cache=False, output_hidden_states=hidden_weight > 0)
            t_logits = t_out.logits if _online_kd(s2) else None
            t_hidden = t_out.hidden_states if hidden_weight > 0 else None
        # the flag only when asked for: a plain causal LM given as `model=` need not know it
        _graph_step_begin()
        out = engine(input_ids=x, output_hidden_states=True) if hidden_weight > 0 else engine(input_ids=x)
        loss, extras = causal_lm_losses(out.logits, x, batch, s2.kd_weight, s2.kd_temperature,
                                        ce_weight=getattr(s2, "ce_weight", 1.0), teacher_logits=t_logits,
                                        vocab_shard=getattr(model, "vocab_shard", None))
        if hidden_weight > 0:
            h = hidden_alignment(out.hidden_states, t_hidden)
            extras["hidden"] = h.detach()
            loss = loss + hidden_weight * h
        return loss, extras

    val_tokens = getattr(data, "val_tokens", None) if data is not None else None
    if val_tokens is not None and len(val_tokens) == 0:
        # no validation rows (a small corpus): no eval at all (each eval_every wrote an empty eval line to metrics.jsonl
        # and an empty "stage2 step N:" to the progress)
        val_tokens = None

    def eval_fn(step):
        return validation_loss(engine, val_tokens, layout, s2.micro_batch_size, cfg.eval.max_sequences)

    def client_state(step):
        return {"step": step, "samples_seen": bplan.samples_seen(step), "stage": "stage2",
                "total_steps": total_steps, "seed": cfg.seed}

    try:
        res = train_loop(
            name="stage2", engine=engine, micro_step=micro_step, total_steps=total_steps, grad_accum=s2.grad_accum,
            start_step=start_step, checkpointer=ckpt, checkpoint_every=par.checkpoint_every, logger=logger,
            client_state=client_state, tokens_per_step=tokens_per_step, stop_at_step=stop_at_step,
            eval_fn=eval_fn if val_tokens is not None else None, eval_every=s2.eval_every,
            on_checkpoint=on_checkpoint, fault_hook=fault_hook, resumed=resumed,
        )
    finally:
        logger.close()
    done = res.end_step >= total_steps
    summary = {
        "stage": "stage2", "done": done, "start_step": start_step, "end_step": res.end_step,
        "total_steps": total_steps, "tokens": res.stage_tokens, "seconds": res.stage_seconds,
        "resumed_seconds": float(res.resumed.get("seconds", 0.0)),  # (earlier attempts')
        "final_loss": res.final_loss, "losses": res.losses,
        "checkpoint": res.last_checkpoint, "dp": layout.dp_size, "tp": layout.tp_size, "zero_stage": zero,
    }
    if done and val_tokens is not None:
        # the final weights' validation: the loop's own at its last step (evaluating them again cost a second pass)
        last = res.last_eval
        summary.update(last[1] if last is not None and last[0] == res.end_step else eval_fn(res.end_step))
    if done and export:
        hf = export_hf(engine, out / "hf", layout, zero)
        summary["hf"] = str(hf)
    if layout.rank == 0:
        atomic_write_json(out / "summary.json", {k: v for k, v in summary.items() if k != "losses"})
    barrier()
    return summary
