"""Cost planner for a scaling study: parameters, memory per GPU, parallel layout, cache bytes, GPU-hours.

Everything is computed from the architecture (a `Flavor`) and a `PlanSettings`; nothing is
measured here except what the user passes in (throughputs).

Parameter counts
    Teacher (GPT-NeoX, untied embeddings): ``2 V d`` (embed_in, embed_out) ``+ L (12 d^2 + 13 d)``
    (LN1, LN2, fused qkv, dense, 4x MLP, all with biases) ``+ 2 d`` (final LN). This reproduces the
    published Pythia counts exactly.
    Student (HedgeMamba): the teacher's weights plus, per layer, the Hedgehog feature maps
    ``H (F P + F)``, the depthwise causal conv on q,k,v ``3 d w + 3 d``, the gate projection
    ``d^2 + d`` (Mamba-2 style z branch) and the SSM's dt projection ``d H + H`` plus per-head
    ``A_log``, ``A_scale`` and ``D`` (``3 H``). Components switched off drop their terms. This is
    exactly what `hmscale.models.convert.to_hedgemamba` builds (tested).

Memory per GPU (bytes; bf16 mixed precision with Adam, the ZeRO paper's accounting)
    parameters 2 B/param, gradients 2 B/trainable param, optimizer 12 B/trainable param (fp32 master,
    Adam m and v). Tensor parallelism divides all three by tp. ZeRO-1 divides the optimizer states by
    dp, ZeRO-2 also the gradients, ZeRO-3 also the parameters. Stage 2 trains everything except the
    input embedding (frozen: parameters only); with ``stage2.trainable=mixers`` (``trainable``) only the blocks'
    sequence mixers (in_proj, out_proj and HedgeMamba's added parts); with LoRA (``lora_rank``) only the adapters,
    ``r (in + out)`` per adapted layer, and HedgeMamba's added parts (in both cases the FLOP model still counts a
    full backward: an upper bound).
    Activations per token per HedgeMamba block (saved for backward, bf16): LN1 in/out 2d, qkv 3d,
    conv out 3d, rotary q,k 2d, feature-map pre-activations 2 H F, phi(q), phi(k) 2 H 2F, SSD output d,
    gate z, silu(z), gated output 3d, LN2 in/out 2d, MLP 4d + 4d; plus the SSD chunk states in fp32,
    ``4 H (P+1) N / chunk`` bytes. The LayerNorm terms are replicated under tp, the rest sharded.
    With activation checkpointing only each layer's input (2d bytes) is kept, plus one layer's full
    set during its recomputation. The LM head adds ``12 V / tp`` bytes per token (bf16 logits, fp32
    upcast / log-softmax, their gradients). Both terms are calibrated on a measurement (CALIBRATION_*).
    Teacher forward (no grad, bf16): parameters 2 B/param / tp, one layer's working set
    (~14 d bf16 per token with a fused attention kernel), fp32 logits when top-k is captured, and the
    captured tensors of the batch held until they are written, for a batch of ``teacher_micro_batch``
    sequences (``cache.batch_size``, 8 by default; ``--teacher-batch``). The captures grow with the batch and
    dominate for large teachers (pythia-12b: 24 GB of weights, 12 GB of captures at 8 x 2048 tokens).
    hmscale's cache workers hold the whole teacher on each GPU: a teacher tp above 1 in the plan is the
    sharding the forward would need, which they do not do (a smaller ``cache.batch_size`` or a larger GPU does).
    Every GPU also loses ``reserved_gb`` (CUDA context, NCCL and DeepSpeed buckets) and only
    ``usable_fraction`` of the rest is planned for (allocator fragmentation).

Layout search
    All (dp, tp, ZeRO, activation checkpointing) with tp a divisor of the heads up to ``max_tp``
    (one node) and no ZeRO-3 together with tp > 1 (hmscale's engines do not support it), over the GPU
    counts (dp x tp) 1 to 8 (one node), then whole nodes of 8 (16, 24, ...), and ``max_gpus`` itself when it
    is none of these (a cap of 12 plans 12 GPUs where 8 do not do). The plan is
    the one with the fewest GPUs of those counts; at equal GPU count: no activation checkpointing first (faster), then
    the most free memory (room for a larger micro batch), then the lower ZeRO stage and smaller tp.
    A size whose training state fits one GPU gets dp=1, tp=1, ZeRO-0; one that does not fit gets its
    model state sharded (tp > 1 or ZeRO-3), since ZeRO-1/2 keep a full parameter replica per GPU.

Cache bytes
    Per cached token: captured layers x captured tensors x d x dtype bytes x token fraction, plus
    the token id and document index (8 bytes), plus top-k log-probs (value + int32 index) when
    captured. The per-layer tensors are cached for the stage-1 tokens; top-k for the stage-2 tokens.

GPU-hours
    ``tokens / (tokens/s per GPU) / 3600`` per stage (cache = teacher forward, stage1, stage2). Pass
    measured tokens/s per GPU as a table ``{size: {stage: tokens_per_s}}`` (JSON or CSV with columns
    size, stage, tokens_per_s). A stage the table does not give (for that size or ``"*"``) comes from the
    default model (``SizePlan.measured_stages`` lists the measured ones; ``throughput_source`` is measured,
    partial or model; the plan table marks each modelled number ``*``). The default model is FLOP-based:
    ``tokens/s = mfu[stage] x peak_tflops / flops_per_token[stage]`` with
    cache ``2 N_teacher + 2 L s d`` (causal attention), stage 1 ``2 (3 d^2) L`` (q,k,v from the cached
    input) ``+ 6 (feature-map params) + 3 L H 4 P (2F)`` (linear attention, fwd+bwd), stage 2
    ``6 N_student`` (``8 N`` with checkpointing) ``+ 3 L H (2 Q (N + P) + 4 P N)`` (chunked SSD), with
    peak 989 TFLOP/s (H100/H200 bf16 dense) and MFU 0.40 / 0.10 / 0.12 (stage 2 fitted to the H200
    measurement below; cache and stage 1 are guesses). Replace it with measured numbers.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Iterable

from hmscale.teacher.flavors import Flavor, get_flavor
from scaling.budget import Budget, BudgetRule
from scaling.registry import Size, resolve_sizes

GB = 1e9
STAGES = ("cache", "stage1", "stage2")
# Calibration against `benchmarks/train_throughput.py` on one H200 (2026-11-29; HedgeMamba 160m / 410m /
# 1b shapes, ZeRO-2, bf16, seq 2048 x micro batch 8; scaling/calibration/ holds the JSON):
#  - activations measured 1.40 / 2.73 / 4.23 MB per token; the listed tensors alone gave 0.93 / 1.98 /
#    3.33 MB. The LM head keeps 12 bytes per vocabulary entry per token (not 6) and each block ~9 d
#    more bf16 elements; with both the estimate is within 5 % of all three.
#  - tokens/s 79.0K / 34.6K / 21.2K, i.e. 8.4 / 9.3 / 14.5 % of 989 TFLOP/s by the FLOP count below,
#    hence the stage-2 MFU default of 0.12 (re-measure: the SSD kernel is still launch-bound).
HEAD_BYTES_PER_VOCAB = 12
CALIBRATION_ELEMS_PER_LAYER = 9
DEFAULT_MFU = {"cache": 0.40, "stage1": 0.10, "stage2": 0.12}


# --------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class PlanSettings:
    gpu_mem_gb: float = 80.0
    usable_fraction: float = 0.9
    reserved_gb: float = 2.0
    seq_len: int = 2048
    micro_batch: int = 4
    teacher_micro_batch: int = 8
    max_tp: int = 8  # tensor parallelism stays inside one node
    max_gpus: int = 4096
    zero_stage: int | None = None  # force a ZeRO stage (None = the planner picks)
    tp: int | None = None  # force a tp degree
    activation_checkpointing: bool | None = None  # None = the planner picks
    vocab_size: int | None = None  # None = the flavour's
    # student architecture
    feature_dim: int | None = None  # F; None = head_dim
    gate: bool = True
    conv: bool = True
    ssm: bool = True
    conv_width: int = 4
    chunk_size: int = 64
    freeze_embed_out: bool = False
    # what stage 2 trains (stage2.trainable): "all" (every weight but the input embedding) or "mixers" (only the
    # blocks' sequence mixers: in_proj, out_proj, feature maps, conv, gate, dt/A/D; MLPs, LayerNorms, LM head frozen)
    trainable: str = "all"
    # stage 2 with LoRA (stage2.lora_rank > 0): every teacher weight frozen, rank-r adapters on these layers
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = ("in_proj", "out_proj")
    # cache
    capture_layers: int | None = None  # None = all layers
    capture_tensors: int = 2  # attn_input, attn_output
    capture_bytes: float = 2.0  # bf16 (fp8: 1, fp32: 4)
    token_fraction: float = 1.0
    topk: int = 0
    # budget and throughput
    budget: BudgetRule = field(default_factory=BudgetRule)
    throughput: dict | None = None  # {size: {stage: tokens/s per GPU}}
    peak_tflops: float = 989.0
    mfu: dict = field(default_factory=lambda: dict(DEFAULT_MFU))

    def __post_init__(self):
        if not (math.isfinite(self.gpu_mem_gb) and self.gpu_mem_gb > 0) or not 0 < self.usable_fraction <= 1:
            raise ValueError("plan: gpu_mem_gb must be positive and usable_fraction in (0, 1]")
        if self.trainable not in ("all", "mixers"):
            raise ValueError(f"plan: trainable {self.trainable!r} must be all or mixers (stage2.trainable)")
        if self.zero_stage not in (None, 0, 1, 2, 3):
            raise ValueError(f"plan: zero_stage {self.zero_stage} must be 0, 1, 2 or 3")
        # the recipe config's own ranges (data.seq_len, *.micro_batch_size, cache.capture.*, stage2.lora_rank):
        # out of them the memory, cache and GPU-hour formulas give numbers for a run that cannot exist
        for name, ok, rule in (
            ("seq_len", self.seq_len > 1, "> 1"), ("micro_batch", self.micro_batch > 0, "> 0"),
            ("teacher_micro_batch", self.teacher_micro_batch > 0, "> 0"), ("max_tp", self.max_tp > 0, "> 0"),
            ("max_gpus", self.max_gpus > 0, "> 0"),
            ("token_fraction", 0 < self.token_fraction <= 1, "in (0, 1]"), ("topk", self.topk >= 0, ">= 0"),
            ("lora_rank", self.lora_rank >= 0, ">= 0"),
        ):
            if not ok:
                raise ValueError(f"plan: {name} {getattr(self, name)} must be {rule}")

    @property
    def usable_bytes(self) -> float:
        return (self.gpu_mem_gb - self.reserved_gb) * GB * self.usable_fraction

    @classmethod
    def from_run_config(cls, cfg, **kw) -> "PlanSettings":
        """Settings that follow a RunConfig's data, capture and component choices."""
        cap = cfg.cache.capture
        comp = cfg.stage2.components
        base = dict(
            seq_len=cfg.data.seq_len,
            micro_batch=cfg.stage2.micro_batch_size,
            teacher_micro_batch=cfg.cache.batch_size,
            feature_dim=cfg.stage1.feature_dim,
            gate=comp.gate,
            conv=comp.conv,
            ssm=comp.ssm,
            conv_width=comp.conv_width,
            capture_tensors=len(cap.tensors),
            capture_bytes={"bfloat16": 2.0, "float32": 4.0, "fp8_e4m3": 1.0}[cap.dtype],
            token_fraction=cap.token_fraction,
            topk=cap.topk,
            capture_layers=None if cap.layers == "all" else len(cap.layers),
            budget=BudgetRule(split=tuple(cfg.budget.split)),
            lora_rank=cfg.stage2.lora_rank,
            trainable=cfg.stage2.trainable,
            lora_targets=tuple(cfg.stage2.lora_targets),
            # a miniature teacher's vocabulary is the tokenizer's (trained on the data)
            vocab_size=cfg.tokenizer.vocab_size if cfg.teacher.name_or_path is None and cfg.tokenizer.name_or_path is None else None,
        )
        base.update(kw)
        return cls(**base)


def _flavor(f: Flavor | Size | str) -> Flavor:
    if isinstance(f, Size):
        return f.flavor
    return get_flavor(f) if isinstance(f, str) else f


# --------------------------------------------------------------------------- parameters


def count_params(flavor: Flavor | Size | str, vocab_size: int | None = None) -> int:
    """Teacher (GPT-NeoX) parameter count, computed from the architecture."""
    f = _flavor(flavor)
    V, d, L = vocab_size or f.vocab_size, f.d_model, f.n_layers
    per_layer = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * f.d_ff + f.d_ff) + (f.d_ff * d + d)
    return 2 * V * d + L * per_layer + 2 * d


def student_param_breakdown(flavor: Flavor | Size | str, settings: PlanSettings | None = None) -> dict[str, int]:
    """HedgeMamba parameters by part (see the module docstring)."""
    s = settings or PlanSettings()
    f = _flavor(flavor)
    V, d, L, H, P = s.vocab_size or f.vocab_size, f.d_model, f.n_layers, f.n_heads, f.head_dim
    F = s.feature_dim or P
    teacher = count_params(f, V)
    parts = {
        "embed_in": V * d,
        "embed_out": V * d,
        "teacher_blocks": teacher - 2 * V * d,
        "feature_maps": L * H * (F * P + F),
        "conv": L * (3 * d * s.conv_width + 3 * d) if s.conv else 0,
        "gate": L * (d * d + d) if s.gate else 0,
        "ssm": L * (d * H + 4 * H) if s.ssm else 0,  # dt projection (weight + bias), A_log, A_scale, D
    }
    if s.lora_rank:
        parts["lora"] = s.lora_rank * sum(_lora_dims(t, f, V, d, H) for t in s.lora_targets)
    parts["total"] = sum(parts.values())
    if s.lora_rank:  # the adapters and HedgeMamba's added parts train; the teacher's weights (and adapted bases) not
        gate = 0 if "z_proj" in s.lora_targets else parts["gate"]
        ssm = parts["ssm"] - (L * (d * H + H) if "dt_proj" in s.lora_targets and s.ssm else 0)
        parts["trainable"] = parts["lora"] + parts["feature_maps"] + parts["conv"] + gate + ssm
        return parts
    if s.trainable == "mixers":  # stage2.trainable=mixers: what replaced attention (in_proj, out_proj and the new parts)
        parts["trainable"] = (L * (3 * d * d + 3 * d + d * d + d) + parts["feature_maps"] + parts["conv"]
                              + parts["gate"] + parts["ssm"])
        return parts
    frozen = parts["embed_in"] + (parts["embed_out"] if s.freeze_embed_out else 0)
    parts["trainable"] = parts["total"] - frozen
    return parts


def _lora_dims(target: str, f: Flavor, V: int, d: int, H: int) -> int:
    """in + out features summed over the model's layers of that name (the adapters of one rank)."""
    L = f.n_layers
    per_layer = {"in_proj": d + 3 * d, "out_proj": 2 * d, "z_proj": 2 * d, "dt_proj": d + H,
                 "dense_h_to_4h": d + f.d_ff, "dense_4h_to_h": f.d_ff + d}
    if target == "lm_head":
        return d + V
    if target not in per_layer:
        raise ValueError(f"plan: LoRA target {target!r} unknown; choose from {', '.join([*per_layer, 'lm_head'])}")
    return L * per_layer[target]


def student_params(flavor: Flavor | Size | str, settings: PlanSettings | None = None) -> int:
    return student_param_breakdown(flavor, settings)["total"]


# --------------------------------------------------------------------------- memory


def activation_bytes_per_token_layer(flavor: Flavor, settings: PlanSettings, tp: int = 1) -> float:
    """Bytes saved for backward per token by one HedgeMamba block (module docstring)."""
    s = settings
    d, H, P = flavor.d_model, flavor.n_heads, flavor.head_dim
    F = s.feature_dim or P
    N = 2 * F
    replicated = 2 * (2 * d + 2 * d)  # LN1 and LN2 inputs/outputs, bf16
    sharded_elems = 3 * d + (3 * d if s.conv else 0) + 2 * d + 2 * H * F + 2 * H * N + d + (3 * d if s.gate else 0) + 8 * d
    sharded_elems += CALIBRATION_ELEMS_PER_LAYER * d  # what the list above misses (see CALIBRATION_*)
    sharded = 2 * sharded_elems + 4 * H * (P + 1) * N / s.chunk_size
    return replicated + sharded / tp


def train_memory(
    flavor: Flavor | Size | str,
    dp: int = 1,
    tp: int = 1,
    zero_stage: int = 0,
    activation_checkpointing: bool = False,
    settings: PlanSettings | None = None,
) -> dict[str, float]:
    """Per-GPU bytes for stage-2 training: parameters, gradients, optimizer, activations, total."""
    s = settings or PlanSettings()
    f = _flavor(flavor)
    parts = student_param_breakdown(f, s)
    n_all, n_train = parts["total"], parts["trainable"]
    V = s.vocab_size or f.vocab_size
    params = 2 * n_all / tp / (dp if zero_stage >= 3 else 1)
    grads = 2 * n_train / tp / (dp if zero_stage >= 2 else 1)
    optim = 12 * n_train / tp / (dp if zero_stage >= 1 else 1)
    tokens = s.micro_batch * s.seq_len
    per_layer = activation_bytes_per_token_layer(f, s, tp)
    if activation_checkpointing:
        blocks = tokens * (f.n_layers * 2 * f.d_model + per_layer)
    else:
        blocks = tokens * f.n_layers * per_layer
    # LM head: bf16 logits, their fp32 upcast and log-softmax, its fp32 and bf16 gradients; embeddings
    head = tokens * (V * HEAD_BYTES_PER_VOCAB / tp + 2 * 2 * f.d_model)
    acts = blocks + head
    total = params + grads + optim + acts
    return {"params": params, "grads": grads, "optimizer": optim, "activations": acts, "total": total}


def teacher_forward_memory(flavor: Flavor | Size | str, tp: int = 1, settings: PlanSettings | None = None) -> dict[str, float]:
    """Per-GPU bytes for the teacher-forward (cache) workers: params, activations (of which captured), total."""
    s = settings or PlanSettings()
    f = _flavor(flavor)
    V = s.vocab_size or f.vocab_size
    tokens = s.teacher_micro_batch * s.seq_len
    params = 2 * count_params(f, V) / tp
    working = tokens * 2 * (4 * f.d_model + 10 * f.d_model / tp)  # residual + LN replicated, rest sharded
    logits = tokens * V * (4 if s.topk else 2) / tp
    layers = s.capture_layers if s.capture_layers is not None else f.n_layers
    captured = tokens * layers * s.capture_tensors * f.d_model * s.capture_bytes * s.token_fraction
    acts = working + logits + captured
    return {"params": params, "activations": acts, "captured": captured, "total": params + acts}


def _divisors(n: int, cap: int) -> list[int]:
    return [t for t in range(1, min(n, cap) + 1) if n % t == 0]


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    zero_stage: int
    activation_checkpointing: bool
    bytes_per_gpu: float
    free_bytes: float

    @property
    def gpus(self) -> int:
        return self.dp * self.tp


def check_forced_layout(flavor: Flavor | Size | str, settings: PlanSettings) -> None:
    """A forced ``tp`` (--tp, with --zero when forced too) checked by the recipe config's own rules for this
    teacher (``RunConfig``: tp divides the heads, no ZeRO-3 with tp > 1, ...): the planner must not lay out what
    ``hmscale check`` rejects. One-line ValueError naming the options; flavours outside the registry are not checked."""
    from hmscale.config import ConfigError, build_config
    from hmscale.teacher.flavors import FLAVORS

    f = _flavor(flavor)
    if settings.tp is None or FLAVORS.get(f.name) != f:
        return
    parallel = {"tp": settings.tp, "num_workers": max(settings.tp, 1)}
    if settings.zero_stage is not None:
        parallel["zero_stage"] = settings.zero_stage
    try:
        build_config({"teacher": {"flavor": f.name, "name_or_path": f.hub_id}, "parallel": parallel})
    except ConfigError as err:
        given = f"--tp {settings.tp}" + (f" with --zero {settings.zero_stage}" if settings.zero_stage is not None else "")
        change = "--tp or --zero" if settings.zero_stage is not None else "--tp"
        raise ValueError(f"{given}: not a layout the recipe accepts for {f.name} ({err}); change {change}, or leave "
                         "--tp out and the planner picks a tp per size") from None


def choose_layout(flavor: Flavor | Size | str, settings: PlanSettings | None = None) -> Layout:
    """The smallest (dp, tp, ZeRO) layout whose stage-2 training state fits one GPU (module docstring)."""
    s = settings or PlanSettings()
    f = _flavor(flavor)
    check_forced_layout(f, s)
    budget = s.usable_bytes
    tps = [s.tp] if s.tp is not None else _divisors(f.n_heads, s.max_tp)
    if s.lora_rank:
        if s.tp and s.tp > 1:
            raise ValueError("plan: LoRA runs with ZeRO data parallelism only (tp=1); drop --tp or --lora-rank")
        tps = [1]  # hmscale's stage 2 runs LoRA without tensor parallelism
    zeros = [s.zero_stage] if s.zero_stage is not None else [0, 1, 2, 3]
    ckpts = [s.activation_checkpointing] if s.activation_checkpointing is not None else [False, True]
    for n in _gpu_counts(s.max_gpus):
        fits = []
        for tp in tps:
            if n % tp:
                continue
            dp = n // tp
            for z in zeros:
                if tp > 1 and z == 3:
                    continue
                if dp == 1 and z > 0 and s.zero_stage is None:
                    continue  # ZeRO over one replica shards nothing
                for ck in ckpts:
                    total = train_memory(f, dp, tp, z, ck, s)["total"]
                    if total <= budget:
                        fits.append(Layout(dp, tp, z, ck, total, budget - total))
        if fits:
            return min(fits, key=lambda lay: (lay.activation_checkpointing, -lay.free_bytes, lay.zero_stage, lay.tp))
    forced = [opt for opt, v in (("--tp", s.tp), ("--zero", s.zero_stage)) if v is not None]
    raise ValueError(
        f"plan: the {f.name} stage-2 training state does not fit {s.max_gpus} GPUs of {s.gpu_mem_gb:g} GB at micro "
        f"batch {s.micro_batch} x seq {s.seq_len}; lower the micro batch (--micro-batch, stage2.micro_batch_size) "
        f"or raise --gpu-mem{' or --max-tp' if s.tp is None else ''}"
        + (f", or leave {' and '.join(forced)} to the planner" if forced else "")
    )


def _gpu_counts(max_gpus: int) -> list[int]:
    """The GPU counts the layout search tries, smallest first: every count of one node (1-8), then whole nodes of 8,
    then ``max_gpus`` itself when it is none of these."""
    counts = [*range(1, min(max_gpus, 8) + 1), *range(16, max_gpus + 1, 8)]
    return counts if counts[-1] == max_gpus else [*counts, max_gpus]


def min_teacher_tp(flavor: Flavor | Size | str, settings: PlanSettings | None = None) -> int:
    s = settings or PlanSettings()
    f = _flavor(flavor)
    tps = _divisors(f.n_heads, s.max_tp)
    for tp in tps:
        if teacher_forward_memory(f, tp, s)["total"] <= s.usable_bytes:
            return tp
    # the one-line refusal: what the forward holds at the largest tp tried, and what to change
    tp, mem = tps[-1], teacher_forward_memory(f, tps[-1], s)
    captured = mem["captured"]  # the part a smaller teacher batch or capture spec shrinks
    raise ValueError(
        f"plan: the {f.name} teacher forward (the cache pass) needs {mem['total'] / GB:.1f} GB per GPU at tp {tp} "
        f"(weights {mem['params'] / GB:.1f} GB; a batch of {s.teacher_micro_batch} x {s.seq_len} tokens: captured "
        f"tensors {captured / GB:.1f} GB, logits and working set {(mem['activations'] - captured) / GB:.1f} GB) of the "
        f"{s.usable_bytes / GB:.1f} GB planned of a {s.gpu_mem_gb:g} GB GPU; lower the teacher batch (--teacher-batch, "
        "cache.batch_size), capture less (--token-fraction, cache.capture.layers / dtype) or raise --gpu-mem"
    )


# --------------------------------------------------------------------------- cache and cost


def cache_bytes_per_token(flavor: Flavor | Size | str, settings: PlanSettings | None = None) -> dict[str, float]:
    s = settings or PlanSettings()
    f = _flavor(flavor)
    layers = s.capture_layers if s.capture_layers is not None else f.n_layers
    per_layer = layers * s.capture_tensors * f.d_model * s.capture_bytes * s.token_fraction + 8
    topk = s.topk * (2 + 4) + (8 if s.topk else 0)
    return {"layers": per_layer, "topk": topk}


def cache_bytes(flavor: Flavor | Size | str, budget: Budget, settings: PlanSettings | None = None) -> float:
    b = cache_bytes_per_token(flavor, settings)
    return b["layers"] * budget.stage1_tokens + b["topk"] * budget.stage2_tokens


def flops_per_token(flavor: Flavor | Size | str, settings: PlanSettings | None = None, activation_checkpointing: bool = False) -> dict[str, float]:
    s = settings or PlanSettings()
    f = _flavor(flavor)
    d, L, H, P = f.d_model, f.n_layers, f.n_heads, f.head_dim
    F = s.feature_dim or P
    N, Q = 2 * F, s.chunk_size
    parts = student_param_breakdown(f, s)
    cache = 2 * count_params(f, s.vocab_size) + 2 * L * s.seq_len * d
    stage1 = 2 * 3 * d * d * L + 6 * parts["feature_maps"] + 3 * L * H * 4 * P * N
    stage2 = (8 if activation_checkpointing else 6) * parts["total"] + 3 * L * H * (2 * Q * (N + P) + 4 * P * N)
    return {"cache": float(cache), "stage1": float(stage1), "stage2": float(stage2)}


def measured_throughput(name: str, settings: PlanSettings) -> dict:
    """The measured tokens/s per GPU of one size, by stage: the ``"*"`` row (every size) overlaid with the size's own
    row (its numbers win); stages neither gives are left out (the FLOP model's)."""
    table = settings.throughput or {}
    return {**(table.get("*") or {}), **(table.get(name) or {})}


def tokens_per_second(flavor: Flavor | Size | str, settings: PlanSettings | None = None, activation_checkpointing: bool = False) -> dict[str, float]:
    """Tokens/s per GPU per stage: the measured table where it has the size, else the FLOP model."""
    s = settings or PlanSettings()
    f = _flavor(flavor)
    measured = measured_throughput(f.name, s)
    fl = flops_per_token(f, s, activation_checkpointing)
    out = {}
    for st in STAGES:
        if st in measured:
            out[st] = float(measured[st])
        else:
            out[st] = s.mfu.get(st, DEFAULT_MFU[st]) * s.peak_tflops * 1e12 / fl[st]
    return out


def load_throughput(*paths: str | Path) -> dict:
    """Measured tokens/s per GPU: ``{size: {stage: tok/s}}``, merged over the files given.

    Accepted: JSON ``{size: {stage: tok/s}}`` (``"*"`` = every size); CSV ``size,stage,tokens_per_s``;
    and the JSON the repo's benchmarks write: ``benchmarks/train_throughput.py`` (rows
    ``{"model": "<size> hedgemamba", "tokens_per_s": ..}`` -> stage2) and
    ``benchmarks/cache_throughput.py`` (``{"teacher": size, "cache_tok_s": ..}`` -> cache).
    """
    from scaling.registry import canonical_name

    out: dict = {}
    for path in paths:
        p = Path(path)
        if not p.exists():
            raise ValueError(f"throughput table {str(p)!r} does not exist")
        try:
            raw = _read_throughput(p)
        except OSError as err:  # a folder, a file this user may not read
            raise ValueError(f"throughput table {str(p)!r} cannot be read ({err.strerror or type(err).__name__}); "
                             "pass a JSON or CSV file") from None
        except (ValueError, KeyError, TypeError, AttributeError) as err:  # json, csv and shape errors: one line
            what = f"no column {err}" if isinstance(err, KeyError) else str(err).strip().splitlines()[-1]
            raise ValueError(f"throughput table {p}: {what}; write JSON {{size: {{stage: tokens/s}}}} or CSV "
                             f"size,stage,tokens_per_s with stages {', '.join(STAGES)}") from None
        for size, stages in raw.items():
            try:
                key = size if size == "*" else canonical_name(size)
            except ValueError as err:
                raise ValueError(f"throughput table {p}: {err}") from None
            if not isinstance(stages, dict):
                raise ValueError(f"throughput table {p}: {size}: {stages!r} is not {{stage: tokens/s}} "
                                 f"(stages {', '.join(STAGES)})")
            bad = set(stages) - set(STAGES)
            if bad:
                raise ValueError(f"throughput table {p}: unknown stage(s) {sorted(bad)} for {size}; use {', '.join(STAGES)}")
            for st, v in stages.items():
                try:
                    v = float(v)
                except (TypeError, ValueError):
                    v = float("nan")
                if not (math.isfinite(v) and v > 0):  # a GPU-hour is tokens / (tokens/s): 0 divides by zero
                    raise ValueError(f"throughput table {p}: {size} {st}: {stages[st]!r} is not a positive number of tokens/s")
                out.setdefault(key, {})[st] = v
    return out


def _read_throughput(p: Path) -> dict:
    """One throughput file as ``{size: {stage: value}}``, unchecked (``load_throughput`` checks it)."""
    raw: dict = {}
    if p.suffix == ".json":
        data = json.loads(p.read_text())
        if isinstance(data, dict) and isinstance(data.get("rows"), list):  # train_throughput.py
            for r in data["rows"]:
                name, _, kind = str(r.get("model", "")).partition(" ")
                if kind == "hedgemamba" and r.get("tokens_per_s"):
                    raw.setdefault(name, {})["stage2"] = r["tokens_per_s"]
        elif isinstance(data, dict) and "cache_tok_s" in data and "teacher" in data:  # cache_throughput.py
            raw[data["teacher"]] = {"cache": data["cache_tok_s"]}
        elif isinstance(data, dict):
            raw = data
        else:
            raise ValueError(f"holds a JSON {type(data).__name__}, not an object")
    else:
        with p.open() as fh:
            for row in csv.DictReader(fh):
                raw.setdefault(row["size"], {})[row["stage"]] = row["tokens_per_s"]
    return raw


# --------------------------------------------------------------------------- the plan


@dataclass
class SizePlan:
    size: str
    hub_id: str | None
    layers: int
    d_model: int
    heads: int
    head_dim: int
    params: int
    published_params: int | None
    params_error: float | None  # relative, vs published
    student_params: int
    student_trainable: int
    total_tokens: int
    stage1_tokens: int
    stage2_tokens: int
    teacher_tp: int
    teacher_mem_gb: float
    dp: int
    tp: int
    zero_stage: int
    activation_checkpointing: bool
    gpus: int
    train_params_gb: float
    train_grads_gb: float
    train_optimizer_gb: float
    train_activations_gb: float
    train_mem_gb: float
    single_gpu_train_gb: float  # the whole training state on one GPU (dp=tp=1, ZeRO-0, checkpointing)
    cache_bytes_per_token: float
    cache_gb: float
    tokens_per_s: dict = field(default_factory=dict)
    gpu_hours: dict = field(default_factory=dict)
    gpu_hours_total: float = 0.0
    throughput_source: str = "model"  # measured (every stage) | partial (some stages) | model (none)
    measured_stages: str = ""  # the stages whose tokens/s came from the measured table, comma separated

    def row(self) -> dict:
        """A flat dict (CSV-friendly)."""
        out = asdict(self)
        for st in STAGES:
            out[f"tokens_per_s_{st}"] = self.tokens_per_s.get(st)
            out[f"gpu_hours_{st}"] = self.gpu_hours.get(st)
        del out["tokens_per_s"], out["gpu_hours"]
        return out


def plan_size(size: Size | Flavor | str, settings: PlanSettings | None = None, budget: Budget | None = None) -> SizePlan:
    s = settings or PlanSettings()
    f = _flavor(size)
    params = count_params(f, s.vocab_size)
    parts = student_param_breakdown(f, s)
    bud = budget or s.budget.budget(f, params)
    lay = choose_layout(f, s)
    mem = train_memory(f, lay.dp, lay.tp, lay.zero_stage, lay.activation_checkpointing, s)
    single = train_memory(f, 1, 1, 0, True, s)["total"]
    ttp = min_teacher_tp(f, s)
    tput = tokens_per_second(f, s, lay.activation_checkpointing)
    cache_toks = {"cache": bud.stage1_tokens + (bud.stage2_tokens if s.topk else 0), "stage1": bud.stage1_tokens, "stage2": bud.stage2_tokens}
    hours = {st: cache_toks[st] / tput[st] / 3600 for st in STAGES}
    measured = [st for st in STAGES if st in measured_throughput(f.name, s)]
    pub = f.published_params if (s.vocab_size in (None, f.vocab_size)) else None
    return SizePlan(
        size=f.name,
        hub_id=f.hub_id,
        layers=f.n_layers,
        d_model=f.d_model,
        heads=f.n_heads,
        head_dim=f.head_dim,
        params=params,
        published_params=pub,
        params_error=None if not pub else (params - pub) / pub,
        student_params=parts["total"],
        student_trainable=parts["trainable"],
        total_tokens=bud.total_tokens,
        stage1_tokens=bud.stage1_tokens,
        stage2_tokens=bud.stage2_tokens,
        teacher_tp=ttp,
        teacher_mem_gb=teacher_forward_memory(f, ttp, s)["total"] / GB,
        dp=lay.dp,
        tp=lay.tp,
        zero_stage=lay.zero_stage,
        activation_checkpointing=lay.activation_checkpointing,
        gpus=lay.gpus,
        train_params_gb=mem["params"] / GB,
        train_grads_gb=mem["grads"] / GB,
        train_optimizer_gb=mem["optimizer"] / GB,
        train_activations_gb=mem["activations"] / GB,
        train_mem_gb=mem["total"] / GB,
        single_gpu_train_gb=single / GB,
        cache_bytes_per_token=sum(cache_bytes_per_token(f, s).values()),
        cache_gb=cache_bytes(f, bud, s) / GB,
        tokens_per_s=tput,
        gpu_hours=hours,
        gpu_hours_total=sum(hours.values()),
        throughput_source="measured" if len(measured) == len(STAGES) else "partial" if measured else "model",
        measured_stages=",".join(measured),
    )


def plan(sizes: str | Iterable[str] | None = None, settings: PlanSettings | None = None) -> list[SizePlan]:
    s = settings or PlanSettings()
    return [plan_size(sz, s) for sz in resolve_sizes(sizes if sizes is None or isinstance(sizes, str) else list(sizes))]


def write_plan(plans: list[SizePlan], csv_path: str | Path | None = None, json_path: str | Path | None = None) -> None:
    from scaling.table import write_csv, write_json

    rows = [p.row() for p in plans]
    if csv_path:
        write_csv(csv_path, rows)
    if json_path:
        write_json(json_path, rows)


def settings_with(settings: PlanSettings, **kw) -> PlanSettings:
    return replace(settings, **{k: v for k, v in kw.items() if v is not None})


def fmt_bytes(n: float) -> str:
    for unit, scale in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def fmt_count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def fmt_hours(h: float) -> str:
    if h == 0 or math.isnan(h):
        return "0"
    return f"{h:.3g}" if h >= 0.01 else f"{h:.1e}"
