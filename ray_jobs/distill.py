"""Stage 1 then stage 2 on N DeepSpeed workers under Ray Train (or in one process: engine=local).

    python -m ray_jobs.distill --config configs/demo.yaml [-s parallel.num_workers=4 -s parallel.zero_stage=2]

Driver: prepares the data plan, the teacher (a miniature is pretrained and stored once) and, when
stage 1 reads the cache or stage 2 uses KD, the teacher cache; then runs `train_func` either
directly (`parallel.engine=local`, one worker: world size 1, gloo/NCCL), in `parallel.num_workers`
spawned processes on this machine (`engine=local`, several workers: torchrun-style, one per GPU with
`parallel.use_gpu`; `hmscale.train.launch`), or on `parallel.num_workers` Ray Train workers
(`engine=ray`: `TorchTrainer`, gloo on CPU, NCCL with `parallel.use_gpu`).

Fault tolerance: every stage checkpoint is reported to Ray Train (`ray.train.report(metrics,
checkpoint=...)`; each worker reports its own DeepSpeed files, which Ray merges into one checkpoint);
`FailureConfig(max_failures=parallel.max_failures)` restarts the worker group after a worker dies, and
`train_func` resumes from `ray.train.get_checkpoint()` (a finished stage is skipped); once those restarts are used
up, the driver stops with a one-line `TrainingError` (`workers_failed_line`) instead of Ray's WorkerGroupError.
The run directory must be visible to all workers (one node, or a shared filesystem); on a (re)start the
furthest whole checkpoint of Ray's restored one and the newest complete one under the run directory wins
(a report made just before a worker died may never reach the controller; a damaged one is passed over), so
rerunning into the same run directory resumes too (use a fresh output_dir to start over).

Test hook: HMSCALE_FAULT_INJECT="stage2:STEP:RANK" SIGKILLs that worker once at the start of STEP.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import sys
import time
from pathlib import Path

FAULT_ENV = "HMSCALE_FAULT_INJECT"
REPO_ROOT = Path(__file__).resolve().parents[1]


def _fault_hook(spec: str | None, stage: str, rank: int, run_dir: Path):
    if not spec:
        return None
    f_stage, f_step, f_rank = spec.split(":")
    if f_stage != stage or int(f_rank) != rank:
        return None
    marker = run_dir / f".fault_{f_stage}_{f_step}_{f_rank}"

    def hook(step: int):
        if step == int(f_step) and not marker.exists():
            marker.write_text(str(time.time()))
            print(f"[distill] fault injection: killing rank {rank} at {stage} step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


STAGES = ("stage1", "stage2")
ERROR_FILE = "distill_error.json"  # a deterministic worker error, for the driver (Ray or local workers)


def _error_file(run_dir: Path, rank: int = 0) -> Path:
    """Where a worker writes its deterministic failure down: rank 0's is ERROR_FILE (Ray's workers write only that
    one); local workers' other ranks write their own, since torch's launcher kills the others as soon as one worker
    exits with an error, possibly before rank 0 has written its line."""
    return run_dir / (ERROR_FILE if rank == 0 else f"distill_error.rank{rank}.json")


def _record_error(run_dir: Path, err: Exception, rank: int = 0) -> None:
    """Write a worker's deterministic failure down for the driver (the run dir is shared)."""
    from hmscale.atomic import atomic_write_json

    atomic_write_json(_error_file(run_dir, rank), {"error": str(err), "error_type": type(err).__name__})


def _clear_recorded_errors(run_dir: Path) -> None:
    for p in [run_dir / ERROR_FILE, *run_dir.glob("distill_error.rank*.json")]:
        p.unlink(missing_ok=True)


def _raise_recorded_error(run_dir: Path, rank: int | None = None) -> None:
    """Raise the failure a worker recorded (as its TrainingError subclass), if there is one: rank 0's, else that of
    ``rank`` (the local worker whose exit stopped the others), else any other rank's."""
    from hmscale.train import engine as E

    files = [_error_file(run_dir, 0)]
    if rank:
        files.append(_error_file(run_dir, rank))
    files += sorted(run_dir.glob("distill_error.rank*.json"), key=lambda p: (len(p.name), p.name))
    for path in files:
        try:
            err = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        for p in run_dir.glob("distill_error.rank*.json"):  # (rank 0's stays, as under Ray)
            p.unlink(missing_ok=True)
        raise getattr(E, err.get("error_type", ""), E.TrainingError)(err["error"])


def _stage_summaries(run_dir: Path, stages) -> dict:
    out = {}
    for stage in stages:
        p = run_dir / stage / "summary.json"
        if p.exists():
            out[stage] = json.loads(p.read_text())
    return out


def _recorded(run_dir: Path, stage: str) -> dict:
    """A finished stage's summary as it recorded it when it ran (its tokens, seconds, losses), marked skipped."""
    return {**json.loads((run_dir / stage / "summary.json").read_text()), "skipped": True}


def pick_resume_point(run_dir: Path, restored_dir: Path | None, restored_meta: dict, log=None):
    """(stage, checkpoint dir) to resume from: the furthest of Ray's restored checkpoint and the newest
    complete checkpoint in the run directory (a report can be lost when a worker dies right after it).

    A damaged checkpoint is passed over, with one line (``log``; default stderr) naming it: Ray's as the run
    directory's (``Checkpointer.latest``). Ray hands exactly one checkpoint (``ray.train.get_checkpoint()``, the latest
    reported), so Ray has none before it to offer; but it is a copy, in Ray's storage, of a checkpoint of the run
    directory, whose checkpoints are candidates here anyway: that step's original, or the one before it. (Refusing a
    damaged restore stopped the run, advising a rerun that never reads Ray's copy: it starts a new Ray run, which
    restores nothing and resumes from the run directory.)"""
    from hmscale.train.engine import Checkpointer

    say = log or (lambda m: print(m, file=sys.stderr, flush=True))
    cands = []
    why = Checkpointer.problem(restored_dir) if restored_dir is not None else None
    if why is not None:
        say(f"[checkpoint] Ray's restored checkpoint {restored_dir} is damaged ({why}); not resuming from it (the run "
            "directory's newest whole checkpoint, if any, is used)")
    elif restored_dir is not None and restored_meta.get("stage") in STAGES:
        cands.append(((STAGES.index(restored_meta["stage"]), int(restored_meta.get("step", 0))),
                      restored_meta["stage"], restored_dir))
    for stage in STAGES:
        latest = Checkpointer(run_dir / stage / "checkpoints").latest(log=log)
        if latest is not None:
            m = json.loads((latest / "meta.json").read_text())
            cands.append(((STAGES.index(stage), int(m.get("step", 0))), stage, latest))
    if not cands:
        return None, None
    _, stage, path = max(cands, key=lambda c: c[0])
    return stage, path


def _stage_done(run_dir: Path, stage: str) -> bool:
    p = run_dir / stage / "summary.json"
    return p.exists() and json.loads(p.read_text()).get("done", False)


def train_func(config: dict):
    """The per-worker function: stage 1 (unless done) then stage 2, resuming from Ray's checkpoint."""
    import torch

    from hmscale.config import build_config

    cfg = build_config(config["cfg"])
    run_dir = Path(config["run_dir"])
    in_ray = config.get("ray", False)
    if not cfg.parallel.use_gpu:
        torch.set_num_threads(max(1, int(config.get("threads", 1))))

    restored_dir, meta, ctx = None, {}, None
    report = None
    if in_ray:
        import ray.train

        ckpt = ray.train.get_checkpoint()
        if ckpt is not None:
            ctx = ckpt.as_directory()
            restored_dir = Path(ctx.__enter__())
            try:  # (a damaged one is named and passed over by pick_resume_point)
                meta = json.loads((restored_dir / "meta.json").read_text())
            except (OSError, ValueError):
                meta = {}
            meta = meta if isinstance(meta, dict) else {}
            print(f"[distill] rank {ray.train.get_context().get_world_rank()}: Ray restored the {meta.get('stage')} "
                  f"checkpoint of step {meta.get('step')} ({restored_dir})", flush=True)

        def report(step, path, metrics):
            ray.train.report(dict(metrics), checkpoint=ray.train.Checkpoint.from_directory(str(path)))

    from hmscale.config import ConfigError
    from hmscale.train.engine import TrainingError, init_distributed

    rank, world = init_distributed(cfg.parallel.use_gpu)
    fault = config.get("fault")
    data = teacher = None
    results = {}
    try:
        data, teacher = _worker_inputs(cfg, config)
        cache_dir = config.get("cache_dir")

        from hmscale.train.common import stage2_uses_teacher
        from hmscale.train.stage1 import load_stage1_student, run_stage1
        from hmscale.train.stage2 import run_stage2

        stages = tuple(config.get("stages", STAGES))
        # a finished stage (its summary says done) is never entered again: resuming it from its last checkpoint
        # would train nothing and write this call's empty summary (no tokens, no loss) over the one it recorded
        finished = {s for s in STAGES if _stage_done(run_dir, s)}
        stage, resume_path = pick_resume_point(run_dir, restored_dir, meta, log=None if rank == 0 else lambda m: None)
        if stage is not None and stage not in finished and stage in stages and rank == 0:
            print(f"[distill] resuming {stage} from {resume_path}", flush=True)
        student = None
        if "stage1" in stages and "stage1" in finished:
            results["stage1"] = _recorded(run_dir, "stage1")
        elif "stage1" in stages and stage != "stage2":
            s1 = run_stage1(cfg, run_dir, data=data, teacher=teacher, cache_dir=cache_dir if cfg.stage1.source == "cache" else None,
                            resume_from=resume_path if stage == "stage1" else None, resume=False,
                            on_checkpoint=report, fault_hook=_fault_hook(fault, "stage1", rank, run_dir))
            student = s1.pop("student_model", None)
            results["stage1"] = s1
        if "stage2" in stages and "stage2" in finished:
            results["stage2"] = _recorded(run_dir, "stage2")
        elif "stage2" in stages:
            if student is None:
                student = load_stage1_student(run_dir, teacher=teacher, cfg=cfg)
            handed = {"student": student, "teacher": teacher}
            if not stage2_uses_teacher(cfg.stage2):
                # no live teacher in stage 2: run_stage2 holds the last references and lets them go once its model is
                # built (the teacher stayed resident, on the GPU with use_gpu, through the stage)
                student = teacher = None
                (config.get("prepared") or {}).pop("teacher", None)
            s2 = run_stage2(cfg, run_dir, data=data, student=handed.pop("student"),
                            teacher=handed.pop("teacher"),  # (online KD / hidden alignment: this one, not a copy)
                            cache_dir=cache_dir if _needs_cache(cfg, ("stage2",)) else None,
                            resume_from=resume_path if stage == "stage2" else None, resume=False,
                            on_checkpoint=report, fault_hook=_fault_hook(fault, "stage2", rank, run_dir))
            results["stage2"] = s2
    except (TrainingError, ConfigError) as err:
        # deterministic failures (NaN/inf loss, a missing stage-1 student, a setting the model refuses): a Ray restart
        # would only repeat them, so every rank reports the message and ends; the driver raises it
        if not in_ray:
            raise
        import ray.train

        if rank == 0:  # Ray's Result carries the metrics of checkpointed reports only: use the run dir
            _record_error(run_dir, err)
        ray.train.report({"done": False, "error": str(err)})
        return {"error": str(err)}
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)
    if in_ray:
        import ray.train

        ray.train.report({"done": True, **{f"{k}_final_loss": v.get("final_loss") for k, v in results.items()}})
    return results


def _worker_inputs(cfg, config: dict):
    """(data, teacher) of a worker: the driver's own when it runs the stages in its process (``config["prepared"]``,
    engine=local with one worker), else prepared and loaded here. A second copy of the teacher (on the GPU with
    use_gpu) stayed beside the driver's for the whole training, and stage 2 with a live teacher (online KD, hidden
    alignment) loaded a third when stage 1 trained mixers."""
    prepared = config.get("prepared")
    if prepared is not None:
        return prepared["data"], prepared["teacher"]
    data = None
    if config.get("need_data", True):
        from hmscale.data import prepare_data

        data = prepare_data(cfg, log=lambda *a, **k: None)
    from hmscale.teacher import get_teacher

    return data, get_teacher(cfg, data, log=lambda *a, **k: None)


def prepare(cfg, log=print, stages=STAGES, check_data=None) -> dict:
    """Driver-side: data plan, teacher (pretrained/stored once), the cache when needed. ``check_data(data)``: the
    caller's checks that need the data, run before any teacher work."""
    from hmscale.data import prepare_data
    from hmscale.teacher import get_teacher

    _check_ray_workers(cfg, log)  # before the data, the teacher and its cache: a group the cluster can never hold
    data = prepare_data(cfg, log=log)
    if check_data is not None:
        check_data(data)
    teacher = get_teacher(cfg, data, log=log)
    if "stage2" in stages and cfg.parallel.tp > 1:  # a hub teacher's shape is known only now: before any training
        from hmscale.parallel import check_tp_divides

        tcfg = teacher.config
        check_tp_divides(tcfg.num_attention_heads, cfg.parallel.tp, tcfg.intermediate_size)
    cache_dir = None
    if _needs_cache(cfg, stages):
        from hmscale.teacher.cache import build_cache

        cache_dir = str(build_cache(cfg, data, teacher))
    return {"data": data, "teacher": teacher, "cache_dir": cache_dir}


def _needs_cache(cfg, stages) -> bool:
    """Whether a stage to run reads the teacher cache: stage 1 from it (source=cache), stage 2 for its cached top-k KD.
    Online KD reads the live teacher: the cache (every layer's attention tensors) was built for it all the same, a
    teacher pass and its disk for nothing, even with cache.enabled=false."""
    from hmscale.train.common import cached_kd

    return (("stage1" in stages and cfg.stage1.source == "cache" and cfg.cache.enabled)
            or ("stage2" in stages and cached_kd(cfg.stage2)))


def _check_ray_workers(cfg, log=print) -> None:
    """engine=ray on a cluster this process has joined (or started): refuse a worker group the embedded cluster can
    never hold (Ray Train would wait for it without end), warn for a joined one (it may grow)."""
    if cfg.parallel.engine != "ray":
        return
    from hmscale.ray_cluster import check_workers_fit

    check_workers_fit(cfg.parallel.num_workers, cfg.parallel.use_gpu, log=log)


def run_distill(cfg, run_dir: str | os.PathLike | None = None, *, stages=STAGES, log=print,
                storage_path: str | None = None, prepared: dict | None = None) -> dict:
    """Stage 1 + stage 2 (or the given `stages`) with the configured engine (parallel.engine);
    returns {"stage1": summary, "stage2": summary, "seconds": ..., "run_dir": ...}.
    A stage already finished in run_dir (its summary.json says done) is not run again: its entry is the summary it
    recorded when it ran (tokens, seconds, final loss), with "skipped": True; with every stage finished, nothing is
    prepared or started.
    prepared: the result of `prepare(cfg)` when the caller already has it (skips doing it again)."""
    bad = [s for s in stages if s not in STAGES]
    if bad:
        raise ValueError(f"stages: {bad} unknown; choose from {list(STAGES)}")
    from hmscale.config import ConfigError, save_resolved
    from hmscale.run_identity import saved_config_mismatch

    cfg = cfg.with_absolute_paths()
    run_dir = Path(run_dir or cfg.output_dir).resolve()
    refusal = saved_config_mismatch(run_dir, cfg)  # before config.yaml is replaced: another run's, or this one's
    if refusal:
        raise ConfigError(refusal)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_resolved(cfg, run_dir)
    finished = [s for s in stages if _stage_done(run_dir, s)]
    for s in finished:
        log(f"[distill] {s}: already done in {run_dir} (skipped)")
    if len(finished) == len(stages):  # nothing to train: no data, teacher, cache or workers
        return {**{s: _recorded(run_dir, s) for s in finished}, "seconds": 0.0, "run_dir": str(run_dir)}
    todo = tuple(s for s in stages if s not in finished)
    if cfg.parallel.engine == "ray" and prepared is None:
        from hmscale.ray_cluster import connect

        # one cluster for the cache's teacher-forward actors and the trainer: joined (or started) now, the cache joins
        # it too, where it would otherwise start an embedded cluster of its own and tear it down before training
        connect(cfg.parallel.ray_address, log=log)
    prep = prepared if prepared is not None else prepare(cfg, log=log, stages=todo)
    # (the workers' inputs absolute: Ray Train runs them in another working directory)
    config = {"cfg": cfg.with_absolute_inputs().model_dump(mode="json"), "run_dir": str(run_dir),
              "cache_dir": prep["cache_dir"], "fault": os.environ.get(FAULT_ENV), "stages": list(stages)}
    t0 = time.perf_counter()
    if trains_in_driver(cfg):
        from hmscale.ray_cluster import process_cpus

        # every core, or the CPUs of the Ray task this runs in (a sweep's size: `scaling.sweep.run_size`)
        config["threads"] = 0 if cfg.parallel.use_gpu else process_cpus()
        import torch.nn.functional as F

        linear = F.linear
        try:
            res = train_func({**config, "prepared": prep})  # (in this process: the driver's data and teacher)
        finally:
            # a ZeRO-3 engine replaces torch's F.linear by DeepSpeed's zero3_linear_wrap for the rest of the process:
            # what this process computes next (the recipe's evaluation) must not depend on the training's ZeRO stage
            F.linear = linear
        res = {k: {kk: vv for kk, vv in v.items() if kk != "student_model"} for k, v in res.items()}
    else:
        # the workers load their own teacher: the driver's (on the GPU with use_gpu, beside worker 0's, or on a Ray
        # head that lends its GPUs to the workers) goes before they start; the caller hands over its references
        from hmscale.train.common import free_released_memory

        prep.pop("teacher", None)
        free_released_memory()
        if cfg.parallel.engine == "local":
            res = _run_local_workers(cfg, config, run_dir, log=log)
        else:
            res = _run_ray(cfg, config, run_dir, storage_path=storage_path, log=log)
    for s in finished:  # what a finished stage recorded when it ran (every engine: one process, local workers, Ray)
        res[s] = _recorded(run_dir, s)
    res["seconds"] = time.perf_counter() - t0
    res["run_dir"] = str(run_dir)
    return res


def trains_in_driver(cfg) -> bool:
    """Whether the stages run in the driver's own process (engine=local, one worker), on its data and teacher."""
    return cfg.parallel.engine == "local" and cfg.parallel.num_workers == 1


def _local_worker(rank: int, config: dict) -> None:
    """One spawned process of engine=local with num_workers > 1: a deterministic failure is written
    down for the driver (rank 0), as under Ray."""
    from hmscale.config import ConfigError
    from hmscale.train.engine import TrainingError

    try:
        train_func(config)
    except (TrainingError, ConfigError) as err:  # every rank: the one that exits first stops the others, rank 0 perhaps unrecorded
        _record_error(Path(config["run_dir"]), err, rank)
        raise


def _run_local_workers(cfg, config: dict, run_dir: Path, *, log=print) -> dict:
    """engine=local, num_workers > 1: one spawned process per worker on this machine (one per GPU with
    use_gpu), torchrun-style; no Ray. A rerun into the same run directory resumes."""
    from hmscale.train.engine import TrainingError
    from hmscale.train.launch import WorkerFailed, spawn_workers

    par = cfg.parallel
    config = dict(config, threads=0 if par.use_gpu else max(1, (os.cpu_count() or 1) // par.num_workers))
    zero = par.zero  # (a ds_config file's own stage, when it names one)
    log(f"[distill] engine=local: {par.num_workers} worker processes on this machine "
        f"({'one GPU each, NCCL' if par.use_gpu else 'CPU, gloo'}; tp={par.tp}, ZeRO-{zero})")
    _clear_recorded_errors(run_dir)
    try:
        spawn_workers(_local_worker, par.num_workers, config, use_gpu=par.use_gpu)
    except WorkerFailed as failed:
        _raise_recorded_error(run_dir, failed.rank)  # a TrainingError a worker wrote down: its one line
        if failed.worker_traceback is None:
            raise TrainingError(str(failed)) from None  # a worker that died: one line
        # an unexpected error (a bug, a refusal the config could not see): its traceback where it happened, to stderr
        # (as Ray's workers' reach the driver's), then the one line, chained to that traceback
        print(f"[distill] local worker {failed.rank} raised:\n{failed.worker_traceback.rstrip()}", file=sys.stderr,
              flush=True)
        raise TrainingError(str(failed)) from failed
    return _stage_summaries(run_dir, config["stages"])


def workers_failed_line(err: BaseException, max_failures: int) -> str:
    """One line for a Ray Train run whose workers failed past ``parallel.max_failures`` restarts: what Ray says first
    (its error's first lines, less the ``[Rank N Error Snippet]:`` headers), then what to do."""
    text: list[str] = []
    for ln in str(err).splitlines():
        ln = ln.strip().rstrip(":")
        if ln and not ln.startswith("[Rank ") and ln not in text:
            text.append(ln)
    what = ": ".join(text[:2]) if text else "no message"
    if len(what) > 300:
        what = what[:297] + "..."
    return (f"the Ray Train workers failed past the restarts parallel.max_failures={max_failures} allows "
            f"({type(err).__name__}: {what}); the checkpoints written so far are kept: rerun into the same output_dir "
            "to resume from the last one (once the cluster has the workers' resources again), or raise "
            "parallel.max_failures")


def _run_ray(cfg, config: dict, run_dir: Path, *, storage_path=None, log=print) -> dict:
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig, TrainingFailedError
    from ray.train.torch import TorchConfig, TorchTrainer

    from hmscale.ray_cluster import connect
    from hmscale.train.engine import TrainingError

    connect(cfg.parallel.ray_address, log=log)
    _check_ray_workers(cfg, log)
    par = cfg.parallel
    config = dict(config, ray=True, threads=max(1, (os.cpu_count() or 1) // par.num_workers))
    # Ray Train (2.60) replaces a worker's print with one that writes the line and logs it again to stderr whenever
    # sys.stdout is wrapped, as it is in Ray's workers: every line a worker printed ("[distill] resuming stage2 ...",
    # the stages' warnings) reached the log twice. Ray Train hands this switch from the driver to its workers
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    trainer = TorchTrainer(
        train_func,
        train_loop_config=config,
        torch_config=TorchConfig(backend="nccl" if par.use_gpu else "gloo"),
        scaling_config=ScalingConfig(num_workers=par.num_workers, use_gpu=par.use_gpu,
                                     resources_per_worker=None if par.use_gpu else {"CPU": 1}),
        run_config=RunConfig(
            name=f"distill-{run_dir.name}-{int(time.time())}",
            storage_path=str(storage_path or (run_dir / "ray")),
            failure_config=FailureConfig(max_failures=par.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=par.keep_checkpoints),
        ),
    )
    (run_dir / ERROR_FILE).unlink(missing_ok=True)
    sigint = signal.getsignal(signal.SIGINT)
    try:
        result = trainer.fit()
        failure = result.error
    except TrainingFailedError as err:  # (Ray Train's fit() raises its result's error itself)
        result, failure = None, err
    except SystemExit:
        # Ctrl-C: fit()'s own SIGINT handler aborts the run's workers and then exits through sys.exit, which Ray's
        # interrupted get turns into SystemExit(1): an interrupt, so the recipe says how to resume (not a silent end)
        raise KeyboardInterrupt from None
    finally:
        # fit() installs its own SIGINT handler (Ctrl-C: abort this run) and leaves it: afterwards a Ctrl-C in this
        # process (the recipe's evaluation) only asked the finished run to abort, and the handler kept its controller
        # actor alive for as long as the process lived
        if (sigint is not None and signal.getsignal(signal.SIGINT) is not sigint
                and threading.current_thread() is threading.main_thread()):  # (only the main thread may set it)
            signal.signal(signal.SIGINT, sigint)
    if failure is not None:
        _raise_recorded_error(run_dir)  # a deterministic worker error, recorded by the worker, wins
        # workers that died (a node lost, a killed process) once the restarts FailureConfig allows are used up: Ray
        # Train raises its multi-line WorkerGroupError; the run stops with one line, as the local engine's does
        raise TrainingError(workers_failed_line(failure, par.max_failures)) from None
    _raise_recorded_error(run_dir)
    return {"ray_metrics": result.metrics, "checkpoint": result.checkpoint.path if result.checkpoint else None,
            **_stage_summaries(run_dir, config["stages"])}


def summary_line(res: dict) -> str:
    """One line for the user: each stage's final loss and where its result is; a finished stage that was
    skipped says so (with the loss it recorded when it ran)."""
    run_dir = Path(res["run_dir"])
    parts = []
    for stage, n, what, where in (("stage1", 1, "student", run_dir / "stage1" / "student"),
                                  ("stage2", 2, "model", run_dir / "stage2" / "hf")):
        if stage not in res:
            continue
        s = res[stage]
        loss = s.get("final_loss")
        loss = f"{loss:.4g}" if isinstance(loss, (int, float)) else "n/a"
        if s.get("skipped"):
            parts.append(f"stage-{n} already done (skipped; loss {loss}), {what} in {where}")
        else:
            parts.append(f"stage-{n} loss {loss}, {what} in {where}")
    ran = [s for s in STAGES if s in res and not res[s].get("skipped")]
    head = f"[distill] done in {res['seconds']:.1f} s" if ran or not parts else "[distill] nothing to train"
    return head + (": " + "; ".join(parts) if parts else "")


def main(argv: list[str] | None = None) -> int:
    from hmscale.config import ConfigError, load_config, stage1_cache_problem
    from hmscale.train.engine import TrainingError

    ap = argparse.ArgumentParser(prog="python -m ray_jobs.distill", description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=None, help="YAML config (default: the embedded demo)")
    ap.add_argument("-s", "--set", dest="overrides", action="append", default=[], help="section.field=value (repeatable)")
    ap.add_argument("--run-dir", default=None, help="default: output_dir of the config")
    ap.add_argument("--stages", default="stage1,stage2", help="comma-separated subset of stage1,stage2")
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        from hmscale.submit import job_copy_refusal

        if args.run_dir is None and (refusal := job_copy_refusal(cfg)) is not None:
            raise ConfigError(refusal)
        if "stage1" in args.stages.split(",") and (problem := stage1_cache_problem(cfg)):
            raise ConfigError(problem)  # before the data, teacher and cache work (as `hmscale run` / `stage1`)
        res = run_distill(cfg, args.run_dir, stages=tuple(args.stages.split(",")))
    except (ConfigError, TrainingError, ValueError) as err:
        print(f"distill: error: {err}", file=sys.stderr)
        return 2
    print(summary_line(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
