"""The recipe repeated over sizes, as Ray tasks with per-size resources, collected into one table.

    rows = run_sweep(["nano", "micro", "mini"], "runs/scale", overrides=["teacher.pretrain_steps=20"])

Per size the sweep builds a RunConfig (teacher = the miniature flavour, or the published hub id;
total tokens from the `BudgetRule` unless the config or overrides set ``budget.total_tokens``, its split
unless they set ``budget.split``; run
directory ``OUT/runs/<size>``; teacher caches under one shared root, ``OUT/cache`` unless
``cache.root`` is given) and runs ``hmscale.recipe.run_recipe`` on it in a Ray task. Caches are
keyed by teacher fingerprint + data-plan hash, so every run (and every rerun, and other sweeps
pointed at the same root) with the same teacher and plan shares one cache.

Resumable: a finished size (its run directory's ``results.json`` holds the final evaluation; the
recipe writes that file stage by stage) is skipped and its results are read back, when that run has this sweep's
training settings (``hmscale.run_identity``, as the recipe decides: ``size_mismatch``). A run directory holding a
run (finished or part-way) of other training settings stops the sweep before any work, with a one-line error
naming the changed settings (another --out, or delete that size's directory); a finished run whose evaluation
settings changed is run again (the recipe redoes only its eval). A failed size is recorded (status ``failed``,
the error) and retried by the next run; the recipe itself resumes inside a size. The table (``OUT/results.csv``, ``OUT/results.json``) is
rewritten atomically after every finished size, and the plots (``OUT/plots/*.png``) at the end.

Resources: by default a size's task asks for ``cpus_per_size`` CPUs and, for a GPU run with the
local engine, one GPU. With ``parallel.engine=ray`` the recipe starts its own Ray Train workers
(which ask for their GPUs), so the size's task is a driver (no GPU). For GPU runs the planner's
layout (workers, tp, ZeRO stage) is put into the config unless the config sets them. Pass
``resources={size: {"num_cpus": .., "num_gpus": ..}}`` (or ``"*"`` for all) to override.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import json
import math
import os
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterable

from hmscale.atomic import atomic_write_json, atomic_write_text
from hmscale.config import RunConfig, apply_overrides, build_config, save_resolved
from hmscale.run_identity import different_run, eval_hash, run_mismatch, training_hash
from scaling.budget import BudgetRule
from scaling.planner import PlanSettings, plan_size
from scaling.registry import Size, get_size, resolve_sizes
from scaling.table import write_csv, write_json

DEFAULT_RECIPE = "hmscale.recipe:run_recipe"
RESULTS = "results.json"

# the leading columns of the results table (more follow: everything numeric the recipe reported)
TABLE_COLUMNS = [
    "size", "status", "params", "published_params", "student_params",
    "teacher_ppl", "hedgehog_ppl", "hedgemamba_ppl", "gap", "gap_ratio",
    "total_tokens", "stage1_tokens", "stage2_tokens", "wall_s", "task_wall_s",
    "wall_prepare_s", "wall_cache_s", "wall_stage1_s", "wall_stage2_s", "wall_eval_s",
    "plan_gpus", "plan_dp", "plan_tp", "plan_zero_stage", "projected_gpu_hours",
    "num_cpus", "num_gpus", "run_dir", "cache_dir", "error",
]


# --------------------------------------------------------------------------- configs


def _has_key(tree: dict, overrides: Iterable[str], dotted: str) -> bool:
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            node = None
            break
        node = node[part]
    if node is not None:
        return True
    return any(o.split("=", 1)[0].strip() == dotted for o in overrides)


def _abs(path: str | None) -> str | None:
    return None if path is None else str(Path(path).expanduser().resolve())


def size_config(
    size: Size | str,
    out_dir: str | os.PathLike,
    base_tree: dict | None = None,
    overrides: Iterable[str] = (),
    rule: BudgetRule | None = None,
    apply_plan: bool | None = None,
) -> RunConfig:
    """The RunConfig of one size in a sweep (see the module docstring)."""
    size = size if isinstance(size, Size) else get_size(size)
    overrides = list(overrides)
    for key, why in (("teacher.flavor", "the sizes pick the teachers: use --sizes"),
                     ("teacher.name_or_path", "the sizes pick the teachers: use --sizes"),
                     ("output_dir", "each size runs in OUT/runs/<size>: use --out")):
        if _has_key({}, overrides, key) or (key == "output_dir" and "output_dir" in (base_tree or {})):
            raise ValueError(f"{key}: set per size by the sweep; {why}")
    out = Path(out_dir).expanduser().resolve()
    tree = copy.deepcopy(base_tree or {})
    teacher = tree.setdefault("teacher", {})
    teacher["flavor"] = size.name
    teacher["name_or_path"] = None if size.miniature else size.hub_id
    rule = rule or BudgetRule()
    if not _has_key(tree, overrides, "budget.total_tokens"):
        tree.setdefault("budget", {})["total_tokens"] = rule.total_tokens(size.flavor)
    if not _has_key(tree, overrides, "budget.split"):  # the rule's split (--split) applies whoever set the total
        tree.setdefault("budget", {})["split"] = list(rule.split)
    if not _has_key(tree, overrides, "cache.root"):
        tree.setdefault("cache", {})["root"] = str(out / "cache")
    if not _has_key(tree, overrides, "data.cache_dir"):
        tree.setdefault("data", {})["cache_dir"] = str(out / "data-cache")
    tree = apply_overrides(tree, overrides)
    tree["output_dir"] = str(out / "runs" / size.name)
    if not _has_key(base_tree or {}, overrides, "parallel.engine"):
        # each size already runs as a Ray task: its recipe runs in that task unless it needs several GPUs
        tree.setdefault("parallel", {})["engine"] = "local"
    cfg = build_config(tree)
    # workers may start in another directory: make the shared paths absolute
    cfg.cache.root = _abs(cfg.cache.root)
    cfg.data.cache_dir = _abs(cfg.data.cache_dir)
    if apply_plan is None:
        apply_plan = cfg.parallel.use_gpu
    user_set = any(_has_key(base_tree or {}, overrides, k) for k in ("parallel.tp", "parallel.zero_stage", "parallel.num_workers"))
    if apply_plan and not user_set:
        p = plan_size(size, PlanSettings.from_run_config(cfg))
        tree2 = cfg.model_dump(mode="json")
        tree2["parallel"].update(tp=p.tp, zero_stage=p.zero_stage, num_workers=p.gpus)
        if p.gpus > 1:
            tree2["parallel"]["engine"] = "ray"  # Ray Train workers hold the GPUs; the task is their driver
        cfg = build_config(tree2)
    return cfg


def default_resources(cfg: RunConfig, cpus_per_size: float = 1) -> dict:
    par = cfg.parallel
    if par.engine == "ray":
        return {"num_cpus": cpus_per_size, "num_gpus": 0}
    return {"num_cpus": cpus_per_size, "num_gpus": 1 if par.use_gpu else 0}


# --------------------------------------------------------------------------- results


def _flatten(obj: Any, prefix: str = "") -> dict:
    out: dict = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}{k}_"))
    else:
        out[prefix[:-1]] = obj
    return out


def _num(x) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _pick(flat: dict, *names: str):
    for n in names:
        if n in flat and _num(flat[n]) is not None:
            return _num(flat[n])
    return None


def _read_results(path: Path) -> dict | None:
    try:
        res = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return res if isinstance(res, dict) else None


def finished_results(path: str | os.PathLike) -> dict | None:
    """The results of a finished size, else None.

    The recipe writes results.json stage by stage, so "finished" means it holds the final evaluation
    (``hedgemamba_ppl``, a number: NaN or inf too, what a diverged student evaluates to and the recipe keeps); a
    partial one is resumed by the recipe itself.
    """
    res = _read_results(Path(path))
    ppl = None if res is None else res.get("hedgemamba_ppl")
    return res if isinstance(ppl, (int, float)) and not isinstance(ppl, bool) else None


def size_mismatch(name: str, cfg: RunConfig) -> str | None:
    """The one-line refusal when the size's run directory holds a run (finished or part-way) of other training
    settings than ``cfg``'s, else None: the recipe's own test (``hmscale.recipe._load_results``: the stored
    ``config_hash`` against ``training_hash``, else the saved config.yaml: ``hmscale.run_identity.run_mismatch``),
    made before any size runs, so that a study neither reuses stale results nor fails size by size."""
    cfg = cfg.with_absolute_paths()  # what the recipe hashes
    run_dir = Path(cfg.output_dir)
    results = _read_results(run_dir / RESULTS)
    if results is None and not (run_dir / "config.yaml").exists():
        return None  # no run yet (or an unreadable results.json: the recipe reports that itself)
    # without results.json (a run killed before its first record) config.yaml alone says which run it is
    diff = run_mismatch(run_dir, None if results is None else results.get("config_hash"), cfg)
    if diff is None:
        return None
    return different_run(run_dir, diff, what=name, finished=finished_results(run_dir / RESULTS) is not None,
                         fix=f"use another --out for these settings, or delete {run_dir} to run {name} again with them")


def eval_current(results: dict, cfg: RunConfig) -> bool:
    """Whether a finished run's evaluation used ``cfg``'s evaluation settings (the recipe redoes its eval stage
    when they changed; results without the recipe's per-stage records count as current)."""
    stages = results.get("stages")
    if not isinstance(stages, dict) or not isinstance(stages.get("eval"), dict):
        return True
    return stages["eval"].get("eval_hash") == eval_hash(cfg)


def summarize(size: Size, cfg: RunConfig, results: dict) -> dict:
    """One table row from a recipe's results dict (tolerant to nesting: `tokens: {stage1: ..}` etc.)."""
    flat = {k: v for k, v in _flatten(results).items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    row: dict = {}
    row["teacher_ppl"] = _pick(flat, "teacher_ppl", "ppl_teacher", "perplexity_teacher", "teacher_perplexity")
    row["hedgehog_ppl"] = _pick(flat, "hedgehog_ppl", "ppl_hedgehog", "perplexity_hedgehog", "hedgehog_perplexity")
    row["hedgemamba_ppl"] = _pick(flat, "hedgemamba_ppl", "ppl_hedgemamba", "perplexity_hedgemamba", "hedgemamba_perplexity")
    t, s = row["teacher_ppl"], row["hedgemamba_ppl"]
    row["gap"] = None if t is None or s is None else s - t
    row["gap_ratio"] = None if not t or s is None else s / t
    s1 = _pick(flat, "stage1_tokens", "tokens_stage1", "stage1_tokens_seen", "stage1_tokens_trained")
    s2 = _pick(flat, "stage2_tokens", "tokens_stage2", "stage2_tokens_seen", "stage2_tokens_trained")
    row["stage1_tokens"] = int(s1) if s1 is not None else cfg.budget.stage1_tokens
    row["stage2_tokens"] = int(s2) if s2 is not None else cfg.budget.stage2_tokens
    tot = _pick(flat, "total_tokens", "tokens_total")
    row["total_tokens"] = int(tot) if tot is not None else row["stage1_tokens"] + row["stage2_tokens"]
    stages = results.get("stages") if isinstance(results.get("stages"), dict) else {}
    for st, rec in stages.items():  # the recipe's per-stage records: {"seconds": .., "tokens": ..}
        if isinstance(rec, dict) and _num(rec.get("seconds")) is not None:
            row[f"wall_{st}_s"] = _num(rec["seconds"])
    vocab = _num((stages.get("prepare") or {}).get("vocab_size")) if isinstance(stages.get("prepare"), dict) else None
    if vocab and size.miniature:
        from scaling.planner import count_params

        row["params"] = count_params(size.flavor, int(vocab))
    for st, rec in stages.items():  # where the teacher cache of this run lives
        if isinstance(rec, dict) and (rec.get("cache_dir") or (st == "cache" and rec.get("dir"))):
            row["cache_dir"] = rec.get("cache_dir") or rec.get("dir")
    if isinstance(results.get("cache_dir"), str):
        row["cache_dir"] = results["cache_dir"]
    wall = _pick(flat, "wall_s", "wall_seconds", "wall_time_s", "total_wall_s", "wall_total", "wall_time_total", "wall_s_total", "total_s")
    if wall is None and stages:
        wall = sum(v for k, v in row.items() if k.startswith("wall_") and k.endswith("_s")) or None
    if wall is None:
        walls = [v for k, v in flat.items() if ("wall" in k or k.endswith("_s") or "seconds" in k) and "total" not in k and not k.startswith("_")]
        wall = sum(walls) if walls else None
    row["wall_s"] = wall
    row["task_wall_s"] = _pick(flat, "_sweep_task_wall_s")
    n = _pick(flat, "teacher_params", "params_teacher", "teacher_n_params")
    if n is not None:
        row["params"] = int(n)
    for k, v in flat.items():  # the recipe's other top-level numbers, for the record
        if k in results and k not in row and not k.startswith("_") and k != "config_hash":
            row[f"r_{k}"] = v if _num(v) is not None else None  # (NaN / inf: JSON has no such number)
    return row


# --------------------------------------------------------------------------- the task


def _resolve_recipe(recipe: str | Callable) -> Callable:
    if callable(recipe):
        return recipe
    mod, _, attr = recipe.partition(":")
    return getattr(importlib.import_module(mod), attr or "run_recipe")


def run_size(cfg_tree: dict, recipe: str | Callable = DEFAULT_RECIPE, tag: str = "") -> dict:
    """Run the recipe for one size (inside a Ray task or in-process); returns its results dict."""
    cfg = RunConfig.model_validate(cfg_tree)
    fn = _resolve_recipe(recipe)

    def log(*args, **kw):
        print(f"[{tag}]", *args, flush=True)

    t0 = time.time()
    results = fn(cfg, log=log)
    results = dict(results or {})
    run_dir = Path(cfg.output_dir)
    # a recipe that only returns, or keeps no run identity: keep the sweep resumable anyway (results.json with the
    # settings' key and config.yaml, as hmscale.recipe writes them, so that a rerun can tell it is the same run)
    on_disk = _read_results(run_dir / RESULTS)
    if on_disk is None or "config_hash" not in on_disk:
        atomic_write_json(run_dir / RESULTS, {**(results if on_disk is None else on_disk),
                                              "config_hash": training_hash(cfg.with_absolute_paths())})
    if not (run_dir / "config.yaml").exists():
        save_resolved(cfg, run_dir)
    results.setdefault("_sweep_task_wall_s", time.time() - t0)
    return results


def prepare_shared_data(cfg_tree: dict, tag: str = "") -> str:
    """Tokenizer + tokenised stream for a group of sizes sharing data and tokenizer settings, built once.

    The recipe would build them itself; doing it first keeps concurrent sizes from repeating the work
    (entries are content-addressed and appear atomically, so a race is only wasted time).
    """
    cfg = RunConfig.model_validate(cfg_tree)
    from hmscale.data import prepare_data

    bundle = prepare_data(cfg, log=lambda *a, **k: print(f"[{tag}]", *a, flush=True))
    return str(bundle.plan.hash)


# --------------------------------------------------------------------------- the sweep


def _check_resources(resources: dict | None) -> dict:
    """Per-size resources keyed by canonical size name (short names like "12b" or "nano" too, as --sizes takes them)
    or "*"; each value a dict of Ray task options. One-line ValueError otherwise, before any work."""
    from scaling.registry import canonical_name

    if resources is None:
        return {}
    if not isinstance(resources, dict):
        raise ValueError(f"resources: {resources!r} must be a JSON object {{size or \"*\": {{\"num_cpus\": .., \"num_gpus\": ..}}}}")
    out: dict = {}
    for key, value in resources.items():
        if not isinstance(value, dict):
            raise ValueError(f"resources: {key!r} must map to an object of task options, e.g. {{\"num_cpus\": 2, \"num_gpus\": 1}}, "
                             f"not {value!r}")
        try:
            name = "*" if key == "*" else canonical_name(str(key))
        except ValueError as err:
            raise ValueError(f"resources: {err}") from None
        out.setdefault(name, {}).update(value)
    return out


def _task_options(name: str, res: dict) -> dict:
    """The Ray task options of a size: the sweep's defaults (task name, one retry) under ``res`` (the user's win), as
    ``ray.remote(...).options`` takes them; a misspelt option or a bad value is a one-line ValueError now, before any
    work (at submission it came after the cluster's start and other sizes' submissions, or as a TypeError)."""
    opts = {"name": f"hmscale-scale-{name}", "max_retries": 1, "retry_exceptions": False, **res}
    try:
        import ray
    except ImportError:  # (the local engine needs no Ray)
        return opts
    try:
        ray.remote(run_size).options(**opts)
    except (TypeError, ValueError) as err:
        why = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ValueError(f"resources of {name} (--resources, --cpus-per-size): {why}") from None
    return opts


def _ensure_ray(address: str | None, num_cpus: int | None):
    import ray

    from hmscale.ray_cluster import connect

    connect(address, num_cpus=num_cpus)
    return ray


def run_sweep(
    sizes: str | Iterable[str] | None,
    out_dir: str | os.PathLike,
    overrides: Iterable[str] = (),
    base_tree: dict | None = None,
    rule: BudgetRule | None = None,
    engine: str = "ray",
    ray_address: str | None = None,
    ray_num_cpus: int | None = None,
    cpus_per_size: float = 1,
    resources: dict | None = None,
    recipe: str | Callable = DEFAULT_RECIPE,
    plan_settings: PlanSettings | None = None,
    plots: bool = True,
    warm_data: bool = True,
    log: Callable = print,
) -> list[dict]:
    """Run (or resume) a sweep; returns the table rows, one per size, in the order asked."""
    if engine not in ("ray", "local"):
        raise ValueError(f"engine {engine!r} must be ray or local")
    out = Path(out_dir).expanduser().resolve()
    if out.exists() and not out.is_dir():  # (else os.mkdir's FileExistsError, after the configs and the size checks)
        raise ValueError(f"--out: {str(out_dir)!r} is a file; give the sweep a directory (new, or one of an earlier "
                         "sweep to resume it)")
    overrides = list(overrides)
    sizes_ = resolve_sizes(sizes if sizes is None or isinstance(sizes, str) else list(sizes))
    resources = _check_resources(resources)
    rule = rule or BudgetRule()
    cfgs = {s.name: size_config(s, out, base_tree, overrides, rule) for s in sizes_}
    for s in sizes_:  # before any work: a size directory holding a run of other settings stops the study
        problem = size_mismatch(s.name, cfgs[s.name])
        if problem:
            raise ValueError(problem)
    res_of: dict[str, dict] = {}
    task_options: dict[str, dict] = {}
    for s in sizes_:  # the Ray task options of every size, checked by Ray's rules now (not at submission)
        res = dict(default_resources(cfgs[s.name], cpus_per_size))
        res.update(resources.get("*", {}))
        res.update(resources.get(s.name, {}))
        res_of[s.name] = res
        task_options[s.name] = _task_options(s.name, res)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "sweep.json", {
        "sizes": [s.name for s in sizes_], "overrides": overrides, "base": base_tree or {},
        "budget_rule": dataclasses.asdict(rule),  # --budget-fraction, --split (a total or split the config sets wins)
        "recipe": recipe if isinstance(recipe, str) else f"{recipe.__module__}:{recipe.__qualname__}",
    })
    others = sorted(d.name for d in (out / "runs").glob("*") if d.is_dir() and d.name not in cfgs
                    and finished_results(d / RESULTS) is not None)
    if others:  # the table and plots are rewritten with this invocation's sizes only
        log(f"[scale] {out / 'runs'} also holds finished {', '.join(others)}, not in --sizes: results.csv, results.json "
            "and the plots will leave them out; list every size (e.g. --sizes " + ",".join([*others, *cfgs])
            + ") to keep them in the table")

    rows: dict[str, dict] = {}
    plans: dict[str, Any] = {}
    for s in sizes_:
        cfg = cfgs[s.name]
        res = res_of[s.name]
        settings = plan_settings or PlanSettings.from_run_config(cfg)
        try:
            from scaling.budget import Budget

            plans[s.name] = plan_size(s, settings, Budget(cfg.budget.total_tokens, tuple(cfg.budget.split)))
        except ValueError as err:  # does not fit: still run it, without a projection
            log(f"[scale] {s.name}: no plan ({err})")
            plans[s.name] = None
        rows[s.name] = _base_row(s, cfg, plans[s.name], res)

    def finish(name: str, results: dict | None, status: str, error: str | None = None):
        row = rows[name]
        row["status"] = status
        row["error"] = error
        if results is not None:
            row.update(summarize(next(x for x in sizes_ if x.name == name), cfgs[name], results))
        _write_table(out, [rows[s.name] for s in sizes_])

    todo = []
    for s in sizes_:
        res_path = Path(cfgs[s.name].output_dir) / RESULTS
        prior = finished_results(res_path)
        if prior is not None and eval_current(prior, cfgs[s.name]):
            log(f"[scale] {s.name}: finished earlier with these settings ({res_path}); skipping")
            finish(s.name, prior, "skipped")
        else:
            if prior is not None:
                log(f"[scale] {s.name}: evaluation settings changed; the recipe evaluates it again")
            todo.append(s)
            rows[s.name]["status"] = "pending"
    _write_table(out, [rows[s.name] for s in sizes_])

    if engine == "local":
        for s in todo:
            log(f"[scale] {s.name}: running in-process")
            try:
                finish(s.name, run_size(cfgs[s.name].model_dump(mode="json"), recipe, s.name), "done")
            except Exception as err:  # noqa: BLE001 - one size failing must not stop the others
                log(f"[scale] {s.name}: failed: {err}")
                finish(s.name, None, "failed", f"{type(err).__name__}: {err}")
                atomic_write_text(out / "runs" / s.name / "sweep_error.txt", traceback.format_exc())
    elif todo:
        ray = _ensure_ray(ray_address, ray_num_cpus)
        if callable(recipe):
            _pickle_by_value(recipe)
        if warm_data:
            _warm(ray, [cfgs[s.name] for s in todo], cpus_per_size, log)
        remote = ray.remote(run_size)
        pending = {}
        try:
            for s in todo:
                r = res_of[s.name]
                log(f"[scale] {s.name}: submitting (num_cpus={r['num_cpus']}, num_gpus={r['num_gpus']})")
                ref = remote.options(**task_options[s.name]).remote(cfgs[s.name].model_dump(mode="json"), recipe,
                                                                    s.name)
                pending[ref] = s.name
            while pending:
                ready, _ = ray.wait(list(pending), num_returns=1)
                for ref in ready:
                    name = pending.pop(ref)
                    try:
                        finish(name, ray.get(ref), "done")
                        log(f"[scale] {name}: done")
                    except Exception as err:  # noqa: BLE001
                        msg = str(err).strip().splitlines()
                        log(f"[scale] {name}: failed: {msg[-1] if msg else err!r}")
                        finish(name, None, "failed", f"{type(err).__name__}: {msg[-1] if msg else ''}")
        finally:
            # stopped part-way (Ctrl-C, a table that could not be written): the sizes still running would train on,
            # holding their CPUs (GPUs), for as long as this process lives; stopped (force: Ray's plain cancel left a
            # running task running), a rerun resumes each from its last checkpoint
            for ref in pending:
                try:
                    ray.cancel(ref, force=True)
                except Exception:  # noqa: BLE001 - (finished meanwhile): the error that stopped the loop goes on up
                    pass
    table = [rows[s.name] for s in sizes_]
    _write_table(out, table)
    if plots:
        from scaling.plots import plot_all

        plot_all(table, [p.row() for p in plans.values() if p is not None], out / "plots")
    return table


def _warm(ray, cfgs: list[RunConfig], num_cpus: float, log: Callable) -> None:
    """One data-preparation task per distinct (data, tokenizer) setting; failures are left to the sizes."""
    groups: dict[str, RunConfig] = {}
    for c in cfgs:
        groups.setdefault(c.hash("data", "tokenizer"), c)
    if len(cfgs) < 2 or not groups:
        return
    try:
        import hmscale.data as data_mod

        if not hasattr(data_mod, "prepare_data"):
            return
    except Exception:  # noqa: BLE001
        return
    task = ray.remote(prepare_shared_data)
    refs = {task.options(num_cpus=num_cpus, num_gpus=0, name="hmscale-scale-data").remote(c.model_dump(mode="json"), "data"): k
            for k, c in groups.items()}
    for ref, key in refs.items():
        try:
            ray.get(ref)
            log(f"[scale] shared data {key}: ready")
        except Exception as err:  # noqa: BLE001
            log(f"[scale] shared data {key}: preparation failed ({str(err).strip().splitlines()[-1:]}); sizes will retry it")


def _pickle_by_value(fn: Callable) -> None:
    """Ship a recipe callable from outside the installed packages (a test, a notebook) by value."""
    import sys

    name = getattr(fn, "__module__", "") or ""
    mod = sys.modules.get(name)
    if mod is None or name == "__main__" or name.split(".")[0] in ("hmscale", "scaling", "ray_jobs", "kernels"):
        return
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(mod)


def _base_row(size: Size, cfg: RunConfig, plan, res: dict) -> dict:
    from scaling.planner import count_params

    row = {k: None for k in TABLE_COLUMNS}
    row.update(
        size=size.name,
        status="pending",
        params=count_params(size.flavor, _teacher_vocab(cfg)),
        published_params=size.published_params,
        total_tokens=cfg.budget.total_tokens,
        stage1_tokens=cfg.budget.stage1_tokens,
        stage2_tokens=cfg.budget.stage2_tokens,
        num_cpus=res.get("num_cpus"),
        num_gpus=res.get("num_gpus"),
        run_dir=cfg.output_dir,
    )
    if plan is not None:
        row.update(
            student_params=plan.student_params,
            plan_gpus=plan.gpus, plan_dp=plan.dp, plan_tp=plan.tp, plan_zero_stage=plan.zero_stage,
            projected_gpu_hours=plan.gpu_hours_total,
        )
    return row


def _teacher_vocab(cfg: RunConfig) -> int | None:
    """A miniature teacher's vocabulary is the tokenizer's; a published one keeps its own."""
    if cfg.teacher.name_or_path is None and cfg.tokenizer.name_or_path is None:
        return cfg.tokenizer.vocab_size
    return None


def _write_table(out: Path, rows: list[dict]) -> None:
    cols = list(TABLE_COLUMNS)
    for r in rows:
        cols += [k for k in r if k not in cols]
    write_csv(out / "results.csv", rows, cols)
    write_json(out / "results.json", rows)
