"""The whole HedgeMamba recipe from one resolved config into one run directory.

    data -> teacher -> cache -> stage 1 (Hedgehog) -> stage 2 (HedgeMamba) -> eval -> report

Run directory (`cfg.output_dir`):
    config.yaml      the resolved config
    results.json     per-stage records as they finish, then teacher/hedgehog/hedgemamba perplexity
    stage1/ stage2/  each stage's checkpoints, metrics.jsonl, TensorBoard logs and exports
    model/           the final HedgeMamba model + tokenizer (HF format, `from_pretrained`-able)
    report.md, *.png the results table and plots

Resumable stage by stage: a stage recorded in results.json is skipped on a rerun; an interrupted
stage resumes from its own last checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

from hmscale.atomic import (atomic_write_json, flock_waiting, remove_temporaries, storage_error_line,
                            writable_dir_problem)
from hmscale.config import RunConfig, save_resolved, stage1_cache_problem, unused_settings
from hmscale.hf_load import from_pretrained
from hmscale.run_identity import different_run, eval_hash, run_mismatch, saved_config_mismatch, training_hash


class RecipeError(RuntimeError):
    pass


def _load_results(run_dir: Path, cfg: RunConfig) -> dict:
    path = run_dir / "results.json"
    if not path.exists():  # no recipe run here yet; the stage commands may have trained one (config.yaml says which)
        refusal = saved_config_mismatch(run_dir, cfg)
        if refusal:
            raise RecipeError(refusal)
        return {"config_hash": training_hash(cfg), "stages": {}}
    try:
        results = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        results = err
    if not (isinstance(results, dict) and isinstance(results.get("stages"), dict)):
        why = f"not JSON ({results})" if isinstance(results, Exception) else "not a results object with its stages"
        raise RecipeError(f"{path} is damaged ({why}); move it away and rerun: the finished training stages are "
                          "kept in stage1/ and stage2/ (their summaries) and only the evaluation is redone")
    if results.get("config_hash") != training_hash(cfg):
        _check_identity(run_dir, results.get("config_hash"), cfg)
        # the run's key was computed from its config.yaml by an older hmscale (fields added since, or other key
        # rules) and its training settings are this config's: the same run, under the current key, adopted now
        # (config.yaml is rewritten next and could not vouch for it again)
        results["config_hash"] = training_hash(cfg)
        atomic_write_json(path, results)
    if "eval" in results["stages"] and results["stages"]["eval"].get("eval_hash") != eval_hash(cfg):
        del results["stages"]["eval"]  # the evaluation settings changed (or were not recorded): evaluate again
    return results


def _check_identity(run_dir: Path, stored_hash: str | None, cfg: RunConfig, **fix) -> None:
    """Refuse (one line) when the run in ``run_dir`` (its stored key, or its config.yaml) has other training settings
    than ``cfg`` (``fix``: ``different_run``'s advice, when not the default)."""
    diff = run_mismatch(run_dir, stored_hash, cfg)
    if diff is not None:
        raise RecipeError(different_run(run_dir, diff, **fix))


def adopt_stage1(source: Path, cfg: RunConfig) -> str:
    """Start ``cfg``'s run (``cfg.output_dir``, absolute paths) from the finished stage 1 of the run in ``source``:
    one stage 1 for several stage-2 ablations. Every training setting but ``stage2.*`` must match (else one line
    naming them); the stage's student, summary and metrics are copied in, not its checkpoints; an
    identical stage 1 already there is kept. Returns what was done, for the log."""
    from hmscale.run_identity import changed_settings, saved_tree
    from ray_jobs.distill import _stage_done

    source, run_dir = Path(source).resolve(), Path(cfg.output_dir).resolve()
    if not _stage_done(source, "stage1"):
        raise RecipeError(f"--stage1-from: {source} holds no finished stage 1 (stage1/summary.json with done); "
                          "run `hmscale stage1` there first")
    tree = saved_tree(source)
    if tree is None:
        raise RecipeError(f"--stage1-from: {source} has no readable config.yaml, so its stage 1 cannot be matched")
    diff = [d for d in changed_settings(tree, cfg, run_inputs_dir(source)) if not d.startswith("stage2.")]
    if diff:
        raise RecipeError(f"--stage1-from: {source}'s stage 1 was trained with other settings "
                          f"({', '.join(diff[:4])}{', ...' if len(diff) > 4 else ''}); only stage2.* may differ")
    if cfg.stage1.transfer == "mixer":
        # stage1.transfer=mixer trains the mixers of stage2.components: stage 2 can only start from mixers built
        # with the same components (refused here, before the data, teacher and cache work, not at stage 2's start)
        comp = [d for d in changed_settings(tree, cfg) if d.startswith("stage2.components.")]
        if comp:
            raise RecipeError(f"--stage1-from: {source}'s stage 1 (stage1.transfer=mixer) trained mixers with other "
                              f"components ({', '.join(comp[:4])}); with transfer=mixer stage2.components must match "
                              "(run stage 1 for these components, or use stage1.transfer=attention)")
    if source == run_dir:
        return f"[stage2] stage 1 of {run_dir} is this run's own"
    dst = run_dir / "stage1"
    wanted = (source / "stage1" / "summary.json").read_bytes()
    if dst.exists():
        if (dst / "summary.json").exists() and (dst / "summary.json").read_bytes() == wanted:
            return f"[stage2] stage 1 from {source} already in {run_dir}"
        raise RecipeError(f"--stage1-from: {run_dir} already holds a stage 1 of its own; choose another output_dir")
    tmp = run_dir / ".stage1.adopting"
    shutil.rmtree(tmp, ignore_errors=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    # copies, not links: the two runs' files must not alias (a later edit of one would change the other)
    shutil.copytree(source / "stage1", tmp, ignore=lambda d, names: ["checkpoints"] if Path(d) == source / "stage1" else [])
    tmp.rename(dst)  # whole or absent: a kill before this leaves only the hidden temporary
    return f"[stage2] stage 1 from {source} (its student, summary and metrics; settings but stage2.* the same)"


def check_local_gpu(cfg: RunConfig) -> None:
    """parallel.use_gpu on the local engine needs this Python's torch to see a GPU (the ray engine's workers may run
    elsewhere: there Ray places them)."""
    if cfg.parallel.use_gpu and cfg.parallel.engine == "local":
        import torch

        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else "a CUDA build that sees no GPU"
            raise RecipeError(f"parallel.use_gpu: true, but this torch ({torch.__version__}, {build}) has no GPU; "
                              "set parallel.use_gpu=false, or install the CUDA build (make venv TORCH=cuda) on a GPU "
                              "machine")


def run_recipe(cfg: RunConfig, log=print) -> dict:
    """Run (or resume) every stage; returns the contents of results.json. Ctrl-C says how to resume (on stderr; the
    training loop adds where its stage stands) and goes on up. An embedded Ray cluster the run started is stopped
    once the training is done, and when the run fails."""
    try:
        return _run_recipe_errors(cfg, log)
    finally:
        from hmscale.ray_cluster import stop_embedded

        stop_embedded(log)  # (after a failure too: a notebook's next cell gets the machine back)


def _run_recipe_errors(cfg: RunConfig, log) -> dict:
    """``_run_recipe``, its failures as the one-line errors of the CLI (and the resume line on Ctrl-C)."""
    from hmscale.teacher.cache.format import CacheError

    try:
        return _run_recipe(cfg, log)
    except CacheError as err:  # building or reading the teacher cache (a full disk, a damaged shard): its one line
        if isinstance(err.__cause__, OSError):
            from hmscale.train.engine import StorageError

            raise StorageError(str(err)) from err
        raise RecipeError(str(err)) from err
    except OSError as err:
        # a full disk or a read-only place while writing the data, the teacher, a summary, the export, results.json
        # or report.md: one line (the files written before are whole: atomic writes)
        line = storage_error_line(err, "hmscale run")
        if line is None:
            raise
        from hmscale.train.engine import StorageError

        raise StorageError(line) from err
    except KeyboardInterrupt:
        run_dir = Path(cfg.with_absolute_paths().output_dir)
        print(f"\n[recipe] interrupted; the same `hmscale run` (this config, output_dir {run_dir}) resumes: finished "
              "stages are skipped, an interrupted training stage goes on from its last checkpoint", file=sys.stderr,
              flush=True)
        raise


def _run_recipe(cfg: RunConfig, log=print) -> dict:
    t_start = time.time()
    problem = stage1_cache_problem(cfg)  # here, for `hmscale run` and for a job sent with `hmscale submit` alike
    if problem:
        raise RecipeError(problem)
    check_local_gpu(cfg)
    for line in unused_settings(cfg):
        log(f"[recipe] note: {line}")
    cfg = cfg.with_absolute_paths()
    run_dir = Path(cfg.output_dir)
    problem = writable_dir_problem(run_dir)
    if problem:
        raise RecipeError(f"output_dir: {run_dir}: {problem}; set output_dir to a directory you can write")
    with _one_run_at_a_time(run_dir, log):
        return _run_in(cfg, run_dir, t_start, log)


@contextlib.contextmanager
def _one_run_at_a_time(run_dir: Path, log):
    """An ``flock`` on the run directory itself while a run works in it: a second `hmscale run` into the same output_dir
    (another shell, a rerun started while the first still runs) waits for the first to end, then reads its results and
    skips what it finished, instead of training beside it into the same checkpoints, metrics and exports (and removing
    the temporaries of its live writes). No file is added; released when the process dies. Where the filesystem has no
    file locks (some network mounts), runs go on unlocked as before."""

    fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY)  # (not inherited by spawned processes)
    try:
        flock_waiting(fd, lambda: log(f"[recipe] another `hmscale run` is working in {run_dir}; waiting for it to end "
                                      "(what it finishes is then skipped)"))
        yield
    finally:
        os.close(fd)


def _run_in(cfg: RunConfig, run_dir: Path, t_start: float, log=print) -> dict:
    results = _load_results(run_dir, cfg)  # (refuses another run's directory before anything is touched)
    if cfg.parallel.engine == "ray":
        # the cluster first: an address that cannot be joined (a typo, the dashboard's URL) leaves no config.yaml,
        # which made the corrected rerun with another setting "a run of a different config" that never ran
        from hmscale.ray_cluster import connect

        connect(cfg.parallel.ray_address, log=log)
    for d in (run_dir, run_dir / "stage1", run_dir / "stage2", run_dir / "stage1" / "student"):
        remove_temporaries(d)  # what a killed run's atomic writes left (this run rewrites what it needs)
    save_resolved(cfg, run_dir)
    stages = results["stages"]
    # where relative inputs (data.paths, a teacher folder) are read, for `hmscale eval`: a submitted job's is the
    # uploaded checkout, not Ray's temporary copy of it (deleted once unused)
    from hmscale.submit import SUBMITTED_FROM

    results["inputs_dir"] = os.environ.get(SUBMITTED_FROM) or os.getcwd()

    def record(name: str, t0: float, earlier_seconds: float = 0.0, **info):
        stages[name] = {"seconds": round(time.time() - t0 + earlier_seconds, 2), **info}
        atomic_write_json(run_dir / "results.json", results)
        log(f"[recipe] {name} done in {stages[name]['seconds']:.1f} s")

    def done(name: str) -> bool:
        if name in stages:
            log(f"[recipe] {name}: already done in {run_dir} (skipped)")
            return True
        return False

    from ray_jobs.distill import prepare, run_distill, trains_in_driver

    def check_eval(data):  # now, not after the teacher, its cache and the training
        if cfg.eval.context_length:
            from hmscale.eval.long_context import long_context_rows

            long_context_rows(data.stream_dir, cfg.eval.context_length, max_rows=1)

    t0 = time.time()
    # the teacher cache only for stages still to train: a finished run's rerun (results, other eval.*) reads none
    to_train = tuple(s for s in ("stage1", "stage2") if s not in stages)
    try:  # data plan, teacher (pretrained once and stored), teacher cache
        prep = prepare(cfg, log=log, stages=to_train, check_data=check_eval)
    except ValueError as err:  # the data's and settings' one-line errors ("data.seq_len: ...")
        raise RecipeError(str(err)) from None
    data, teacher = prep["data"], prep["teacher"]
    handed_over = False  # the teacher given to the stages alone (see below): the evaluation loads it again
    if not done("prepare"):
        record("prepare", t0, train_tokens=int(data.plan.total_tokens), val_rows=int(len(data.val_tokens)),
               vocab_size=int(data.vocab_size), cache_dir=prep["cache_dir"])

    if not (done("stage1") and done("stage2")):
        t0 = time.time()
        from hmscale.train.common import stage2_uses_teacher

        prepared = prep
        if not trains_in_driver(cfg) or ("stage2" in to_train and not stage2_uses_teacher(cfg.stage2)):
            # worker processes (which load their own teacher), or a stage 2 that runs no live teacher (KD from the
            # cache, or none): the teacher goes with the stages, whose runner drops it before the workers start, or
            # once stage 2's model is built (it stayed resident, on the GPU with use_gpu, through the training); the
            # evaluation loads it again (the same stored teacher)
            # (`prepared`, the one name left for prepare's dict: the stages' runner takes the teacher out of it)
            teacher, handed_over = None, True
            del prep
        res = run_distill(cfg, run_dir, log=log, prepared=prepared)
        del prepared
        for name in ("stage1", "stage2"):
            summary = res.get(name) or {}
            if name not in stages:
                stages[name] = {"seconds": round(float(summary.get("seconds", 0.0)), 2),
                                "tokens": int(summary.get("tokens", 0)), "summary": _plain(summary)}
        record("distill", t0, earlier_seconds=earlier_seconds(res), engine=cfg.parallel.engine)
    # the evaluation runs in this process: an embedded Ray cluster's processes and object store (the training's, a
    # Ray cache build's) go now
    from hmscale.ray_cluster import stop_embedded

    stop_embedded(log)

    if not done("eval"):
        t0 = time.time()
        from hmscale.train.stage1 import load_stage1_student

        if handed_over:  # (loaded again, as `hmscale eval` loads it: the same stored teacher)
            from hmscale.teacher import get_teacher

            teacher = get_teacher(cfg, data, log=log)
        models = {"teacher": teacher, "hedgehog": load_stage1_student(run_dir, teacher),
                  "hedgemamba": load_final_model(run_dir, data)}
        scores = evaluate_models(cfg, data, models, log=log)
        results["stage1_transfer"] = cfg.stage1.transfer
        results.pop("long_context", None)
        results.pop("samples", None)
        results.update(scores)
        record("eval", t0, eval_hash=eval_hash(cfg), **{k: v for k, v in scores.items() if k.endswith("_ppl")})
    results["wall_seconds"] = round(sum(stages[k].get("seconds", 0) for k in ("prepare", "distill", "eval") if k in stages), 2)
    results["tokens"] = {k: stages[k].get("tokens", 0) for k in ("stage1", "stage2") if k in stages}
    atomic_write_json(run_dir / "results.json", results)
    write_report(run_dir, results, cfg)
    log(f"[recipe] finished in {time.time() - t_start:.1f} s -> {run_dir}/report.md")
    return results


def earlier_seconds(res: dict) -> float:
    """The training seconds of ``run_distill``'s stages spent before this call, which the recipe's distill time counts
    too: all of a stage an earlier (killed) run finished and this one skipped, and a resumed stage's earlier attempts
    (its summary's seconds are over every attempt)."""
    total = 0.0
    for name in ("stage1", "stage2"):
        summary = res.get(name) or {}
        total += float(summary.get("seconds", 0.0) if summary.get("skipped") else summary.get("resumed_seconds", 0.0))
    return total


def load_final_model(run_dir: Path, data=None):
    """The exported HedgeMamba of a run (stage2/hf), copied with the tokenizer into run_dir/model."""
    from transformers import AutoModelForCausalLM

    import hmscale.models  # noqa: F401  (registers HedgeMamba with the Auto classes)

    src, model_dir = Path(run_dir) / "stage2" / "hf", Path(run_dir) / "model"
    if not model_dir.exists():
        if not src.exists():
            raise RecipeError(f"{src} is missing: stage 2 did not export its model; rerun `hmscale run` to resume it")
        tmp = model_dir.with_name(".model.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        # file by file, not copytree: a full disk raises its own OSError (copytree gathers them into a shutil.Error
        # without an errno, which reached the user as a traceback)
        for f in sorted(src.rglob("*")):
            (tmp / f.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
            if f.is_dir():
                (tmp / f.relative_to(src)).mkdir(exist_ok=True)
            else:
                shutil.copy2(f, tmp / f.relative_to(src))
        tmp.mkdir(parents=True, exist_ok=True)
        if data is not None:
            data.tokenizer.save_pretrained(tmp)
        tmp.rename(model_dir)
    return from_pretrained(AutoModelForCausalLM, model_dir).eval()


def stage1_label(results: dict) -> str:
    """The name of the stage-1 model in results tables: the Hedgehog student, or with stage1.transfer=mixer the
    HedgeMamba whose mixers stage 1 aligned (``hedgehog_ppl`` holds the stage-1 model's perplexity either way)."""
    return "stage 1 (mixer transfer)" if results.get("stage1_transfer") == "mixer" else "Hedgehog (stage 1)"


def model_labels(results: dict, teacher: str = "teacher (GPT-NeoX)") -> dict:
    """The three models' names in results tables, keyed as in ``evaluate_models``."""
    return {"teacher": teacher, "hedgehog": stage1_label(results), "hedgemamba": "HedgeMamba (stage 2)"}


def long_context_lines(results: dict, teacher: str = "teacher (GPT-NeoX)") -> list[str]:
    """The long-context table of a run's results (empty without one)."""
    from hmscale.eval.long_context import long_context_table

    lc = results.get("long_context")
    if not lc:
        return []
    return [f"Perplexity by target position, {lc['rows']} rows of {lc['length']:,} tokens ({lc['rows_from']}); "
            f"* past the training rows' {lc['train_seq_len']} tokens:", ""] + long_context_table(lc, model_labels(results, teacher))


def _untrained(results: dict, stage: str) -> bool:
    """Whether the run trained no step of ``stage`` (its share of the budget, ``budget.split``, was no tokens)."""
    summary = ((results.get("stages") or {}).get(stage) or {}).get("summary") or {}
    return summary.get("total_steps") == 0


def untrained_notes(results: dict, teacher: str = "teacher") -> list[str]:
    """One line per stage the run trained no step of: what that stage's model in the results table then is."""
    labels = model_labels(results, teacher=teacher)
    part = "mixers" if results.get("stage1_transfer") == "mixer" else "feature maps"
    what = {"stage1": f"the {labels['hedgehog']} row is the teacher with its {part} as initialised",
            "stage2": f"the {labels['hedgemamba']} row is the stage-1 model converted, not fine-tuned"}
    return [f"Stage {stage[-1]} trained no step (`budget.split` gives it no tokens): {text}."
            for stage, text in what.items() if _untrained(results, stage)]


def stage2_settings_line(cfg: RunConfig) -> str:
    """What stage 2 trains and on which loss (LoRA, ``trainable=mixers``, KD, hidden-state terms), for report.md."""
    s2 = cfg.stage2
    if s2.lora_rank:
        what = (f"LoRA rank {s2.lora_rank} (alpha {s2.lora_alpha:g}) on {', '.join(s2.lora_targets)}, plus HedgeMamba's "
                "added parts and the feature maps, every teacher weight frozen")
    elif s2.trainable == "mixers":
        what = "only the mixers (`stage2.trainable=mixers`)"
    else:
        what = "all weights but the embeddings"
    terms = [f"{s2.ce_weight:g} x cross-entropy"] if s2.ce_weight else []
    if s2.kd_weight:
        source = "cached top-k teacher log-probs" if s2.kd_source == "cache" else "online teacher logits"
        terms.append(f"{s2.kd_weight:g} x KD ({source}, temperature {s2.kd_temperature:g})")
    if s2.hidden_weight:
        terms.append(f"{s2.hidden_weight:g} x hidden-state alignment")
    return f"Stage 2 settings: trains {what}; loss {' + '.join(terms)}."


def results_lines(results: dict, teacher: str = "teacher") -> list[str]:
    """The table a finished run prints (`hmscale run`, and a submitted job's log): validation perplexity of each
    model and its ratio to the teacher, then the long-context table when the run has one. Empty without results."""
    if "teacher_ppl" not in results:
        return []
    t = results["teacher_ppl"]
    lines = ["", f"{'model':<24}{'val ppl':>10}{'/ teacher':>12}"]
    for name, label in model_labels(results, teacher=teacher).items():
        if name + "_ppl" in results:
            lines.append(f"{label:<24}{results[name + '_ppl']:>10.3f}{results[name + '_ppl'] / t:>12.3f}")
    lines += untrained_notes(results, teacher=teacher)
    if "long_context" in results:
        lines += [""] + long_context_lines(results, teacher=teacher)
    return lines


def _plain(d: dict) -> dict:
    return {k: v for k, v in d.items() if isinstance(v, (int, float, str, bool)) or v is None}


# the recipe's stages in the order they run (results.json, written with sorted keys, reads back alphabetically)
STAGE_ORDER = ("prepare", "stage1", "stage2", "distill", "eval")


def _in_order(d: dict, order) -> list[tuple]:
    """``d``'s items, the keys named in ``order`` first in that order, then the others as they come."""
    first = [k for k in order if k in d]
    return [(k, d[k]) for k in first] + [(k, v) for k, v in d.items() if k not in first]


def _sample_lines(results: dict) -> list[str]:
    """The greedy samples (``eval.generate_tokens``) as report lines: the prompt, then each model's continuation."""
    s, labels = results["samples"], model_labels(results)
    fence = lambda text: ["```text", text.replace("```", "` ` `"), "```"]  # noqa: E731
    asked = s.get("requested_tokens", s["new_tokens"])  # (results.json written before it was kept: as made)
    count = (f"{s['new_tokens']} tokens, `eval.generate_tokens`" if asked == s["new_tokens"] else
             f"{s['new_tokens']} tokens: `eval.generate_tokens` {asked}, kept within the training rows with the prompt")
    lines = [f"Greedy continuations ({count}) of a held-out prompt:", ""]
    lines += ["prompt:"] + fence(s["prompt"])
    for name, text in _in_order(s["continuations"], labels):  # (results.json keeps its keys sorted)
        lines += [f"{labels.get(name, name)}:"] + fence(text)
    return lines + [""]


def write_report(run_dir: Path, results: dict, cfg: RunConfig) -> Path:
    """report.md: the results table, per-stage tokens and time, loss-curve plots."""
    from hmscale.report import loss_plot

    lines = [f"# hmscale run: {run_dir}", ""]
    if "teacher_ppl" in results:
        t = results["teacher_ppl"]
        lines += ["| model | validation perplexity | / teacher |", "| --- | --- | --- |"]
        for name, label in model_labels(results).items():
            lines.append(f"| {label} | {results[name + '_ppl']:.3f} | {results[name + '_ppl'] / t:.3f} |")
        notes = untrained_notes(results, teacher="teacher (GPT-NeoX)")
        lines += ["", f"Evaluated on {results.get('eval_tokens', 0):,} held-out tokens.", ""]
        lines += [line for note in notes for line in (note, "")]
    if results.get("samples"):
        lines += _sample_lines(results)
    if "long_context" in results:
        from hmscale.report import long_context_plot

        plot = long_context_plot(run_dir, results["long_context"], model_labels(results))
        lines += long_context_lines(results) + ["", f"![long context]({plot.name})", ""]
    else:  # (another evaluation's plot, of a run evaluated before with eval.context_length)
        (run_dir / "long_context.png").unlink(missing_ok=True)
    lines += ["| stage | seconds | tokens |", "| --- | --- | --- |"]
    for name, s in _in_order(results["stages"], STAGE_ORDER):  # as they ran, whether fresh or read back
        tokens = s.get("tokens", "")
        if name in ("stage1", "stage2") and _untrained(results, name):
            tokens = f"{tokens} (no step: `budget.split` gives it no tokens)"
        # a stage finished before (`hmscale stage1`, a killed run): its seconds are those it took then
        shown = f"{name} (finished earlier, skipped)" if (s.get("summary") or {}).get("skipped") else name
        lines.append(f"| {shown} | {s.get('seconds', 0):.1f} | {tokens} |")
    plot = loss_plot(run_dir)
    if plot is not None:
        lines += ["", f"![losses]({plot.name})"]
    # the engine that trained the stages (a rerun that only evaluates may use the other one)
    engine = (results["stages"].get("distill") or {}).get("engine", cfg.parallel.engine)
    lines += ["", f"Teacher: `{cfg.teacher.name_or_path or cfg.teacher.flavor}`; budget {cfg.budget.total_tokens:,} tokens, "
              f"split {list(cfg.budget.split)}; engine {engine}.", "",
              stage2_settings_line(cfg) + (" (No step trained.)" if _untrained(results, "stage2") else "")]
    out = run_dir / "report.md"
    from hmscale.atomic import atomic_write_text

    atomic_write_text(out, "\n".join(lines) + "\n")
    return out


def evaluate_models(cfg: RunConfig, data, models: dict, log=print) -> dict:
    """``{name}_ppl`` of each model on the validation rows and ``eval_tokens``; with ``eval.context_length``, also
    ``long_context``: perplexity per position bucket on rows of that length (``hmscale.eval.long_context``)."""
    from hmscale.eval import perplexity

    rows = data.val_tokens[: cfg.eval.max_sequences]
    bs = cfg.stage2.micro_batch_size
    out = {}
    for name, model in models.items():
        t0 = time.time()
        out[f"{name}_ppl"] = perplexity(model, rows, bs)
        log(f"[eval] {name}: perplexity {out[name + '_ppl']:.3f} on {len(rows)} held-out rows ({time.time() - t0:.1f} s)")
    out["eval_tokens"] = int(rows.shape[0] * (rows.shape[1] - 1))
    if cfg.eval.generate_tokens:
        from hmscale.eval.generation import recipe_samples

        out["samples"] = recipe_samples(models, data.tokenizer, rows[0], cfg.eval.generate_tokens, cfg.data.seq_len)
        log(f"[eval] greedy samples, {out['samples']['new_tokens']} tokens after {out['samples']['prompt']!r}:")
        for name, text in out["samples"]["continuations"].items():
            log(f"[eval]   {name}: {text!r}")
    if cfg.eval.context_length:
        from hmscale.eval.long_context import long_context_eval, long_context_rows

        long_rows, rows_from = long_context_rows(data.stream_dir, cfg.eval.context_length, cfg.eval.max_sequences)
        log(f"[eval] long context: {len(long_rows)} rows of {cfg.eval.context_length:,} tokens ({rows_from}), "
            f"training rows {cfg.data.seq_len}")
        out["long_context"] = long_context_eval(models, long_rows, cfg.data.seq_len,
                                                tokens_per_batch=bs * cfg.data.seq_len, rows_from=rows_from, log=log)
    return out


def run_inputs_dir(run_dir: Path) -> str | None:
    """The folder a run read its relative inputs from: results.json's inputs_dir (a recipe run), else, for a run of
    the stage commands (no results.json), the folder its stages' record of the inputs (inputs.json) places them in."""
    try:
        base = json.loads((Path(run_dir) / "results.json").read_text()).get("inputs_dir")
    except (OSError, ValueError, AttributeError):
        base = None
    if isinstance(base, str):
        return base
    from hmscale.run_identity import recorded_inputs_dir

    return recorded_inputs_dir(run_dir)


def _inputs_as_run(cfg: RunConfig, run_dir: Path) -> RunConfig:
    """``cfg`` with the relative inputs it shares with the run's config.yaml (data.paths, a teacher or tokenizer
    folder) read where the run read them (results.json's inputs_dir), so that `hmscale eval RUN_DIR` scores the run's
    own data and teacher from any folder; inputs given otherwise stay as given."""
    from hmscale.run_identity import saved_tree

    base = run_inputs_dir(run_dir)
    tree = saved_tree(run_dir)
    if not base or tree is None or not Path(base).is_dir() or Path(base).resolve() == Path.cwd().resolve():
        return cfg
    as_run = cfg.with_absolute_inputs(base)
    out = cfg.model_copy(deep=True)
    for section in ("data", "teacher", "tokenizer"):
        field = "paths" if section == "data" else "name_or_path"
        given = getattr(getattr(cfg, section), field)
        if given and given == (tree.get(section) or {}).get(field):
            setattr(getattr(out, section), field, getattr(getattr(as_run, section), field))
    return out


def evaluate_run(cfg: RunConfig, tasks: list[str] | None = None, include_path: str | None = None,
                 limit: int | None = None, log=print, tasks_from: str = "--tasks") -> dict:
    """Perplexity of the teacher and both students of a finished run; lm-eval tasks on the final model."""
    from hmscale.data import prepare_data
    from hmscale.teacher import get_teacher
    from hmscale.train.stage1 import load_stage1_student

    run_dir = Path(cfg.output_dir)
    if not (run_dir / "results.json").exists():
        if any((run_dir / d).exists() for d in ("stage1", "stage2")):
            raise RecipeError(f"output_dir: the run in {run_dir} has not finished; rerun `hmscale run` with its config "
                              "(only what is missing runs), then evaluate it")
        raise RecipeError(f"output_dir: {run_dir} holds no run; run `hmscale run` first or point output_dir at a run")
    if include_path is not None and not Path(include_path).is_dir():
        raise RecipeError(f"--include-path: {include_path!r} is not a folder; pass the folder of your task YAMLs")
    if tasks:
        from hmscale.eval.lm_eval_adapter import unknown_tasks

        unknown = unknown_tasks(tasks, include_path)
        if unknown:
            where = f" (nor in --include-path {include_path})" if include_path else " (custom YAMLs: --include-path)"
            raise RecipeError(f"{tasks_from}: lm-eval-harness knows no task {', '.join(map(repr, unknown))}{where}; "
                              "`lm_eval --tasks list` lists them")
    # the run's own training settings, or a one-line refusal (other settings would train and score another teacher
    # and put the run's feature maps on it)
    _check_identity(run_dir, json.loads((run_dir / "results.json").read_text()).get("config_hash"),
                    cfg.with_absolute_paths(),  # (what the recipe hashes)
                    fix=f"evaluate it with its own settings, `hmscale eval {run_dir}` (eval.* may differ)")
    cfg = _inputs_as_run(cfg, run_dir)
    data = prepare_data(cfg, log=log)
    teacher = get_teacher(cfg, data, log=log)
    final = load_final_model(run_dir, data)
    out = evaluate_models(cfg, data, {"teacher": teacher, "hedgehog": load_stage1_student(run_dir, teacher),
                                      "hedgemamba": final}, log=log)
    out["stage1_transfer"] = cfg.stage1.transfer  # (as in results.json: what hedgehog_ppl's model is)
    if tasks:
        from hmscale.eval.lm_eval_adapter import evaluate_tasks

        out["tasks"] = evaluate_tasks(final, data.tokenizer, tasks, include_path=include_path, limit=limit)
    return out
