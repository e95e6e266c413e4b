"""DeepSpeed engine, schedule, checkpoints and metrics shared by stage 1 and stage 2.

- `init_distributed()`  joins (or creates) the process group: Ray Train's when it exists, else a
  one-process gloo group (NCCL on GPU).
- `ds_config_for(...)`  a ds_configs/*.json filled from the recipe config (micro batch, accumulation,
  lr, clipping, bf16, ZeRO stage); the file supplies everything else (buckets, offload, betas).
- `build_engine(...)`   `deepspeed.initialize` with a warmup + cosine LambdaLR and an optional mpu.
- `Checkpointer`        DeepSpeed save/load with client state (step, data position) under
                        `<stage_dir>/checkpoints/step_XXXXXXXX/` (DeepSpeed tag `state`, plus `meta.json`);
                        keeps the last `keep` good checkpoints; a checkpoint is complete when meta.json exists.
- `MetricsLogger`       JSONL (`metrics.jsonl`) + TensorBoard (`tb/`) + a progress bar, rank 0 only.
- `train_loop(...)`     the optimizer-step loop with accumulation, all-reduced loss, NaN/inf stop,
                        periodic checkpoints, periodic eval, an `on_checkpoint` hook (Ray reports).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import math
import os
import shutil
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from hmscale.atomic import atomic_write_json, atomic_write_text, os_error_line
from hmscale.config import DS_CONFIG_DIR, resolve_ds_config


class TrainingError(RuntimeError):
    """A training failure with a one-line message meant for the user."""


class NonFiniteLoss(TrainingError):
    """The loss became NaN or inf; the run stopped and the last good checkpoint was kept."""


class StorageError(TrainingError):
    """A write failed (a full disk, a read-only directory): one line naming the file and what to free or fix; what
    was written before it is kept, and a rerun into the same output_dir resumes."""


# --------------------------------------------------------------------------- distributed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def device_for(use_gpu: bool) -> torch.device:
    if use_gpu and torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    return torch.device("cpu")


def _deepspeed_accelerator(gpu: bool) -> None:
    """On a host with CUDA, DeepSpeed's accelerator for this engine: a CPU engine (``parallel.use_gpu=false``) gets
    the CPU one, as on a machine without CUDA (DeepSpeed would take CUDA's, move the model to cuda:0 and build its
    buffers there); a GPU engine after one in the same process gets CUDA's back."""
    from deepspeed.accelerator import get_accelerator, set_accelerator

    if gpu and get_accelerator().device_name() == "cpu":
        from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

        set_accelerator(CUDA_Accelerator())
    elif not gpu and get_accelerator().device_name() != "cpu":
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

        set_accelerator(CPU_Accelerator())


_OWN_GROUP = "HMSCALE_SINGLE_PROCESS_GROUP_PORT"  # set beside MASTER_PORT when init_distributed made the group itself


def init_distributed(use_gpu: bool = False) -> tuple[int, int]:
    """Make sure torch.distributed and deepspeed.comm are up; returns (rank, world_size).

    Under Ray Train (or torchrun) the process group already exists / env vars are set; otherwise a
    single-process group is created (gloo on CPU, NCCL on GPU).
    """
    import deepspeed

    backend = "nccl" if (use_gpu and torch.cuda.is_available()) else "gloo"
    if not dist.is_initialized():
        # (the variables a parent process set for its own one-process group are not a group to join: a process it
        # starts, e.g. a Ray head and the jobs it runs, would bind the parent's port, in use)
        inherited = os.environ.get(_OWN_GROUP) is not None and os.environ.get(_OWN_GROUP) == os.environ.get("MASTER_PORT")
        if "RANK" not in os.environ or "MASTER_ADDR" not in os.environ or inherited:
            port = str(free_port())
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_SIZE="1",
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **{_OWN_GROUP: port})
        os.environ.setdefault("LOCAL_RANK", "0")
    elif "LOCAL_RANK" not in os.environ:  # DeepSpeed insists on it; an existing one-node group: rank
        os.environ["LOCAL_RANK"] = str(dist.get_rank() % max(torch.cuda.device_count(), 1) if use_gpu else dist.get_rank())
    if torch.cuda.is_available():
        _deepspeed_accelerator(use_gpu)
        if use_gpu:
            torch.cuda.set_device(device_for(True))
    with _no_shm_inference_op(backend):
        deepspeed.init_distributed(dist_backend=backend, verbose=False)
    if backend == "gloo" and os.environ.get("MASTER_PORT"):
        # DeepSpeed's CPU all-reduce maps one /dev/shm file per rank and never removes them (tens of MB
        # each, held in memory): remove this group's at exit (none are mapped while _no_shm_inference_op applies; a
        # DeepSpeed without build_shm_op, or another caller that built it, still maps them)
        atexit.register(remove_shm_buffers, os.environ.get("MASTER_ADDR", "127.0.0.1"), os.environ["MASTER_PORT"])
    return dist.get_rank(), dist.get_world_size()


@contextlib.contextmanager
def _no_shm_inference_op(backend: str):
    """On gloo, DeepSpeed's communication backend compiles a C++ shared-memory all-reduce when it starts (about a
    minute of g++ on a fresh 2-core machine, the first ``make demo`` / ``make test`` included) and maps a /dev/shm
    buffer per rank; DeepSpeed uses it only for tensor-parallel *inference* (``inference_all_reduce``), never in
    training, whose collectives go through torch.distributed. So it is not built here."""
    import importlib

    comm_torch = importlib.import_module("deepspeed.comm.torch")
    build = getattr(comm_torch, "build_shm_op", None)
    if backend != "gloo" or build is None:
        yield
        return
    comm_torch.build_shm_op = lambda: None
    try:
        yield
    finally:
        comm_torch.build_shm_op = build


def remove_shm_buffers(addr: str, port: str | int) -> int:
    """Unlink DeepSpeed's CPU all-reduce buffers of the process group at addr:port
    (/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>); returns how many went.
    Safe once the group's work is done: a rank still mapping one keeps its memory until it unmaps."""
    n = 0
    for f in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_*"):
        try:
            f.unlink()
            n += 1
        except OSError:
            pass
    return n


def barrier():
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def all_reduce_mean(values: torch.Tensor, group=None) -> torch.Tensor:
    """Mean over ranks of a small fp32 CPU/GPU tensor (a copy)."""
    t = values.detach().clone().float()
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)
        t /= dist.get_world_size(group)
    return t


def all_reduce_sum(values: torch.Tensor, group=None) -> torch.Tensor:
    t = values.detach().clone().float()
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)
    return t


# --------------------------------------------------------------------------- config + schedule


@dataclass
class OptimSpec:
    """The recipe side of a DeepSpeed config (everything the engine fills into the JSON file)."""

    lr: float
    micro_batch_size: int
    grad_accum: int = 1
    warmup_steps: int = 0
    total_steps: int = 1
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    zero_stage: int = 2
    bf16: bool = False
    ds_config: str | None = None  # path; None = ds_configs/zero{stage}.json
    # auto | fused | foreach | deepspeed: which Adam steps the ZeRO partitions (resolve_adam)
    adam: str = "auto"
    stage: str = ""  # "stage1" | "stage2": the config section the warnings name (warmup_note)
    # whether the engine's parameters live on a GPU; None: whenever this host has CUDA. A CPU engine on a GPU host
    # (parallel.use_gpu=false) passes False, so that its Adam and offload settings are a CPU machine's
    on_gpu: bool | None = None

    def gpu(self) -> bool:
        return torch.cuda.is_available() if self.on_gpu is None else bool(self.on_gpu)


def ds_config_path(zero_stage: int, path: str | None = None) -> Path:
    if path:
        found = resolve_ds_config(path)
        if found is None:
            raise TrainingError(f"parallel.ds_config: {path!r} does not exist; point it at a ds_configs/*.json")
        return found
    stage = max(int(zero_stage), 1)  # ZeRO 0 uses the zero1 file with stage set to 0
    return DS_CONFIG_DIR / f"zero{stage}.json"


def ds_config_for(spec: OptimSpec, dp_world: int) -> dict:
    """Read the DeepSpeed JSON and fill in the recipe values (no "auto" anywhere)."""
    path = ds_config_path(spec.zero_stage, spec.ds_config)
    conf = json.loads(path.read_text())
    conf["train_micro_batch_size_per_gpu"] = int(spec.micro_batch_size)
    conf["gradient_accumulation_steps"] = int(spec.grad_accum)
    conf["train_batch_size"] = int(spec.micro_batch_size * spec.grad_accum * dp_world)
    conf["gradient_clipping"] = float(spec.grad_clip)
    conf.setdefault("optimizer", {"type": "AdamW", "params": {}})
    params = conf["optimizer"].setdefault("params", {})
    params["lr"] = float(spec.lr)
    params["weight_decay"] = float(spec.weight_decay)
    adam = resolve_adam(spec, conf)
    if adam == "foreach":
        params["torch_adam"] = True  # DeepSpeed builds torch's Adam (foreach kernels)
    elif adam == "deepspeed":
        params.pop("torch_adam", None)  # DeepSpeed's own: FusedAdam (a JIT build) on GPU, CPU Adam when offloading
    conf.pop("scheduler", None)  # the schedule comes from the recipe (LambdaLR below)
    conf["bf16"] = {**(conf.get("bf16") or {}), "enabled": bool(spec.bf16)}  # the file's other bf16 keys kept
    conf.pop("fp16", None)
    zero = conf.setdefault("zero_optimization", {})
    if spec.ds_config is None or type(zero.get("stage")) is not int:
        zero["stage"] = int(spec.zero_stage)  # (a file's own stage is kept; none, or "auto": parallel.zero_stage)
    if not spec.gpu():
        for k in ("offload_optimizer", "offload_param"):
            if k in zero:
                zero[k]["pin_memory"] = False
    auto = _auto_fields(conf)
    if auto:
        # (a nested one, e.g. an HF Trainer config's optimizer.params.eps or zero_optimization.reduce_bucket_size, went
        # through to DeepSpeed or torch: a TypeError traceback, "'<=' not supported between 'float' and 'str'")
        names = ", ".join(auto[:4]) + (", ..." if len(auto) > 4 else "")
        raise TrainingError(f"{path.name}: {names} {'is' if len(auto) == 1 else 'are'} 'auto', which only the HF "
                            f"Trainer fills in; the engine needs real values: put numbers there (as ds_configs/"
                            f"zero{max(zero['stage'], 1)}.json does)")
    return conf


def _auto_fields(tree, prefix: str = "") -> list[str]:
    """The dotted names of the values that are the string "auto" anywhere in a DeepSpeed config tree."""
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else ()
    out = []
    for k, v in items:
        name = f"{prefix}{k}"
        if v == "auto":
            out.append(name)
        elif isinstance(v, (dict, list)):
            out += _auto_fields(v, name + ".")
    return out


ADAM_CHOICES = ("auto", "fused", "foreach", "deepspeed")


def _offloads_optimizer(conf: dict) -> bool:
    off = conf.get("zero_optimization", {}).get("offload_optimizer") or {}
    return off.get("device", "none") not in ("none", None)


def resolve_adam(spec: OptimSpec, conf: dict) -> str:
    """Which Adam implementation steps the optimizer partitions:

    * ``fused``: torch's ``AdamW(fused=True)``, built here and handed to DeepSpeed (one kernel per step over the
      flat fp32 partition, no JIT build); on CUDA (and CPU).
    * ``foreach``: torch's Adam as DeepSpeed builds it from the JSON (``torch_adam``: ~7 elementwise passes).
    * ``deepspeed``: DeepSpeed's own (FusedAdam, a CUDA JIT build; DeepSpeedCPUAdam when the optimizer is offloaded).
    * ``auto``: ``fused`` on CUDA (``OptimSpec.gpu()``: the engine's device, not the host's) unless the ZeRO config
      offloads the optimizer (then what the JSON says); on CPU ``foreach`` (DeepSpeed's fused and CPU Adams need their
      JIT builds). A JSON whose optimizer is not Adam/AdamW (SGD, Lamb): ``deepspeed``, its own optimizer as DeepSpeed
      builds it (on CPU ``foreach`` handed torch's SGD a ``torch_adam`` argument: a TypeError traceback)."""
    if spec.adam not in ADAM_CHOICES:
        raise TrainingError(f"parallel.adam: {spec.adam!r}; use one of {', '.join(ADAM_CHOICES)}")
    kind = str(conf.get("optimizer", {}).get("type", "AdamW")).lower()
    offload = _offloads_optimizer(conf)
    if spec.adam in ("fused", "foreach") and kind not in ("adam", "adamw"):
        raise TrainingError(f"parallel.adam={spec.adam}: the DeepSpeed JSON's optimizer is {kind!r}, not Adam/AdamW; "
                            "set parallel.adam=auto")
    if spec.adam == "fused":
        if offload:
            raise TrainingError("parallel.adam=fused: the ZeRO config offloads the optimizer to the CPU (DeepSpeed's "
                                "CPU Adam steps it there); set parallel.adam=auto or drop offload_optimizer")
        return "fused"
    if spec.adam != "auto":
        return spec.adam
    if kind not in ("adam", "adamw"):
        return "deepspeed"
    if not spec.gpu():
        return "foreach"
    if kind in ("adam", "adamw") and not offload:
        return "fused"
    return "deepspeed" if not conf.get("optimizer", {}).get("params", {}).get("torch_adam") else "foreach"


def fused_adam(params, conf: dict, lr: float):
    """torch's fused AdamW (or Adam without decoupled decay) with the JSON's betas / eps / weight decay."""
    opt = conf["optimizer"]
    p = opt.get("params", {})
    kind = str(opt.get("type", "AdamW")).lower()
    decoupled = kind == "adamw" or bool(p.get("adam_w_mode", True))
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    return cls(params, lr=lr, betas=tuple(p.get("betas", (0.9, 0.999))), eps=float(p.get("eps", 1e-8)),
               weight_decay=float(p.get("weight_decay", 0.0)), fused=True)


def warmup_note(spec: OptimSpec) -> str | None:
    """A warning when the warmup is longer than the stage (a small budget with the default warmup): the lr never
    reaches its peak, silently; else None."""
    if spec.total_steps and spec.warmup_steps > spec.total_steps:
        peak = lr_multiplier(spec.total_steps - 1, spec.warmup_steps, spec.total_steps, spec.min_lr_ratio)
        # the field by its section where the stage is known: the other stage's warmup may be set already
        field = f"{spec.stage}.warmup_steps" if spec.stage else "warmup_steps"
        lr = f"{spec.stage}.lr" if spec.stage else "lr"
        stage = f"stage {spec.stage.removeprefix('stage')}'s" if spec.stage else "the stage's"
        return (f"[train] warning: {field}={spec.warmup_steps} is longer than {stage} {spec.total_steps} "
                f"steps: the lr peaks at {peak:.0%} of {lr}={spec.lr:g}; lower {field} (or raise the budget)")
    return None


def lr_multiplier(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup over `warmup` steps, then cosine decay to `min_ratio` at `total`."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    span = max(total - warmup, 1)
    progress = min(max(step - warmup, 0) / span, 1.0)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def use_mpu(mpu) -> None:
    """Make ``mpu`` (None: no model parallelism) the model-parallel unit DeepSpeed's process-wide queries see.

    DeepSpeed keeps the mpu of the last engine that was given one in a module global (``deepspeed.utils.groups.mpu``,
    from which every engine takes its data-parallel group and model-parallel size) and never clears it: an engine
    built later in the same process without an mpu would inherit the earlier one's. In one worker, stage 2 after a
    layer-parallel stage 1 then saw a model-parallel world of every rank with no mpu of its own (DeepSpeed's
    ``'NoneType' object has no attribute 'get_model_parallel_rank'``), and ZeRO would have partitioned over stage 1's
    one-rank data-parallel groups. Every engine starts from its own."""
    from deepspeed.utils import groups

    groups.mpu = mpu


def build_engine(model: torch.nn.Module, spec: OptimSpec, *, dp_world: int, mpu=None, params=None,
                 foreach_grad_checks: bool = True, grad_buckets: bool = True):
    """deepspeed.initialize with the recipe's config, schedule and (optionally) an mpu.

    ZeRO-1/2 optimizers get the foreach gradient norm and overflow check of ``zero_foreach`` (same results,
    a few kernel launches instead of ~15 per trainable tensor) and the bucketed gradient path of
    ``zero_buckets`` (the same gradients, a few tensor ops per bucket instead of per tensor);
    ``foreach_grad_checks=False`` / ``grad_buckets=False`` keep DeepSpeed's per-tensor code (the baselines of
    benchmarks/train_throughput.py's ``--grad-checks deepspeed`` / ``--grad-buckets deepspeed``)."""
    import deepspeed

    from .zero_buckets import install as install_buckets
    from .zero_foreach import install as install_foreach

    conf = ds_config_for(spec, dp_world)
    if (note := warmup_note(spec)) and (not dist.is_initialized() or dist.get_rank() == 0):
        print(note, file=sys.stderr, flush=True)
    if params is None:
        params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise TrainingError("nothing to train: the model has no parameter with requires_grad=True")

    def scheduler(optimizer):
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: lr_multiplier(s, spec.warmup_steps, spec.total_steps, spec.min_lr_ratio)
        )

    optimizer = None
    if resolve_adam(spec, conf) == "fused":
        optimizer = fused_adam(params, conf, spec.lr)
        del conf["optimizer"]  # DeepSpeed wraps the optimizer given instead of building one
    use_mpu(mpu)
    with _no_warmup_optimizer_step():
        engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=params, optimizer=optimizer, config=conf, mpu=mpu, lr_scheduler=scheduler
        )
    _record_fp32_grad_norm(engine)
    if mpu is not None:  # ZeRO-0 bf16 under tp: the clipping norm counts every rank's shards (hmscale.parallel.mpu)
        from hmscale.parallel.mpu import count_tp_shards_in_grad_norm

        count_tp_shards_in_grad_norm(engine.optimizer, mpu)
    if foreach_grad_checks:
        install_foreach(engine.optimizer)
    if grad_buckets:
        install_buckets(engine.optimizer)
    return engine


@contextlib.contextmanager
def _no_warmup_optimizer_step():
    """Build DeepSpeed's bf16/fp16 wrappers of ZeRO 0 without the optimizer step they take at construction.

    ZeRO 0 with bf16 gets DeepSpeed's ``FP16_UnfusedOptimizer`` (``FP16_Optimizer`` with DeepSpeed's FusedAdam), whose
    ``__init__`` calls ``initialize_optimizer_states``: every gradient set to zero and one full ``optimizer.step()``
    (deepspeed/runtime/fp16/unfused_optimizer.py, fused_optimizer.py), to allocate Adam's state eagerly. That step
    counts: Adam's step counter is at 1 before training, so every later bias correction is one step late (with betas
    0.9/0.95 the first update is 0.735 times ZeRO 1's and fp32's: another loss from step 1 on), and with
    weight decay the fp32 master weights are decayed once, at the full lr, before training. ZeRO 1/2/3 and fp32 ZeRO 0
    create the state at the first real step. Without the warm-up step the state is created there too (torch's and
    DeepSpeed's Adams create it lazily): ZeRO 0 bf16 then steps as ZeRO 1 does
    (tests/train/test_zero0_bf16_optimizer.py)."""
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    classes = [c for c in (FP16_UnfusedOptimizer, FP16_Optimizer) if "initialize_optimizer_states" in vars(c)]
    saved = {c: vars(c)["initialize_optimizer_states"] for c in classes}
    for c in classes:
        c.initialize_optimizer_states = lambda self: None
    try:
        yield
    finally:
        for c, f in saved.items():
            c.initialize_optimizer_states = f


def _record_fp32_grad_norm(engine) -> None:
    """ZeRO-0 in fp32: DeepSpeed clips the gradients (``clip_fp32_gradients``) but drops the norm it computed, so
    ``get_global_grad_norm()`` stayed None and metrics.jsonl had no grad_norm; keep it, as the ZeRO optimizers do.
    Without clipping DeepSpeed computes no norm at all there: the norm is computed (nothing clipped) before each step."""
    if engine.zero_optimization() or engine.bfloat16_enabled() or engine.fp16_enabled():
        return
    from deepspeed.runtime.utils import clip_grad_norm_

    def record(max_norm: float) -> None:
        params = [p for p in engine.module.parameters() if p.grad is not None]
        if params:
            engine._global_grad_norm = float(clip_grad_norm_(parameters=params, max_norm=max_norm, mpu=engine.mpu))

    if engine.gradient_clipping() > 0.0:
        engine.clip_fp32_gradients = lambda: record(engine.gradient_clipping())
        return
    take_model_step = engine._take_model_step

    def norm_then_step(*args, **kwargs):
        record(float("inf"))  # clip_coef = min(1, inf / norm) = 1: the gradients are left as they are
        return take_model_step(*args, **kwargs)

    engine._take_model_step = norm_then_step


# --------------------------------------------------------------------------- checkpoints

TAG = "state"


@dataclass
class Checkpointer:
    """DeepSpeed checkpoints under `root/step_XXXXXXXX/` (tag `state` + meta.json), last `keep` kept."""

    root: Path
    keep: int = 2
    rank: int = 0

    def path_for(self, step: int) -> Path:
        return Path(self.root) / f"step_{step:08d}"

    def complete(self) -> list[Path]:
        root = Path(self.root)
        if not root.exists():
            return []
        return sorted(p for p in root.iterdir() if p.name.startswith("step_") and (p / "meta.json").exists())

    def partial(self, before: int) -> list[Path]:
        """Checkpoint directories of steps before `before` without meta.json: saves a kill interrupted."""
        root = Path(self.root)
        if not root.exists():
            return []
        out = []
        for p in root.iterdir():
            try:
                n = int(p.name[len("step_"):]) if p.name.startswith("step_") else None
            except ValueError:
                continue
            if n is not None and n < before and p.is_dir() and not (p / "meta.json").exists():
                out.append(p)
        return sorted(out)

    def prunable(self, step: int) -> list[Path]:
        """The complete checkpoints a save of ``step`` retires: those beyond the newest ``keep`` of steps up to
        ``step``. A checkpoint of a later step (a damaged one the resume passed over, delete it once inspected) is
        neither counted nor removed: counted, it pushed out the checkpoint just written (keep=1), and the run went on
        with nothing to resume from."""
        upto = [p for p in self.complete() if _step_of(p) is not None and _step_of(p) <= step]
        return upto[: -self.keep] if self.keep > 0 else upto

    def latest(self, log: Callable[[str], None] | None = None) -> Path | None:
        """The newest complete checkpoint that is whole (``problem``): a damaged one (a file truncated or deleted by
        hand or by a failing disk, meta.json edited) is passed over, with one line on stderr (rank 0) naming it and
        why, for the one before it; None when there is none."""
        for path in reversed(self.complete()):
            why = self.problem(path)
            if why is None:
                return path
            if self.rank == 0:
                (log or (lambda m: print(m, file=sys.stderr, flush=True)))(
                    f"[checkpoint] {path} is damaged ({why}); not resuming from it (the one before it, if any, is "
                    "used; delete it once inspected)")
        return None

    @staticmethod
    def problem(path: str | os.PathLike) -> str | None:
        """Why the checkpoint at ``path`` cannot be resumed from, or None: meta.json unreadable or not this
        directory's step; a file recorded when it was written (``files`` in meta.json: path and size) missing or
        of another size; for a checkpoint from before files were recorded, no DeepSpeed state at all. (Bytes damaged
        in place, the size unchanged, are found by ``load``: one line, as torch.load fails.)"""
        path = Path(path)
        try:
            meta = json.loads((path / "meta.json").read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            return f"meta.json unreadable: {err}"
        if not isinstance(meta, dict):
            return "meta.json is not a JSON object"
        try:
            want = int(path.name[len("step_"):])
        except ValueError:
            want = None
        step = meta.get("step")
        if type(step) is not int or (want is not None and step != want):
            return f"meta.json says step {step!r}, the directory step {want}"
        files = meta.get("files")
        if files is None:  # written before the files were recorded
            return None if checkpoint_layout(path) is not None else f"no DeepSpeed state under {TAG}/"
        if not isinstance(files, dict):
            return "meta.json's files is not an object"
        for rel, size in sorted(files.items()):
            f = path / rel
            try:
                have = f.stat().st_size
            except OSError:
                return f"{rel} is missing"
            if have != size:
                return f"{rel} has {have} bytes, {size} when written"
        return None

    def save(self, engine, step: int, client_state: dict, meta: dict | None = None, name: str = "training") -> Path:
        """A DeepSpeed checkpoint of ``step``, then meta.json (recording every file's size: ``problem``), then the
        older ones beyond ``keep`` go. A write that fails (a full disk) removes what it wrote and raises a one-line
        TrainingError naming it: the checkpoints before it are untouched."""
        path = self.path_for(step)
        if self.rank == 0 and path.exists():  # a stale partial checkpoint from a killed attempt
            shutil.rmtree(path, ignore_errors=True)
        barrier()
        try:
            engine.save_checkpoint(str(path), tag=TAG, client_state=dict(client_state))
            barrier()
            if self.rank == 0:
                files = {str(f.relative_to(path)): f.stat().st_size for f in sorted((path / TAG).rglob("*"))
                         if f.is_file()}  # (DeepSpeed's state: what a resume loads)
                atomic_write_json(path / "meta.json", {"step": step, "tag": TAG, **(meta or {}),
                                                       **_jsonable(client_state), "files": files})
        except OSError as err:
            if self.rank == 0:
                shutil.rmtree(path, ignore_errors=True)  # never half a checkpoint (and give its space back)
            before = self.latest()
            kept = (f"the last good checkpoint {before} is kept" if before is not None
                    else "no earlier checkpoint was written")
            raise StorageError(
                f"{name}: {os_error_line(err, f'checkpoint {path.name} ({err.filename or path})', 'rerun into the same output_dir to resume', where=self.root)}"
                f"; {kept} (a save needs room for one more checkpoint than parallel.keep_checkpoints)") from err
        if self.rank == 0:
            for old in self.prunable(step):
                shutil.rmtree(old, ignore_errors=True)
            for stale in self.partial(before=step):  # what a killed save left (never resumed from, never counted)
                shutil.rmtree(stale, ignore_errors=True)
        barrier()
        return path

    @staticmethod
    def load(engine, path: str | os.PathLike) -> dict:
        """The checkpoint's weights, optimizer state and step; the optimizer's hyperparameters (lr, betas, eps,
        weight decay) and the lr schedule stay the config's: the checkpoint's param groups and scheduler state
        carried the lr it was written with, so a resume with another stage lr trained at the old one, silently."""
        fresh = [{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups]
        advice = ("delete it (a rerun then resumes from the checkpoint before it, or starts the stage over) or "
                  "restore it from a copy")
        why = Checkpointer.problem(path)
        if why is not None:
            raise TrainingError(f"checkpoint {str(path)!r} is damaged ({why}); {advice}")
        try:
            load_path, client = engine.load_checkpoint(str(path), tag=TAG, load_optimizer_states=True,
                                                       load_lr_scheduler_states=True)
        except Exception as err:  # a file whose bytes were damaged in place (its size unchanged): torch.load's error
            first = (str(err).strip().splitlines() or [""])[0]
            raise TrainingError(f"checkpoint {str(path)!r} could not be loaded ({type(err).__name__}: {first}); "
                                f"{advice}") from err
        if load_path is None:
            raise TrainingError(f"checkpoint {str(path)!r} could not be loaded (no DeepSpeed state under tag {TAG!r}); "
                                f"{advice}")
        groups = engine.optimizer.param_groups
        if len(groups) == len(fresh):
            for g, f in zip(groups, fresh):
                g.update(f)
            sched = engine.lr_scheduler
            if isinstance(sched, torch.optim.lr_scheduler.LambdaLR) and all("initial_lr" in f for f in fresh):
                sched.base_lrs = [f["initial_lr"] for f in fresh]
                for g, base, fn in zip(groups, sched.base_lrs, sched.lr_lambdas):
                    g["lr"] = base * fn(sched.last_epoch)
                sched._last_lr = [g["lr"] for g in groups]
        return client or {}

    @staticmethod
    def check_layout(path: str | os.PathLike, name: str, *, zero_stage: int, dp: int, mp: int,
                     samples_per_step: int, mp_what: str = "parallel.tp") -> None:
        """Refuse (one line) to resume from a checkpoint written with another layout: ZeRO 0 / 1-2 / 3 (different
        files), another data-parallel size under ZeRO (DeepSpeed does not re-partition the optimizer state: it
        raised a traceback), another model-parallel size (`mp_what`), or another number of rows per optimizer step
        (the data position is step x rows: the resumed run would silently re-read or skip rows)."""
        found = checkpoint_layout(path)
        diffs = []
        if found is not None:
            group = {0: "0", 1: "1-2", 2: "1-2", 3: "3"}
            if group[found["zero"]] != group[int(zero_stage)]:
                diffs.append(f"ZeRO {group[found['zero']]} -> {int(zero_stage)}")
            elif found["dp"] is not None and int(zero_stage) >= 1 and found["dp"] != dp:
                diffs.append(f"{found['dp']} -> {dp} data-parallel workers")
            if found["mp"] != mp:
                diffs.append(f"{mp_what} {found['mp']} -> {mp}")
        meta_path = Path(path) / "meta.json"
        meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
        step, seen = int(meta.get("step", 0) or 0), int(meta.get("samples_seen", 0) or 0)
        if step > 0 and seen and seen // step != samples_per_step:
            diffs.append(f"{seen // step} -> {samples_per_step} rows per optimizer step "
                         "(micro_batch_size x grad_accum x data-parallel workers)")
        if diffs:
            raise TrainingError(f"{name}: cannot resume from {path}: it was written with another layout "
                                f"({', '.join(diffs)}); resume with the settings it was written with, or start "
                                "the stage over in a new output_dir")


def _step_of(path: Path) -> int | None:
    """The step of a ``step_XXXXXXXX`` checkpoint directory (None for another name)."""
    try:
        return int(Path(path).name[len("step_"):]) if Path(path).name.startswith("step_") else None
    except ValueError:
        return None


def checkpoint_layout(path: str | os.PathLike) -> dict | None:
    """How the DeepSpeed checkpoint at `path` (tag `state`) was partitioned, from its file names:
    {"zero": 0, 1 (ZeRO 1 or 2: the same files) or 3, "dp": data-parallel ranks (None for ZeRO 0: one file),
    "mp": model-parallel ranks}; None when it holds no DeepSpeed files."""
    import re

    names = [p.name for p in (Path(path) / TAG).glob("*.pt")]
    model = {m[1] for n in names if (m := re.fullmatch(r"mp_rank_(\d+)_model_states\.pt", n))}
    # (with bf16 on, DeepSpeed prefixes the optimizer partitions of ZeRO 1/2/3 with "bf16_": engine._get_zero_ckpt_prefix)
    zero = [m for n in names
            if (m := re.fullmatch(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_(optim|model)_states\.pt", n))]
    if zero:
        return {"zero": 3 if any(m[3] == "model" for m in zero) else 1, "dp": len({m[1] for m in zero}),
                "mp": len({m[2] for m in zero})}
    if model:
        return {"zero": 0, "dp": None, "mp": len(model)}
    return None


def _jsonable(d: dict) -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, (int, float, str, bool)) or v is None:
            out[k] = v
        elif isinstance(v, (list, tuple)) and all(isinstance(x, (int, float, str)) for x in v):
            out[k] = list(v)
    return out


# --------------------------------------------------------------------------- metrics


class MetricsLogger:
    """Rank-0 metrics: JSONL lines, TensorBoard scalars and a progress bar (others: no-ops)."""

    def __init__(self, stage_dir: Path, name: str, total_steps: int, start_step: int = 0, rank: int = 0,
                 progress: bool = True, tensorboard: bool = True):
        self.rank, self.name = rank, name
        self.path = Path(stage_dir) / "metrics.jsonl"
        self._tb = self._bar = None
        if rank != 0:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if start_step == 0 and self.path.exists():
            self.path.unlink()  # a fresh run; a resumed one appends
        elif start_step > 0 and self.path.exists():
            self._truncate_after(start_step)
        if start_step == 0:
            # a fresh run, TensorBoard's side: the event files of an attempt that died before its first checkpoint
            # went on showing its steps beside this run's (metrics.jsonl, above, starts over); a resumed run purges
            # its steps >= start_step instead (purge_step below)
            for old in Path(stage_dir, "tb").glob("events.out.tfevents.*"):
                old.unlink(missing_ok=True)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(Path(stage_dir) / "tb"), purge_step=start_step or None)
            except Exception:  # tensorboard missing: JSONL only
                self._tb = None
        if progress:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc=name, unit="step", file=sys.stderr,
                             dynamic_ncols=True, mininterval=1.0, disable=os.environ.get("HMSCALE_NO_PROGRESS") == "1")

    def _truncate_after(self, start_step: int):
        """Drop lines of steps >= start_step (written by an attempt that died before its checkpoint)."""
        keep = []
        for line in self.path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if rec.get("step", -1) < start_step or rec.get("kind") == "event":
                keep.append(line)
        try:
            atomic_write_text(self.path, "".join(l + "\n" for l in keep))
        except OSError as err:
            raise StorageError(f"{self.name}: " + os_error_line(err, f"{self.path}", "rerun into the same output_dir")) from err

    def log(self, step: int, metrics: dict, kind: str = "train"):
        if self.rank != 0:
            return
        # counts stay ints and flags bools (an event's layer_parallel read 1.0, its total_steps 60.0); other numbers
        # (numpy / torch scalars included) are written as floats
        rec = {"kind": kind, "step": step,
               **{k: _json_number(v) for k, v in metrics.items()}}
        try:
            with open(self.path, "a") as f:
                f.write(json.dumps(rec) + "\n")
        except OSError as err:  # a full disk: one line (a torn last line is dropped by the resume's truncation)
            raise StorageError(f"{self.name}: " + os_error_line(
                err, f"{self.path}", "rerun into the same output_dir: it resumes from the last checkpoint")) from err
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and math.isfinite(float(v)):
                    self._tb.add_scalar(f"{self.name}/{kind}/{k}", float(v), step)
        if self._bar is not None and kind == "train":
            self._bar.update(1)
            self._bar.set_postfix({k: f"{metrics[k]:.4g}" for k in ("loss", "lr") if k in metrics}, refresh=False)
        elif self._bar is not None and kind == "eval":
            self._bar.write(f"{self.name} step {step}: " + " ".join(f"{k}={v:.4g}" for k, v in metrics.items()
                                                                    if isinstance(v, (int, float))))

    def close(self):
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()


def _json_number(v):
    """ints and bools as they are, other real numbers (float, numpy and 0-d torch scalars) as floats, the rest as is."""
    if isinstance(v, (bool, int, str)) or v is None:
        return v
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        return float(v)
    try:
        import numbers

        return float(v) if isinstance(v, numbers.Real) else v
    except (TypeError, ValueError):
        return v


def read_metrics(path: str | os.PathLike, kind: str = "train") -> list[dict]:
    """The records of one kind; a line that does not parse (the torn last line of a run killed mid-write) is skipped."""
    p = Path(path)
    if not p.exists():
        return []
    recs = []
    for line in p.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and rec.get("kind") == kind:
            recs.append(rec)
    return recs


# --------------------------------------------------------------------------- the loop


@dataclass
class LoopResult:
    start_step: int
    end_step: int
    losses: list[float] = field(default_factory=list)  # this call's steps
    last_checkpoint: str | None = None
    seconds: float = 0.0  # this call's training time
    tokens: int = 0  # this call's tokens
    resumed: dict = field(default_factory=dict)  # the stage's totals at start_step (`resumed_totals`)
    last_eval: tuple[int, dict] | None = None  # (steps trained, eval_fn's metrics) of this call's last evaluation

    @property
    def stage_tokens(self) -> int:
        """Tokens the stage has trained on, over every attempt (a resumed stage counts its earlier ones)."""
        return int(self.resumed.get("tokens", 0)) + self.tokens

    @property
    def stage_seconds(self) -> float:
        """The stage's training time over every attempt (up to each one's last checkpoint)."""
        return float(self.resumed.get("seconds", 0.0)) + self.seconds

    @property
    def final_loss(self) -> float | None:
        """The loss of the stage's last step, this call's or, when it trained none, the checkpoint's."""
        return self.losses[-1] if self.losses else self.resumed.get("loss")


def resumed_totals(path: str | os.PathLike, client: dict, default_tokens: int = 0) -> dict:
    """What a stage had done when the checkpoint at `path` was written (`client`: its client state, as
    `Checkpointer.load` returns it): {"tokens", "seconds"} over every attempt so far, and the last step's "loss".
    A checkpoint written before the totals were recorded: tokens from its step count (`default_tokens`), seconds 0."""
    meta_path = Path(path) / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    return {"tokens": int(client.get("stage_tokens", meta.get("stage_tokens", default_tokens))),
            "seconds": float(client.get("stage_seconds", meta.get("stage_seconds", 0.0))),
            "loss": meta.get("loss")}


def _collective_device() -> torch.device:
    """Where a collective's tensor must live: the current GPU under NCCL, else the CPU (gloo)."""
    nccl = torch.cuda.is_available() and dist.is_initialized() and dist.get_backend() == "nccl"
    return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")


def _nonfinite_counts(loss: torch.Tensor) -> torch.Tensor:
    """Over every rank: [ranks whose loss is not finite, of them NaN, +inf, -inf] (one all-reduce)."""
    x = loss.detach().float().reshape(-1)
    local = torch.stack([(~torch.isfinite(x)).any(), torch.isnan(x).any(), torch.isposinf(x).any(),
                         torch.isneginf(x).any()]).float()  # (on the loss's device: one host read, after the reduce)
    return all_reduce_sum(local).cpu()


def _nonfinite_value(loss: torch.Tensor, counts: torch.Tensor) -> str:
    """The non-finite loss to name: this rank's own when it is one, else the kind another rank had."""
    if not bool(torch.isfinite(loss.detach()).all()):
        return str(loss.detach().float().item()) if loss.numel() == 1 else "nan" if torch.isnan(loss).any() else "inf"
    for count, kind in zip(counts[1:].tolist(), ("nan", "inf", "-inf")):
        if count > 0:
            return kind
    return "not finite"


def _weights_finite(engine) -> bool:
    """Whether every trainable weight of every rank is finite (ZeRO-3: each rank's partition); every rank calls it, at
    the same step (before each checkpoint). One host read per rank."""
    checks = []
    with torch.no_grad():
        for p in engine.module.parameters():
            if p.requires_grad:
                t = p if getattr(p, "ds_tensor", None) is None else p.ds_tensor
                if t.numel():
                    checks.append(torch.isfinite(t).all())
        bad = 0.0 if not checks else float(not bool(torch.stack([c.to(checks[0].device) for c in checks]).all()))
    return all_reduce_sum(torch.tensor([bad], device=_collective_device())).item() == 0


def _nonfinite_weights_message(name: str, step: int, cause: str, last_checkpoint: str | None) -> str:
    where = (f"last checkpoint {last_checkpoint} (written before it; a rerun resumes from there and repeats this step "
             "with the same settings)" if last_checkpoint else "no checkpoint was written yet")
    return (f"{name}: the weights are not finite after step {step}{f' ({cause})' if cause else ''}; stopped without "
            f"checkpointing them, {where}; lower the learning rate "
            "(a new output_dir: it is a training setting)")


def train_loop(
    *,
    name: str,
    engine,
    micro_step: Callable[[int, int], tuple[torch.Tensor, dict]],
    total_steps: int,
    grad_accum: int,
    start_step: int,
    checkpointer: Checkpointer,
    checkpoint_every: int,
    logger: MetricsLogger,
    client_state: Callable[[int], dict],
    tokens_per_step: int = 0,
    stop_at_step: int | None = None,
    eval_fn: Callable[[int], dict] | None = None,
    eval_every: int = 0,
    on_checkpoint: Callable[[int, Path, dict], None] | None = None,
    reduce_group=None,
    fault_hook: Callable[[int], None] | None = None,
    resumed: dict | None = None,
) -> LoopResult:
    """Optimizer steps start_step..total_steps-1. `micro_step(step, micro)` returns (loss, extras);
    extras are floats or 1-d tensors, all-reduced (mean) over `reduce_group` before logging.
    `resumed`: the stage's totals at start_step (`resumed_totals` of the checkpoint it resumes from); each
    checkpoint's client state carries them on (`stage_tokens`, `stage_seconds`)."""
    res = LoopResult(start_step=start_step, end_step=start_step, resumed=dict(resumed or {}))
    last_ckpt = checkpointer.latest(log=lambda _: None)  # (a damaged one was named when the stage chose where to resume)
    res.last_checkpoint = str(last_ckpt) if last_ckpt else None
    end = total_steps if stop_at_step is None else min(total_steps, stop_at_step)
    t_start = time.perf_counter()
    try:
        for step in range(start_step, end):
            if fault_hook is not None:
                fault_hook(step)
            t0 = time.perf_counter()
            # the lr this step trains at (after engine.step() the scheduler has moved on to the next step's)
            lrs = engine.get_lr()
            lr = float(lrs[0]) if lrs else 0.0
            loss_sum = torch.zeros(())
            extra_sum: dict[str, torch.Tensor] = {}
            for micro in range(grad_accum):
                loss, extras = micro_step(step, micro)
                # all ranks agree on finiteness before touching the weights; with the kinds of value that stopped
                # them, so that every rank's line (rank 0's is the one the driver shows) names the non-finite loss,
                # not its own finite one
                bad = _nonfinite_counts(loss)
                if bad[0].item() > 0:
                    where = (f"last checkpoint {res.last_checkpoint} (the weights before this step; a loss that "
                             "grew to this may diverge again from there)" if res.last_checkpoint
                             else "no checkpoint was written yet")
                    world = dist.get_world_size() if dist.is_initialized() else 1
                    on = f", on {int(bad[0].item())} of {world} workers" if world > 1 else ""
                    raise NonFiniteLoss(
                        f"{name}: loss is {_nonfinite_value(loss, bad)} at step {step} (micro batch {micro}{on}); "
                        f"stopped, {where}; lower the learning rate (a new output_dir: it is a training setting)"
                    )
                engine.backward(loss)
                engine.step()
                loss_sum += loss.detach().float().cpu()
                for k, v in extras.items():
                    v = torch.as_tensor(v, dtype=torch.float32).detach().cpu()
                    extra_sum[k] = extra_sum.get(k, 0) + v
            vals = [loss_sum.reshape(1) / grad_accum] + [extra_sum[k].reshape(-1) / grad_accum for k in sorted(extra_sum)]
            flat = torch.cat(vals)
            flat = all_reduce_mean(flat.to(_collective_device()), group=reduce_group).cpu()
            loss_val = float(flat[0])
            metrics: dict[str, Any] = {"loss": loss_val}
            off = 1
            for k in sorted(extra_sum):  # an extra named "loss" replaces the logged loss (e.g. layer-parallel stage 1)
                n = extra_sum[k].numel()
                chunk = flat[off : off + n]
                off += n
                if n == 1:
                    metrics[k] = float(chunk[0])
                else:
                    for i, x in enumerate(chunk.tolist()):
                        metrics[f"{k}/{i}"] = x
            loss_val = metrics["loss"]
            dt = time.perf_counter() - t0
            gn = engine.get_global_grad_norm()
            metrics.update(lr=lr, step_seconds=dt)
            if gn is not None:
                metrics["grad_norm"] = float(gn)
            if tokens_per_step:
                metrics["tokens_per_s"] = tokens_per_step / max(dt, 1e-9)
                res.tokens += tokens_per_step
            logger.log(step, metrics)
            res.losses.append(loss_val)
            res.end_step = step + 1
            if eval_fn is not None and eval_every and ((step + 1) % eval_every == 0 or step + 1 == total_steps):
                res.last_eval = (step + 1, eval_fn(step))
                logger.log(step, res.last_eval[1], kind="eval")
            if (step + 1) % checkpoint_every == 0 or step + 1 == total_steps or step + 1 == end:
                # never a checkpoint of non-finite weights: a finite loss whose non-finite gradient the optimizer
                # applied (ZeRO 0 has no overflow skip) turns them NaN, and every rerun would resume them
                if not _weights_finite(engine):
                    bad_gn = gn is not None and not math.isfinite(float(gn))
                    cause = f"the gradient norm of step {step} was {float(gn)}" if bad_gn else ""
                    raise NonFiniteLoss(_nonfinite_weights_message(name, step, cause, res.last_checkpoint))
                totals = {"stage_tokens": res.stage_tokens,
                          "stage_seconds": res.stage_seconds + (time.perf_counter() - t_start)}
                path = checkpointer.save(engine, step + 1, {**client_state(step + 1), **totals}, {"stage": name, "loss": loss_val},
                                         name=name)
                res.last_checkpoint = str(path)
                if on_checkpoint is not None:
                    on_checkpoint(step + 1, path, {"stage": name, "step": step + 1, "loss": loss_val})
    except KeyboardInterrupt:
        # Ctrl-C (or a scheduler's SIGINT): say where the stage stands and how to go on; the interrupt goes on up
        if checkpointer.rank == 0:
            where = (f"a rerun into the same output_dir resumes from {res.last_checkpoint}" if res.last_checkpoint
                     else "no checkpoint was written yet: a rerun starts the stage over")
            print(f"\n{name}: interrupted after {res.end_step} of {total_steps} steps; {where}", file=sys.stderr,
                  flush=True)
        raise
    res.seconds = time.perf_counter() - t_start
    return res
