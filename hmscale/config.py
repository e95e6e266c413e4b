"""One typed config tree for a recipe run.

YAML in (`load_config(path, overrides)`), dotted command-line overrides (`stage2.lr=3e-4`),
cross-field validation, and the resolved tree saved into the run directory
(`save_resolved`). Every error is a `ConfigError` with one line naming the field and the fix.
"""

from __future__ import annotations

import contextvars
import hashlib
import json
import os
import re
import typing
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from hmscale.teacher.flavors import FLAVORS, get_flavor


class ConfigError(ValueError):
    """A bad configuration value; the message is one line that says what to change."""


def _number_field(annotation) -> bool:
    """Whether a field's type holds numbers (int / float, alone, optional, or in a list / tuple), not booleans."""
    leaves, todo = set(), [annotation]
    while todo:
        a = todo.pop()
        args = typing.get_args(a)
        if args and typing.get_origin(a) is not Literal:
            todo.extend(args)
        elif args:  # Literal[0, 1, 2, 3] holds numbers too (pydantic takes true / false there as 1 / 0)
            leaves.update(type(v) for v in args)
        else:
            leaves.add(a)
    return bool(leaves & {int, float}) and bool not in leaves


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_numbers(cls, value, info):
        if not _number_field(cls.model_fields[info.field_name].annotation):
            return value
        # pydantic's lax mode reads true / false as 1 / 0 for a number; a YAML boolean there is a mistake
        if isinstance(value, bool) or isinstance(value, (list, tuple)) and any(isinstance(v, bool) for v in value):
            raise ValueError("a boolean where a number is expected")
        if isinstance(value, (list, tuple)):
            return type(value)(_exponent_number(v) for v in value)
        return _exponent_number(value)


_EXPONENT = re.compile(r"[-+]?(?:\d[\d_]*\.?[\d_]*|\.\d[\d_]*)[eE][-+]?\d+")


def _exponent_number(value):
    """A number written with an exponent (1e6, 2.5e5) as the float it is: YAML 1.1 reads one without a dot and a signed
    exponent as text, which pydantic refused for an integer field ("unable to parse string as an integer")."""
    if isinstance(value, str) and _EXPONENT.fullmatch(value.strip()):
        return float(value.strip().replace("_", ""))
    return value


class TeacherConfig(_Section):
    # A hub id ("EleutherAI/pythia-160m") or a local directory with a saved GPTNeoXForCausalLM.
    # When empty, a miniature `flavor` is pretrained on the spot on the training data (demo, tests).
    name_or_path: str | None = None
    flavor: str = "pythia-micro"
    dtype: Literal["float32", "bfloat16"] = "float32"
    # on-the-spot pretraining of a miniature teacher
    pretrain_steps: int = Field(600, ge=0)
    pretrain_seconds: float = Field(80.0, gt=0)  # training-loop limit; the final validation adds a few seconds
    pretrain_lr: float = Field(3e-3, gt=0, allow_inf_nan=False)
    pretrain_batch_size: int = Field(8, gt=0)


class TokenizerConfig(_Section):
    # A Hugging Face tokenizer name or path; empty = byte-level BPE trained on the data and cached.
    name_or_path: str | None = None
    vocab_size: int = Field(2048, ge=260)


class DataConfig(_Section):
    source: Literal["embedded", "hf", "files"] = "embedded"
    include_site_packages: bool = False  # embedded: also the installed packages' Python sources
    dataset: str | None = None  # hf: dataset name
    dataset_config: str | None = None
    split: str = "train"
    text_field: str = "text"
    paths: list[str] = Field(default_factory=list)  # files: .txt / .jsonl / .json / .parquet files, globs or folders (searched recursively); empty documents are skipped
    seq_len: int = Field(256, gt=1)
    val_fraction: float = Field(0.05, gt=0, lt=1)
    sequences_per_shard: int = Field(64, gt=0)
    max_documents: int | None = Field(None, gt=0)
    # stop tokenising the train split after this many tokens (whole documents; validation gets the proportional
    # share): a corpus larger than the run's budget is read only as far as needed. None = all of it
    max_tokens: int | None = Field(None, gt=0)
    # hf: read the dataset from the hub as it is tokenised instead of downloading all of it first (with max_tokens:
    # only the documents the run needs); the tokenised stream is cached either way
    streaming: bool = False
    # hf: the dataset's revision on the hub, a commit sha (or a tag): pins the data (part of the stream's key, so a
    # streamed or resumed preparation reads that version only; a branch name would move); None: the hub's current one
    revision: str | None = None
    cache_dir: str = ".cache/hmscale"  # tokenizer and tokenised corpora

    @field_validator("revision", mode="before")
    @classmethod
    def _revision_text(cls, v):  # an all-digit short sha arrives from YAML / -s as a number; a tag like 1.10 as 1.1
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return v
        if isinstance(v, float):
            raise ValueError(f"data.revision: {v} was read as a number; quote it (data.revision='\"1.10\"' on the "
                             "command line, \"1.10\" in YAML)")
        return str(v)

    # the settings each data.source reads (`unused_settings` notes another source's: data.paths without
    # data.source=files trained on the embedded stdlib corpus, without a word)
    SOURCE_FIELDS: typing.ClassVar[dict] = {"paths": ("files",), "dataset": ("hf",), "dataset_config": ("hf",),
                                            "split": ("hf",), "include_site_packages": ("embedded",),
                                            "text_field": ("files", "hf")}

    def unread_settings(self) -> list[str]:
        """One line per data setting given a value that ``source`` does not read (another source's)."""
        out = []
        for name, sources in self.SOURCE_FIELDS.items():
            value, default = getattr(self, name), type(self).model_fields[name].get_default(call_default_factory=True)
            if self.source not in sources and value != default:
                out.append(f"data.{name}={value!r} has no effect: data.source={self.source} reads other data (it is "
                           f"read by data.source={' or '.join(sources)}); set data.source={sources[0]}, or remove "
                           f"the data.{name} setting")
        return out

    @model_validator(mode="after")
    def _check_source(self):
        if self.source == "hf" and not self.dataset:
            raise ValueError("data.dataset: set a Hugging Face dataset name when data.source=hf")
        if self.revision and self.source != "hf":
            raise ValueError(f"data.revision: pins a Hugging Face dataset; data.source is {self.source!r} (remove it)")
        if self.streaming and self.source != "hf":
            raise ValueError(f"data.streaming: reads a Hugging Face dataset from the hub; data.source is {self.source!r} "
                             "(set streaming=false, or source=hf)")
        if self.source == "files":
            if not self.paths:
                raise ValueError("data.paths: list at least one file when data.source=files")
            for p in self.paths:
                problem = data_path_problem(p)
                if problem:
                    raise ValueError(problem)
        return self


# what data.source=files reads: each file suffix and the `datasets` builder that reads it (FileSource.BUILDERS)
DATA_FILE_BUILDERS = {".txt": "text", ".text": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
DATA_FILE_SUFFIXES = tuple(DATA_FILE_BUILDERS)
_SUFFIXES_TEXT = ", ".join(DATA_FILE_SUFFIXES[:-1]) + f" or {DATA_FILE_SUFFIXES[-1]}"


def expand_data_path(p: str) -> list[str]:
    """What one `data.paths` entry names: the path itself where it exists (a name holding glob characters, as
    `shard[1].jsonl`, is that file, not a pattern that misses it), else the glob's matches, sorted (`**` spans
    folders, as a shell's globstar); [] when nothing is there."""
    path = os.path.expanduser(p)
    if os.path.lexists(path):
        return [path]
    import glob

    return sorted(glob.glob(path, recursive=True))


def data_folder_files(folder: str):
    """The files data.source=files reads under a folder (recursively; hidden entries skipped), unsorted."""
    root = Path(folder)
    for f in root.rglob("*"):
        hidden = any(part.startswith(".") for part in f.relative_to(root).parts)
        if f.suffix.lower() in DATA_FILE_SUFFIXES and not hidden and f.is_file():
            yield str(f)


def unsupported_data_file(path: str) -> str | None:
    """The one-line refusal of a file data.source=files cannot read (by its extension), else None."""
    if Path(path).suffix.lower() in DATA_FILE_SUFFIXES:
        return None
    return f"data.paths: {path!r} has an unsupported extension; use {_SUFFIXES_TEXT}"


def data_path_problem(p: str) -> str | None:
    """Why a `data.paths` entry gives no file to read, in one line (what `hmscale prepare` would stop on, said by
    `hmscale check` too), else None. Cheap: a folder is searched until its first readable file."""
    hits = expand_data_path(p)
    root = _INPUTS_ROOT.get()
    if not hits and root and not os.path.isabs(os.path.expanduser(p)):  # `hmscale eval RUN_DIR` from another folder:
        hits = expand_data_path(os.path.join(root, p))  # where the run read it (as `_local_dir`, a teacher folder)
    if not hits:
        return f"data.paths: {p!r} does not exist; fix the path or remove it"
    found = False
    for h in hits:
        if os.path.isdir(h):
            found = found or next(data_folder_files(h), None) is not None
        elif os.path.isfile(h):
            problem = unsupported_data_file(h)
            if problem:
                return problem
            found = True
    if not found:
        return f"data.paths: {p!r} holds no {_SUFFIXES_TEXT} file; fix the path or remove it"
    return None


class CaptureConfig(_Section):
    layers: list[int] | Literal["all"] = "all"
    tensors: list[Literal["attn_input", "attn_output"]] = Field(default_factory=lambda: ["attn_input", "attn_output"])
    dtype: Literal["bfloat16", "float32", "fp8_e4m3"] = "bfloat16"
    token_fraction: float = Field(1.0, gt=0, le=1)  # fraction of tokens whose per-layer tensors are kept
    topk: int = Field(0, ge=0)  # teacher top-k log-probs for a KD term (0 = none)
    topk_dtype: Literal["float16", "bfloat16"] = "float16"
    seed: int = Field(0, ge=0)  # seeds the deterministic subset of positions kept when token_fraction < 1 (numpy's: >= 0)


class CacheConfig(_Section):
    enabled: bool = True  # False: stage 1 runs online from the live teacher
    root: str = ".cache/hmscale/teacher"
    capture: CaptureConfig = Field(default_factory=CaptureConfig)
    workers: int = Field(2, gt=0)
    allow_exceed_disk: bool = False
    engine: Literal["local", "ray"] | None = None  # None = parallel.engine
    batch_size: int = Field(8, gt=0)  # sequences per teacher forward
    # cache the plan's first shards covering this many tokens (hmscale.data.plan.shards_for_tokens); None = the budget's stage-1 tokens (all budget tokens when capture.topk > 0)
    max_tokens: int | None = Field(None, gt=0)
    max_retries: int = Field(3, ge=0)  # per shard, and worker restarts per run (ray engine)


class BudgetConfig(_Section):
    total_tokens: int = Field(400_000, gt=0)
    # fraction of total_tokens for stage 1 and stage 2 (the paper's best is 10/90)
    split: tuple[float, float] = (0.1, 0.9)

    @model_validator(mode="after")
    def _check_split(self):
        if not all(0 <= f <= 1 for f in self.split) or abs(sum(self.split) - 1.0) > 1e-6:  # (NaN fails the first)
            raise ValueError(f"budget.split: {list(self.split)} must be two non-negative fractions summing to 1, e.g. [0.1, 0.9]")
        return self

    @property
    def stage1_tokens(self) -> int:
        return int(round(self.total_tokens * self.split[0]))

    @property
    def stage2_tokens(self) -> int:
        return int(round(self.total_tokens * self.split[1]))


class Stage1Config(_Section):
    feature_dim: int | None = Field(None, gt=0)  # F; None = head_dim
    lr: float = Field(1e-2, gt=0, allow_inf_nan=False)
    micro_batch_size: int = Field(8, gt=0)
    warmup_steps: int = Field(10, ge=0)
    source: Literal["cache", "online"] = "cache"
    steps: int | None = Field(None, gt=0)  # optimizer steps; None = from budget.stage1_tokens
    layer_parallel: bool = False  # spread layers over workers (each trains its own layers' phi or mixers)
    # passes over the stage's token share (budget.stage1_tokens): stage 1 is layer-local and cheap, and
    # one pass leaves phi far from converged at small budgets; the same rows are revisited, no new tokens
    epochs: int = Field(1, ge=1)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)  # cosine decay floor, a fraction of lr
    # what stage 1 aligns with each layer's softmax attention output: "attention" = the Hedgehog linear
    # attention (the paper's; only the feature maps train); "mixer" = the whole HedgeMamba mixer of stage 2
    # (feature maps plus the conv, dt/A/D and gate of stage2.components), layer-local all the same
    transfer: Literal["attention", "mixer"] = "attention"
    new_params_lr_scale: float = Field(0.2, gt=0, allow_inf_nan=False)  # transfer=mixer: lr multiplier of the conv, dt/A/D and gate

    @model_validator(mode="after")
    def _check_epochs(self):
        if self.epochs > 1 and self.steps:
            raise ValueError(f"stage1.epochs: {self.epochs} passes and stage1.steps={self.steps} both set the "
                             "step count; set one of them (epochs=1, or steps=null)")
        return self


class ComponentsConfig(_Section):
    """HedgeMamba components, switchable for the paper's ablations."""

    gate: bool = True
    conv: bool = True
    ssm: bool = True  # learnable decay / dt
    normalize: bool = True
    conv_width: int = Field(4, ge=1)


def lora_target_names(components: ComponentsConfig) -> list[str]:
    """The linear layers of HedgeMamba (``hmscale.models.lora.lora_targets_available``) that ``stage2.lora_targets``
    may name, for these components: the gate's ``z_proj`` and the SSM's ``dt_proj`` exist only when switched on."""
    names = {"in_proj", "out_proj", "dense_h_to_4h", "dense_4h_to_h", "lm_head"}
    names |= {"z_proj"} if components.gate else set()
    names |= {"dt_proj"} if components.ssm else set()
    return sorted(names)


class Stage2Config(_Section):
    lr: float = Field(1e-3, gt=0, allow_inf_nan=False)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    warmup_steps: int = Field(20, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    micro_batch_size: int = Field(8, gt=0)
    grad_accum: int = Field(1, gt=0)
    grad_clip: float = Field(1.0, ge=0)  # max global gradient norm; 0 = no clipping (as DeepSpeed's gradient_clipping)
    kd_weight: float = Field(0.0, ge=0)  # weight of the KD term (teacher log-probs, see kd_source)
    kd_temperature: float = Field(1.0, gt=0)
    # where the KD targets come from: "cache" = the cached top-k log-probs (cache.capture.topk > 0);
    # "online" = the live teacher's full-vocabulary logits, computed next to each batch (KL to the teacher)
    kd_source: Literal["cache", "online"] = "cache"
    ce_weight: float = Field(1.0, ge=0)  # weight of next-token cross-entropy (0: KD only)
    # weight of a hidden-state alignment term with the live teacher (intermediate residual streams, relative MSE)
    hidden_weight: float = Field(0.0, ge=0)
    # which weights stage 2 trains (the input embeddings never): "all", or "mixers" = only the sequence
    # mixers (what replaced attention); the MLPs, LayerNorms and LM head stay the teacher's
    trainable: Literal["all", "mixers"] = "all"
    # lr multipliers (x stage2.lr) for the parts that are not the teacher's own weights: the recurrent
    # parts HedgeMamba adds at identity (gate z_proj, conv, dt_proj, A, D) and the stage-1 feature maps
    new_params_lr_scale: float = Field(1.0, gt=0, allow_inf_nan=False)
    feature_map_lr_scale: float = Field(1.0, gt=0, allow_inf_nan=False)
    eval_every: int = Field(50, gt=0)
    steps: int | None = Field(None, gt=0)  # optimizer steps; None = from budget.stage2_tokens
    # passes over the stage's token share (budget.stage2_tokens): the rows a one-pass run reads, revisited
    # (more compute, no new tokens: for a fixed token budget such as the fidelity benchmark's 3 %)
    epochs: int = Field(1, ge=1)
    components: ComponentsConfig = Field(default_factory=ComponentsConfig)
    # LoRA, as LoLCATs fine-tunes a linearised model: 0 = off (every weight but the embeddings trains); r > 0 wraps
    # the linear layers named in lora_targets (last name component) with rank-r adapters scaled by lora_alpha / r
    # and freezes every teacher weight; HedgeMamba's added parts and the feature maps still train in full. The
    # exported model has the adapters folded in (a plain HedgeMamba)
    lora_rank: int = Field(0, ge=0)
    lora_alpha: float = Field(16.0, gt=0)
    lora_targets: list[str] = Field(default_factory=lambda: ["in_proj", "out_proj"])

    @model_validator(mode="after")
    def _check_loss(self):
        if self.ce_weight == 0 and self.kd_weight == 0 and self.hidden_weight == 0:
            raise ValueError("stage2.ce_weight: 0 with stage2.kd_weight=0 and stage2.hidden_weight=0 leaves no loss; set "
                             "ce_weight > 0, kd_weight > 0 or hidden_weight > 0")
        if self.lora_rank and self.trainable != "all":
            raise ValueError(f"stage2.lora_rank: LoRA chooses what trains itself; set stage2.trainable=all (got "
                             f"{self.trainable!r}) or lora_rank=0")
        # a setting its switch leaves unused (as parallel.compile_mode without compile): the user expects an effect;
        # compared with the default, which every resolved config.yaml holds, not with what was written
        if not self.lora_rank and self.lora_alpha != Stage2Config.model_fields["lora_alpha"].default:
            raise ValueError(f"stage2.lora_alpha: {self.lora_alpha} scales LoRA adapters, but stage2.lora_rank=0 adds "
                             "none; set stage2.lora_rank > 0 (e.g. 8) or remove the lora_alpha setting")
        if not self.lora_rank and self.lora_targets != Stage2Config.model_fields["lora_targets"].default_factory():
            raise ValueError(f"stage2.lora_targets: {self.lora_targets} names layers to adapt, but stage2.lora_rank=0 "
                             "adds no adapters; set stage2.lora_rank > 0 (e.g. 8) or remove the lora_targets setting")
        comp = self.components
        if not comp.conv and comp.conv_width != ComponentsConfig.model_fields["conv_width"].default:
            raise ValueError(f"stage2.components.conv_width: {comp.conv_width} sets the width of the conv, which "
                             "stage2.components.conv=false leaves out; set conv=true or remove the conv_width setting")
        if self.lora_rank and not self.lora_targets:
            raise ValueError("stage2.lora_targets: empty; name the linear layers to adapt (e.g. [in_proj, out_proj])")
        if self.lora_rank:  # now, not when stage 2 starts (after stage 1, whose run these settings also name)
            have = lora_target_names(self.components)
            unknown = [t for t in self.lora_targets if t not in have]
            if unknown:
                raise ValueError(f"stage2.lora_targets: {unknown} match no linear layer of HedgeMamba with these "
                                 f"stage2.components; choose from {', '.join(have)}")
        if self.epochs > 1 and self.steps:
            raise ValueError(f"stage2.epochs: {self.epochs} passes and stage2.steps={self.steps} both set the "
                             "step count; set one of them (epochs=1, or steps=null)")
        return self


class ParallelConfig(_Section):
    # ray: Ray actors / Ray Train (embedded cluster when no address); local: this process, or num_workers
    # spawned processes on this machine (one per GPU with use_gpu; hmscale.train.launch)
    engine: Literal["local", "ray"] = "ray"
    ray_address: str | None = None  # None = embedded single-node cluster
    num_workers: int = Field(1, gt=0)  # student workers (= dp * tp)
    tp: int = Field(1, gt=0)
    zero_stage: Literal[0, 1, 2, 3] = 2
    ds_config: str | None = None  # a ds_configs/*.json; None = ds_configs/zero{stage}.json (ZeRO 0: zero1.json at stage 0)
    use_gpu: bool = False
    bf16: bool = False
    compile: bool = False  # torch.compile each student block in stage 2 (GPU; the first steps pay the compile)
    # torch.compile's mode for those blocks; reduce-overhead replays each block's graphs as CUDA graphs
    # (torch's CUDA-graph trees; GPU, tp=1, ZeRO 0-2; verified in stage 2 on an H200: README, GPU settings)
    compile_mode: Literal["default", "reduce-overhead", "max-autotune-no-cudagraphs"] = "default"
    # which Adam steps the ZeRO partitions: auto = torch's fused AdamW on GPU (unless the optimizer is offloaded),
    # foreach = torch's Adam as DeepSpeed builds it, deepspeed = DeepSpeed's own (hmscale.train.engine.resolve_adam)
    adam: Literal["auto", "fused", "foreach", "deepspeed"] = "auto"
    cuda_graphs: bool = False  # capture each student block's forward + backward as CUDA graphs in stage 2 (GPU)
    checkpoint_every: int = Field(100, gt=0)
    keep_checkpoints: int = Field(2, gt=0)  # newest complete checkpoints kept per stage
    max_failures: int = Field(2, ge=0)  # Ray Train restarts after a worker dies

    @property
    def dp(self) -> int:
        return self.num_workers // self.tp

    @property
    def zero(self) -> int:
        """The ZeRO stage DeepSpeed runs: a `ds_config` file's own stage where it sets one, else `zero_stage`."""
        stage = ds_config_zero_stage(self.ds_config) if self.ds_config else None
        return self.zero_stage if stage is None else stage

    @model_validator(mode="after")
    def _check(self):
        if self.num_workers % self.tp:
            raise ValueError(f"parallel.tp: {self.tp} must divide parallel.num_workers={self.num_workers}")
        zero = self.zero  # (a missing or malformed ds_config stops here, in one line)
        via = f" (parallel.ds_config {Path(self.ds_config).name} sets ZeRO {zero})" if zero != self.zero_stage else ""
        if self.tp > 1 and zero == 3:
            raise ValueError(f"parallel.zero_stage: tensor parallelism supports ZeRO 0, 1 or 2{via}; set zero_stage<=2 "
                             "(and a ds_config of stage <= 2) or tp=1")
        if self.cuda_graphs and (not self.use_gpu or self.compile or self.tp > 1 or zero != 0):
            # ZeRO 1/2: measured 2026-11-29 on an H200, the backward capture is invalidated once DeepSpeed's
            # ZeRO optimizer is built (ZeRO-0 and no DeepSpeed capture fine); ZeRO-3 gathers parameters in hooks
            raise ValueError("parallel.cuda_graphs: needs parallel.use_gpu=true and parallel.zero_stage=0, and neither "
                             "parallel.compile nor parallel.tp > 1 (collectives in graphs are not verified); "
                             "set cuda_graphs=false otherwise")
        if self.compile_mode != "default" and not self.compile:
            raise ValueError(f"parallel.compile_mode={self.compile_mode}: needs parallel.compile=true")
        if self.compile_mode == "reduce-overhead" and (not self.use_gpu or self.tp > 1 or zero == 3):
            # CUDA graphs need a GPU; collectives inside the graphs (tp) and ZeRO-3's parameter gathering in
            # forward hooks are not verified with them
            raise ValueError("parallel.compile_mode=reduce-overhead: needs parallel.use_gpu=true, parallel.tp=1 and "
                             f"parallel.zero_stage<=2{via}; set compile_mode=default otherwise")
        return self


DS_CONFIG_DIR = Path(__file__).resolve().parents[1] / "ds_configs"


def resolve_ds_config(path: str) -> Path | None:
    """A `parallel.ds_config` as given (relative to this directory), else relative to the repository (so
    `ds_configs/zero3.json` works from anywhere); None when neither exists."""
    p = Path(path).expanduser()
    if p.exists():
        return p
    if not p.is_absolute() and (DS_CONFIG_DIR.parent / p).exists():
        return DS_CONFIG_DIR.parent / p
    return None


def ds_config_zero_stage(path: str) -> int | None:
    """The ZeRO stage a DeepSpeed JSON sets (`zero_optimization.stage`), or None where it leaves it to
    `parallel.zero_stage` (no stage, or "auto"). A file that is not JSON is a one-line ValueError."""
    found = resolve_ds_config(path)
    if found is None:
        raise ValueError(f"parallel.ds_config: {path!r} does not exist; point it at a ds_configs/*.json")
    try:
        conf = json.loads(found.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"parallel.ds_config: {str(found)!r} is not valid JSON ({err})") from None
    stage = (conf.get("zero_optimization") or {}).get("stage") if isinstance(conf, dict) else None
    return stage if isinstance(stage, int) and not isinstance(stage, bool) else None


class EvalConfig(_Section):
    max_sequences: int = Field(64, gt=0)  # validation sequences for perplexity
    tasks: list[str] = Field(default_factory=list)  # lm-eval-harness tasks
    generate_tokens: int = Field(32, ge=0)  # greedy tokens each model writes after a held-out prompt (report.md); 0: none
    # positions scored per row by the long-context evaluation (perplexity per position bucket, e.g. 8 x data.seq_len);
    # None: skipped. Rows: validation documents at least this long (at most max_sequences), else the concatenated split
    context_length: int | None = Field(None, ge=2)


class RunConfig(_Section):
    teacher: TeacherConfig = Field(default_factory=TeacherConfig)
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    budget: BudgetConfig = Field(default_factory=BudgetConfig)
    stage1: Stage1Config = Field(default_factory=Stage1Config)
    stage2: Stage2Config = Field(default_factory=Stage2Config)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    output_dir: str = "runs/demo"
    # numpy's generators take no negative seed, torch's none of 64 bits or more (stage 2 seeds with seed + 2)
    seed: int = Field(0, ge=0, lt=2**63)

    @model_validator(mode="after")
    def _cross(self):
        if self.teacher.name_or_path is None and self.teacher.flavor not in FLAVORS:
            raise ValueError(f"teacher.flavor: unknown flavour {self.teacher.flavor!r}; choose one of {', '.join(FLAVORS)}")
        if self.teacher.name_or_path is None:
            flavor = get_flavor(self.teacher.flavor)
            if not flavor.miniature:
                raise ValueError(
                    f"teacher.flavor: {flavor.name} is a published size; set teacher.name_or_path={flavor.hub_id} to load it"
                )
            heads, n_layers = flavor.n_heads, flavor.n_layers
            if self.data.seq_len > flavor.max_positions:  # (pretraining it on such rows fails after the data work)
                raise ValueError(f"data.seq_len: {self.data.seq_len} exceeds the {flavor.name} teacher's "
                                 f"{flavor.max_positions} positions; set data.seq_len<={flavor.max_positions} or a "
                                 "larger teacher.flavor")
        else:
            heads, n_layers = _shape_of(self.teacher.name_or_path)
        layers = self.cache.capture.layers
        bad = [i for i in layers if not 0 <= i < n_layers] if n_layers and layers != "all" else []
        if bad:
            raise ValueError(f"cache.capture.layers: {bad} out of range for the teacher's {n_layers} layers; use "
                             f"0..{n_layers - 1} or 'all'")
        if self.stage1.layer_parallel and n_layers and self.parallel.num_workers > n_layers:  # (else stage 1 stops)
            raise ValueError(f"stage1.layer_parallel: {self.parallel.num_workers} workers for {n_layers} layers; use at "
                             f"most {n_layers} workers (parallel.num_workers) or layer_parallel=false")
        if self.teacher.name_or_path:  # a published Pythia's vocabulary; a miniature's is its BPE's
            vocab = next((f.vocab_size for f in FLAVORS.values() if f.hub_id == self.teacher.name_or_path), None)
        else:
            vocab = None if self.tokenizer.name_or_path else self.tokenizer.vocab_size
        if vocab and self.cache.capture.topk > vocab:
            raise ValueError(f"cache.capture.topk: {self.cache.capture.topk} exceeds the {vocab}-token vocabulary; set "
                             f"cache.capture.topk<={vocab} (e.g. 32)")
        s2 = self.stage2
        if s2.kd_weight > 0 and s2.kd_source == "cache" and self.cache.capture.topk == 0:
            raise ValueError(f"stage2.kd_weight: {s2.kd_weight} with stage2.kd_source=cache needs the teacher's top-k "
                             "in the cache; set cache.capture.topk (e.g. 32), or stage2.kd_source=online, or "
                             "stage2.kd_weight=0")
        if s2.kd_weight > 0 and s2.kd_source == "cache" and not self.cache.enabled:
            raise ValueError("cache.enabled: false, but stage2.kd_weight > 0 with kd_source=cache reads the teacher's "
                             "top-k from the cache; enable the cache, or set stage2.kd_source=online")
        if self.stage2.lora_rank and self.parallel.tp > 1:
            raise ValueError("stage2.lora_rank: LoRA runs with ZeRO data parallelism only; set parallel.tp=1 or "
                             "stage2.lora_rank=0")
        if heads is not None and heads % self.parallel.tp:
            raise ValueError(f"parallel.tp: {self.parallel.tp} does not divide the teacher's {heads} heads; pick a divisor of {heads}")
        width = _mlp_width_of(self.teacher.name_or_path) if self.teacher.name_or_path and self.parallel.tp > 1 else None
        if width is not None and width % self.parallel.tp:  # (else refused by the workers, after stage 1)
            raise ValueError(f"parallel.tp: {self.parallel.tp} does not divide the teacher's MLP width {width}; pick a "
                             f"divisor of both {heads} and {width}")
        if not self.cache.enabled and self.stage1.source == "cache":
            self.stage1.source = "online"  # what cache.enabled=false means (stage 1 built the cache itself otherwise)
        if self.teacher.name_or_path and self.tokenizer.name_or_path is None:
            # a pretrained teacher needs its own tokenizer
            self.tokenizer.name_or_path = self.teacher.name_or_path
        return self

    def with_absolute_paths(self, base: str | os.PathLike | None = None) -> "RunConfig":
        """A copy whose directories are absolute (resolved against ``base``, by default this process's working
        directory), for workers that run elsewhere (Ray Train changes their working directory)."""
        absolute = lambda p: str((Path(base or ".") / Path(p).expanduser()).resolve())  # noqa: E731
        cfg = self.model_copy(deep=True)
        cfg.output_dir = absolute(cfg.output_dir)
        cfg.data.cache_dir = absolute(cfg.data.cache_dir)
        cfg.cache.root = absolute(cfg.cache.root)
        if cfg.parallel.ds_config:  # (where it is found: here, else in the repository's ds_configs/)
            cfg.parallel.ds_config = absolute(resolve_ds_config(cfg.parallel.ds_config) or cfg.parallel.ds_config)
        return cfg

    def with_absolute_inputs(self, base: str | os.PathLike | None = None) -> "RunConfig":
        """`with_absolute_paths`, and the inputs read by path made absolute too: `data.paths` (a glob stays a glob) and
        a local teacher or tokenizer directory (a hub id stays). For Ray Train's workers, which rebuild the config in
        another working directory; the run's identity (config.yaml) keeps those inputs as given."""
        root = Path(os.path.abspath(base or "."))
        cfg = self.with_absolute_paths(root)
        cfg.data.paths = [os.path.abspath(root / os.path.expanduser(p)) for p in cfg.data.paths]
        for section in (cfg.teacher, cfg.tokenizer):
            p = section.name_or_path
            if p and looks_like_path(p, root):
                section.name_or_path = os.path.abspath(root / os.path.expanduser(p))
        return cfg

    def hash(self, *sections: str) -> str:
        """A stable short hash of the given sections (all when none)."""
        dump = self.model_dump(mode="json")
        if sections:
            dump = {s: dump[s] for s in sections}
        return hashlib.sha256(json.dumps(dump, sort_keys=True).encode()).hexdigest()[:16]


def unused_settings(cfg: RunConfig) -> list[str]:
    """One line per setting given a value that this config never uses (a warning, not a refusal: ablations override
    them wholesale): another data.source's data settings, the KD temperature without a KD term, a teacher's
    pretraining settings with a teacher loaded from a path or the hub."""
    out = cfg.data.unread_settings()
    s2 = cfg.stage2
    if s2.kd_weight == 0 and s2.kd_temperature != type(s2).model_fields["kd_temperature"].default:
        out.append(f"stage2.kd_temperature={s2.kd_temperature:g} has no effect with stage2.kd_weight=0 (no KD term); "
                   "set stage2.kd_weight > 0 to distill the teacher's log-probs")
    t = cfg.teacher
    if t.name_or_path:
        fields = type(t).model_fields
        given = [f"teacher.{k}" for k in fields if k.startswith("pretrain_") and getattr(t, k) != fields[k].default]
        if given:
            out.append(f"{', '.join(given)} {'has' if len(given) == 1 else 'have'} no effect with teacher.name_or_path "
                       f"set (only a teacher.flavor miniature is pretrained here)")
    return out


def stage1_cache_problem(cfg: RunConfig) -> str | None:
    """Why stage 1 cannot train from the teacher cache this config captures (every layer's attn_input), in one line;
    None when it can or reads no cache. (`hmscale cache` alone may capture less: checked where stage 1 runs.)"""
    cap = cfg.cache.capture
    if cfg.stage1.source != "cache" or not cfg.cache.enabled:
        return None
    if "attn_input" not in cap.tensors:
        return (f"cache.capture.tensors: {list(cap.tensors)} lacks attn_input, which stage 1 trains from; add it "
                "(e.g. [attn_input, attn_output]) or set stage1.source=online")
    t = cfg.teacher
    n_layers = _shape_of(t.name_or_path)[1] if t.name_or_path else get_flavor(t.flavor).n_layers
    if cap.layers != "all" and n_layers and set(cap.layers) != set(range(n_layers)):
        return (f"cache.capture.layers: {cap.layers} leaves out layers that stage 1 trains from the cache; set "
                "cache.capture.layers=all or stage1.source=online")
    return None


def looks_like_path(name_or_path: str, base: str | os.PathLike | None = None) -> bool:
    """A local path rather than a hub id ("org/name"): what the loaders read as a local directory (relative to
    ``base``, by default this process's working directory)."""
    s = str(name_or_path)
    return s.startswith((".", "/", "~")) or s.count("/") > 1 or (Path(base or ".") / s).exists()


_INPUTS_ROOT: contextvars.ContextVar = contextvars.ContextVar("hmscale_inputs_root", default=None)


@contextmanager
def inputs_root(base: str | os.PathLike | None):
    """Inside the block a relative local teacher folder that is not found from the working directory is looked for
    under ``base`` by the config's checks: `hmscale eval RUN_DIR` from another folder validates the run's config.yaml,
    whose inputs are relative to where the run was made (results.json's inputs_dir)."""
    token = _INPUTS_ROOT.set(str(base) if base else None)
    try:
        yield
    finally:
        _INPUTS_ROOT.reset(token)


def _local_dir(name_or_path: str) -> Path:
    path = Path(name_or_path).expanduser()
    root = _INPUTS_ROOT.get()
    if root and not path.is_absolute() and not path.exists() and (Path(root) / path).exists():
        return Path(root) / path
    return path


def _shape_of(name_or_path: str) -> tuple[int | None, int | None]:
    """(attention heads, layers) of a teacher, from the flavour registry or a local config; (None, None) for a hub id
    this process cannot see yet."""
    for f in FLAVORS.values():
        if f.hub_id == name_or_path:
            return f.n_heads, f.n_layers
    cfg = _local_dir(name_or_path) / "config.json"
    if cfg.exists():
        tree = json.loads(cfg.read_text())
        return tree.get("num_attention_heads"), tree.get("num_hidden_layers")
    if _local_dir(name_or_path).exists() or name_or_path.startswith((".", "/", "~")):
        raise ValueError(f"teacher.name_or_path: {name_or_path!r} has no config.json; point it at a saved GPTNeoX model or a hub id")
    return None, None


def _mlp_width_of(name_or_path: str) -> int | None:
    """A local teacher's MLP width (config.json's intermediate_size); None for a hub id or a published flavour (4 x
    d_model, which every tp that divides the heads divides)."""
    cfg = _local_dir(name_or_path) / "config.json"
    if not cfg.exists():
        return None
    width = json.loads(cfg.read_text()).get("intermediate_size")
    return width if isinstance(width, int) and not isinstance(width, bool) else None


# --------------------------------------------------------------------------- loading


class _Loader(yaml.SafeLoader):
    """yaml.safe_load's reading, except a number written with a leading zero (0123): YAML 1.1 reads it as octal (83),
    which no setting means; it stays the text it is (data.revision=0123456, an all-digit short sha; a number field
    reads it as decimal)."""

    def construct_yaml_int(self, node):
        text = self.construct_scalar(node)
        return text if re.fullmatch(r"[-+]?0[0-7_]+", text) else super().construct_yaml_int(node)

    def construct_mapping(self, node, deep=False):
        """A mapping, refusing a key written twice in it: YAML keeps the last one, so a second ``stage2:`` section
        replaced the first whole and its settings were dropped without a word (``<<`` merge keys may be overridden)."""
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.get(key)
                except TypeError:  # an unhashable key: the base class says so
                    continue
                seen[key] = key_node.start_mark.line + 1
                if first is not None:
                    where = f"line {first}" if first == seen[key] else f"lines {first} and {seen[key]}"
                    raise DuplicateKeyError(f"{key!r} is set twice in one mapping ({where}): the second would "
                                            "replace the first whole; keep one")
        return super().construct_mapping(node, deep)


class DuplicateKeyError(yaml.YAMLError):
    """A mapping key written twice (its message is the one line to show)."""


_Loader.add_constructor("tag:yaml.org,2002:int", _Loader.construct_yaml_int)


def parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"override {text!r}: write overrides as section.field=value, e.g. stage2.lr=3e-4")
    key, raw = text.split("=", 1)
    path = key.strip().split(".")
    if not all(path):
        raise ConfigError(f"override {text!r}: the key before '=' must be section.field, e.g. stage2.lr=3e-4")
    try:
        return path, yaml.load(raw, Loader=_Loader) if raw.strip() else None
    except DuplicateKeyError as err:
        raise ConfigError(f"override {text!r}: {err}") from None
    except yaml.YAMLError:
        raise ConfigError(f"override {text!r}: the value is not valid YAML; quote it, e.g. -s 'data.dataset=\"x:y\"'") from None


def apply_overrides(tree: dict, overrides: list[str]) -> dict:
    for item in overrides:
        path, value = parse_override(item)
        node = tree
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part} is not a section")
        node[path[-1]] = value
    return tree


def _field_path(loc) -> str:
    """An error location as the config's dotted field path (without pydantic's validator and union-branch tags)."""
    return ".".join(str(p) for p in loc if not str(p).startswith("function-") and "[" not in str(p))


def _format_error(err: ValidationError) -> str:
    errors = err.errors()
    e = errors[0]
    loc = _field_path(e["loc"])
    msg = e["msg"].removeprefix("Value error, ")
    branches = [x["msg"] for x in errors if _field_path(x["loc"]) == loc]
    if len(branches) > 1 and e["type"] != "extra_forbidden":  # a union field: say what each form wants
        msg = ", or ".join(dict.fromkeys(m.removeprefix("Value error, ") for m in branches))
    if e["type"] == "extra_forbidden":
        return f"{loc}: unknown field; remove it or check its spelling (see README, config reference)"
    if msg.split(":")[0].strip() and "." in msg.split(":")[0] and " " not in msg.split(":")[0]:
        return msg  # our own validators already name the field
    got = e.get("input")
    parent, _, index = loc.rpartition(".")
    if e["type"] == "missing" and index.isdigit() and parent:  # a fixed-length list given too few values
        return f"{parent}: too few values, item {index} is missing (got {got!r})"
    kinds = {x["type"] for x in errors if _field_path(x["loc"]) == loc}
    if isinstance(got, (str, int, float)) and kinds & {"list_type", "tuple_type"}:
        # `-s eval.tasks=hellaswag`: one value where a list goes; say how a list is written
        example = "a, b" if "/" in str(got) else str(got)  # (10/90 is no item of budget.split)
        return (f"{loc}: {msg} (got {got!r}); write a list in brackets: -s '{loc}=[{example}]' on the command line, "
                f"[{example}] in YAML")
    if got is None and "input" in e:  # `-s field=` or a YAML key left empty: null
        return f"{loc}: {msg} (got an empty value, null; give one or remove the setting for its default)"
    return f"{loc}: {msg}" + (f" (got {got!r})" if got is not None and not isinstance(got, dict) else "")


def _empty_sections(tree: dict, model: type[BaseModel] | None = None) -> dict:
    """A copy of a config tree in which a section left empty (YAML's null: ``stage2:`` with every field commented
    out) is an empty mapping: it takes its defaults, and overrides go into it. Scalar fields keep their null."""
    model = model or RunConfig
    out = dict(tree)
    for name, field in model.model_fields.items():
        ann = field.annotation
        if name not in out or not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            continue
        if out[name] is None:
            out[name] = {}
        if isinstance(out[name], dict):
            out[name] = _empty_sections(out[name], ann)
    return out


def build_config(tree: dict | None = None, overrides: list[str] | None = None) -> RunConfig:
    tree = apply_overrides(_empty_sections(tree or {}), list(overrides or []))
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_format_error(err)) from None


def read_config_tree(path: str | os.PathLike, overrides: list[str] | None = None) -> dict:
    """The mapping a YAML config file holds (not yet validated), with one-line errors for what is not one."""
    p = Path(path)
    if not p.exists():
        hint = next((f"; an override needs '=': -s {o}={p}" for o in overrides or [] if "=" not in o), "")
        raise ConfigError(f"config file {str(p)!r} does not exist; pass a YAML file (e.g. configs/pythia-410m.yaml), "
                          f"or none for the embedded defaults{hint}")
    if p.is_dir():
        raise ConfigError(f"config file {str(p)!r} is a directory; pass a YAML file (a run directory's is "
                          f"{str(p / 'config.yaml')!r})")
    try:
        tree = yaml.load(p.read_text(encoding="utf-8"), Loader=_Loader) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {str(p)!r} is not valid YAML: {_yaml_problem(err)}") from None
    except (UnicodeDecodeError, OSError) as err:
        raise ConfigError(f"config file {str(p)!r} cannot be read as UTF-8 text: {err}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"config file {str(p)!r}: the top level must be a mapping of sections")
    return _empty_sections(tree)


def _yaml_problem(err: yaml.YAMLError) -> str:
    """What is wrong and where, in one line: the problem and its line and column (the first line of the error is often
    its context alone: "while scanning for the next token", for a tab that indents a line)."""
    problem, mark = getattr(err, "problem", None), getattr(err, "problem_mark", None)
    if not problem:
        return (str(err).strip().splitlines() or [type(err).__name__])[0]
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
    return f"{problem}{where}"


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Read a YAML config (or the embedded defaults when path is None) and apply dotted overrides."""
    tree = read_config_tree(path, overrides) if path is not None else {}
    return build_config(tree, overrides)


def save_resolved(cfg: RunConfig, run_dir: str | os.PathLike) -> Path:
    """Write the resolved config into the run directory, atomically."""
    from hmscale.atomic import atomic_write_text

    # (fsynced, and a failed write, e.g. on a full disk, leaves no temporary: the run's rerun removes what a kill left)
    return atomic_write_text(Path(run_dir) / "config.yaml", yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))


# --------------------------------------------------------------------------- reference


def _type_name(ann) -> str:
    """A field's type as the reference writes it: `int or None`, `"local" or "ray"`, `list[int] or "all"`."""
    import types

    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if ann is type(None):
        return "None"
    if origin is Literal:
        return " or ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args)
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]"
    return getattr(ann, "__name__", None) or str(ann)


def _bounds(field) -> str:
    """A field's numeric bounds (pydantic's gt / ge / lt / le), e.g. `> 0`, `>= 0, <= 1`; empty when it has none."""
    ops = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}
    out = []
    for meta in field.metadata:
        for attr, op in ops.items():
            value = getattr(meta, attr, None)
            if value is not None:
                out.append(f"{op} {'2^63' if value == 2**63 else value}")
    return f"`{', '.join(out)}`" if out else ""


def config_reference() -> str:
    """The config tree as a markdown table (field, type, default, bounds), for the README."""
    rows = ["| field | type | default | bounds |", "| --- | --- | --- | --- |"]

    def walk(model: type[BaseModel], prefix: str):
        for name, field in model.model_fields.items():
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                walk(ann, f"{prefix}{name}.")
                continue
            default = field.get_default(call_default_factory=True)
            rows.append(f"| `{prefix}{name}` | {_type_name(ann)} | `{json.dumps(default)}` | {_bounds(field)} |")

    walk(RunConfig, "")
    return "\n".join(rows)


if __name__ == "__main__":  # python -m hmscale.config  -> the reference table
    print(config_reference())
