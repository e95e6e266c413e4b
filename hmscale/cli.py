"""`hmscale` command line: check | prepare | cache | stage1 | stage2 | eval | generate | run | scale | submit."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import List, Optional

import typer

from hmscale.config import ConfigError, load_config, stage1_cache_problem, unused_settings

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="hmscale: distil a Pythia / GPT-NeoX Transformer into a pure Mamba-2 (SSD) model (HedgeMamba recipe).",
    pretty_exceptions_enable=False,
)

ConfigArg = typer.Argument(None, help="YAML config; omit for the embedded defaults (the demo).")
OverridesOpt = typer.Option(None, "--set", "-s", help="dotted override, e.g. -s stage2.lr=3e-4 (repeatable)")


def fail(message: str, code: int = 2) -> None:
    """Print one line to stderr and exit (2 = bad input)."""
    typer.echo(f"hmscale: error: {message}", err=True)
    raise typer.Exit(code)


def _config(path, overrides, stage1: bool = False):
    """The config; with ``stage1`` (commands that train stage 1), also one that stage 1 can train from."""
    try:
        cfg = load_config(path, overrides or [])
    except ConfigError as err:
        fail(str(err))
    problem = stage1_cache_problem(cfg) if stage1 else None
    if problem:  # (else found after the data, the teacher and the cache)
        fail(problem)
    return cfg


@app.command(short_help="Validate a config and print the resolved tree (notes on stderr).")
def check(config: Optional[str] = ConfigArg, overrides: Optional[List[str]] = OverridesOpt):
    """Validate a config and print the resolved tree (and, on stderr, what would stop stage 1 from training from the
    cache the config captures: `hmscale cache` and `stage2` take such a config, `hmscale run` and `stage1` refuse it;
    and a cache shorter than a stage's rows: other rows than without the cache, revisited)."""
    import yaml

    cfg = _config(config, overrides)
    typer.echo(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    problem = stage1_cache_problem(cfg)
    if problem:
        typer.echo(f"hmscale: note: `hmscale run` and `hmscale stage1` refuse this config: {problem}", err=True)
    for line in unused_settings(cfg):
        typer.echo(f"hmscale: note: {line}", err=True)
    if not cfg.cache.max_tokens:  # (the whole budget cached: no note; the note's module imports torch)
        return
    from hmscale.train.common import short_cache_note

    # a cache shorter than a stage's rows (stage 1's share; the budget, for stage 2 with cached KD): other rows than
    # without the cache, revisited (stage 1's only where it may train from the cache; `stage2` takes the config)
    for stage in ("stage2",) if problem else ("stage1", "stage2"):
        note = short_cache_note(cfg, stage=stage)
        if note:
            typer.echo(f"hmscale: note: {note}", err=True)


def _cache_flags_problem(sub, target, overrides, engine, as_json, force) -> str | None:
    """The first option given that this `hmscale cache` form (build, verify, list or rm) does nothing with, in one line:
    each was ignored without a word (`--force` on a build forced nothing; `-s cache.root=...` beside `list ROOT`)."""
    form = sub if sub in ("verify", "list", "rm") else "build"
    unused = {
        "--engine": (engine is not None and form != "build", "applies to `hmscale cache CONFIG` only"),
        "--json": (as_json and form != "list", "applies to `hmscale cache list` only"),
        "--force": (force and form != "rm", "applies to `hmscale cache rm` only"),
        "--set": (bool(overrides) and form != "build" and not (form == "list" and not target),
                  "applies to `hmscale cache CONFIG`, and to `hmscale cache list` without ROOT (its cache.root), only"),
    }
    flag = next((f for f, (given, _) in unused.items() if given), None)
    if flag is None:
        return None
    rebuild = (flag, form) == ("--force", "build")
    again = " (to build a cache again, delete it first: `hmscale cache rm DIR`)" if rebuild else ""
    return f"{'cache' if form == 'build' else f'cache {form}'}: {flag} {unused[flag][1]}; remove it{again}"


@app.command(short_help="Cache the teacher's tensors; `cache verify DIR`, `cache list [ROOT]`, `cache rm DIR`.")
def cache(
    config: Optional[str] = ConfigArg,
    target: Optional[str] = typer.Argument(None, help="with `verify` / `rm`: the cache directory; with `list`: "
                                                       "the cache root (default: the embedded config's cache.root)"),
    overrides: Optional[List[str]] = OverridesOpt,
    engine: Optional[str] = typer.Option(None, help="local | ray (default: cache.engine, else parallel.engine)"),
    as_json: bool = typer.Option(False, "--json", help="with `list`: one JSON object per cache"),
    force: bool = typer.Option(False, "--force", help="with `rm`: also remove the views that read the cache"),
):
    """Cache the teacher's per-layer tensors over the data plan (`hmscale cache CONFIG`); `hmscale cache verify DIR`
    checks one; `hmscale cache list [ROOT]` lists a root's caches from their manifests; `hmscale cache rm DIR`
    deletes one (refusing while views read it, unless --force)."""
    from hmscale.teacher.cache import CacheError, build_cache, verify_cache

    if engine not in (None, "local", "ray"):
        fail(f"cache --engine: {engine!r} is not an engine; use local or ray")
    problem = _cache_flags_problem(config, target, overrides, engine, as_json, force)
    if problem:
        fail(problem)

    if config == "list":
        from hmscale.teacher.cache.catalog import format_catalog, list_caches

        root = target or _config(None, overrides).cache.root
        if not target and not Path(root).expanduser().exists():  # the configured root, before any cache was built
            typer.echo(format_catalog([], root))
            return
        try:
            entries = list_caches(root)
        except CacheError as err:
            fail(f"cache list: {err}")
        if as_json:
            for e in entries:
                typer.echo(json.dumps(e.row()))
        else:
            typer.echo(format_catalog(entries, root))
        return
    if config == "verify":
        if not target:
            fail("cache verify: name the cache directory, e.g. hmscale cache verify .cache/hmscale/teacher/v1-...")
        report = verify_cache(target)
        typer.echo(report.summary(), err=not report.ok)
        raise typer.Exit(0 if report.ok else 1)
    if config == "rm":
        from hmscale.teacher.cache.catalog import remove_cache

        if not target:
            fail("cache rm: name the cache directory, e.g. hmscale cache rm .cache/hmscale/teacher/v1-...")
        try:
            removed = remove_cache(target, force=force)
        except (CacheError, OSError) as err:
            fail(f"cache rm: {err}")
        typer.echo("\n".join(f"removed {p}" for p in removed))
        return
    if target:
        fail(f"cache: unexpected argument {target!r}; use `hmscale cache CONFIG`, `hmscale cache verify DIR`, "
             "`hmscale cache list [ROOT]` or `hmscale cache rm DIR`")
    cfg = _config(config, overrides)
    if (engine or cfg.cache.engine or cfg.parallel.engine) == "ray" and (cfg.parallel.ray_address
                                                                      or os.environ.get("RAY_ADDRESS")):
        from hmscale.ray_cluster import connect

        try:  # a running cluster is joined first: an address that cannot be, before the data and teacher work
            connect(cfg.parallel.ray_address)
        except ConfigError as err:
            fail(str(err))
    try:
        path = build_cache(cfg, engine=engine)
    except (CacheError, ConfigError) as err:
        fail(str(err), code=1)
    except (ValueError, OSError, RuntimeError) as err:  # the data or the teacher, as `hmscale prepare` reports them
        fail(str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__, code=1)
    typer.echo(str(path))


@app.command(short_help="Prepare the data only (tokenizer, token stream, shard plan): a CPU step.")
def prepare(config: Optional[str] = ConfigArg, overrides: Optional[List[str]] = OverridesOpt):
    """Prepare the data only (tokenizer, tokenised stream, shard plan; cached and reused by every later command): a
    CPU step to run before the GPU jobs. Reports how far the train stream covers the token budget."""
    cfg = _config(config, overrides)
    from hmscale.data import prepare_data

    try:
        data = prepare_data(cfg)
    except OSError as err:  # a missing corpus file; a full disk or an unwritable data.cache_dir
        from hmscale.atomic import storage_error_line

        fail(storage_error_line(err, "hmscale prepare") or str(err), code=1)
    except (ValueError, RuntimeError) as err:
        fail(str(err), code=1)
    have, want = data.plan.total_tokens, cfg.budget.total_tokens
    caps = [f"data.{k}" for k in ("max_tokens", "max_documents") if getattr(cfg.data, k) is not None]
    more = "add data" + (f" or raise {' / '.join(caps)}" if caps else "")  # (a cap left unset reads all there is)
    cover = (f"covers budget.total_tokens={want:,} {have / want:.2f}x" if have >= want else
             f"holds {have / want:.0%} of budget.total_tokens={want:,}: the stages will revisit rows "
             f"(~{want / max(have, 1):.1f} passes); {more}")
    typer.echo(f"data: {data.stream_dir}: {have:,} train tokens in plan {data.plan.hash} "
               f"({data.plan.num_shards} shards), {len(data.val_tokens)} validation rows; {cover}")


def _run_stages(config, overrides, stages: tuple, stage1_from: Optional[str] = None) -> None:
    """Run the given distillation stages (parallel.engine: local, one process, or ray, Ray Train workers)."""
    from hmscale.recipe import RecipeError, adopt_stage1, check_local_gpu
    from hmscale.run_identity import saved_config_mismatch
    from hmscale.train.engine import TrainingError
    from ray_jobs.distill import run_distill, summary_line

    cfg = _config(config, overrides, stage1="stage1" in stages)
    absolute = cfg.with_absolute_paths()  # as run_distill saves it
    refusal = saved_config_mismatch(Path(absolute.output_dir), absolute)
    if refusal:
        fail(refusal)
    try:
        if stage1_from is not None:
            typer.echo(adopt_stage1(Path(stage1_from), absolute), err=True)
        check_local_gpu(cfg)
        res = run_distill(cfg, stages=stages)
    except (RecipeError, ConfigError) as err:  # (ConfigError: e.g. a parallel.ray_address with no cluster)
        fail(str(err))
    except TrainingError as err:
        fail(str(err), code=1)
    except OSError as err:  # a full disk or a read-only place while writing a summary, an export, the data
        from hmscale.atomic import storage_error_line

        line = storage_error_line(err, f"hmscale {' / '.join(stages)}")
        if line is None:
            raise
        fail(line, code=1)
    typer.echo(summary_line(res))


@app.command()
def stage1(config: Optional[str] = ConfigArg, overrides: Optional[List[str]] = OverridesOpt):
    """Stage 1: train the Hedgehog feature maps (attention transfer)."""
    _run_stages(config, overrides, ("stage1",))


@app.command()
def stage2(
    config: Optional[str] = ConfigArg,
    overrides: Optional[List[str]] = OverridesOpt,
    stage1_from: Optional[str] = typer.Option(
        None, "--stage1-from", help="a run directory whose finished stage 1 this run starts from (every setting but "
                                    "stage2.* must match): one stage 1 for several stage-2 ablations"),
):
    """Stage 2: convert to HedgeMamba and fine-tune."""
    _run_stages(config, overrides, ("stage2",), stage1_from=stage1_from)


@app.command("eval", short_help="Perplexity of teacher and students; lm-eval-harness tasks; CONFIG may be a run dir.")
def eval_(
    config: Optional[str] = ConfigArg,
    overrides: Optional[List[str]] = OverridesOpt,
    tasks: Optional[str] = typer.Option(None, help="comma-separated lm-eval-harness tasks for the final model"),
    include_path: Optional[str] = typer.Option(None, help="folder of custom lm-eval task YAMLs"),
    limit: Optional[int] = typer.Option(None, min=1, help="at most this many documents per task"),
    context_length: Optional[int] = typer.Option(
        None, help="also score rows this long, perplexity per position bucket (sets eval.context_length)"),
):
    """Perplexity of teacher and students on held-out data; lm-eval-harness tasks on the final model. CONFIG may be
    a run directory (its config.yaml); training settings other than the run's are refused (eval.* may differ)."""
    extra = [f"eval.context_length={context_length}"] if context_length is not None else []
    # a run directory, or a run's config.yaml: that run's settings, scored on that directory's files (the file names
    # the directory the run was trained in: after a move or a copy, that one would be scored instead of the one given,
    # or nothing be found); -s output_dir=... still wins
    run_dir = []
    in_run = lambda d: any((d / f).exists() for f in ("results.json", "stage1", "stage2"))  # noqa: E731
    if config and Path(config).is_dir() and (Path(config) / "config.yaml").is_file():
        config = str(Path(config) / "config.yaml")
        run_dir = [f"output_dir={Path(config).parent.resolve()}"]
    elif config and Path(config).name == "config.yaml" and in_run(Path(config).parent):
        run_dir = [f"output_dir={Path(config).parent.resolve()}"]
    elif config and Path(config).is_dir() and (Path(config) / "config.json").is_file():
        fail(f"{config!r} is a saved model, not a run: `hmscale eval` takes a run directory (or its config.yaml); "
             "score a saved model with `lm_eval --model hf --model_args pretrained=DIR,trust_remote_code=True` "
             "or `hmscale generate DIR`")
    from hmscale.config import inputs_root
    from hmscale.recipe import RecipeError, evaluate_run, run_inputs_dir
    from hmscale.train.engine import TrainingError

    # the run's relative inputs (a teacher folder) are checked where the run was made (results.json's inputs_dir)
    with inputs_root(run_inputs_dir(Path(config).parent) if run_dir else None):
        cfg = _config(config, run_dir + list(overrides or []) + extra)
        task_list = [t for t in (tasks or "").split(",") if t]
        tasks_from = "--tasks" if task_list else "eval.tasks"
        task_list = task_list or list(cfg.eval.tasks)
        try:
            # progress to stderr: stdout carries the results' JSON alone
            res = evaluate_run(cfg, tasks=task_list, include_path=include_path, limit=limit,
                               log=lambda msg: typer.echo(msg, err=True), tasks_from=tasks_from)
        except (RecipeError, TrainingError, ValueError) as err:  # (TrainingError: e.g. no stage-1 student there)
            fail(str(err))
    typer.echo(json.dumps(res, indent=2))


@app.command()
def generate(
    model: str = typer.Argument(..., help="a saved HedgeMamba directory (e.g. runs/demo/model) or a run directory"),
    prompt: Optional[str] = typer.Option(None, help="text to continue (default: 'def ')"),
    prompt_file: Optional[str] = typer.Option(None, help="read the prompt from this file instead (long prompts: the "
                                                        "prefill runs the chunked scan, then O(1) per new token)"),
    max_new_tokens: int = typer.Option(64, min=1),
    temperature: float = typer.Option(0.0, min=0.0, help="0 = greedy; > 0 samples (from the whole softmax unless "
                                                         "--top-k / --top-p)"),
    top_k: int = typer.Option(0, min=0, help="sample from the k most likely tokens only (0 = all)"),
    top_p: float = typer.Option(1.0, min=0.0, max=1.0, help="nucleus sampling: the smallest set of tokens holding "
                                                          "this probability (1 = all)"),
    seed: int = typer.Option(0, min=0, max=2**63 - 1, help="the sampling seed (with --temperature)"),
    device: str = typer.Option("auto", help="auto (the first GPU if torch sees one, else the CPU), cpu, cuda, cuda:N"),
    dtype: str = typer.Option("auto", help="auto (bf16 on a GPU, fp32 on the CPU), fp32, bf16 or fp16"),
):
    """Generate text with the recurrent cache (O(1) memory per new token)."""
    from hmscale.eval.generation import generate_text, resolve_device, resolve_dtype

    try:
        dev = resolve_device(device)
        torch_dtype = resolve_dtype(dtype, dev)
    except ValueError as err:
        fail(str(err))

    path = Path(model)
    if not path.exists():
        fail(f"model directory {model!r} does not exist; pass a saved model such as runs/demo/model")
    if not (path / "config.json").exists() and (path / "model" / "config.json").exists():
        path = path / "model"  # a run directory: its final model
    if not (path / "config.json").exists() and any((path / f).exists() for f in ("config.yaml", "stage1", "stage2")):
        fail(f"{model!r} is a run without its final model (model/): it has not finished; rerun `hmscale run` with "
             "its config (only what is missing runs), then pass the run directory again")
    if not (path / "config.json").exists():
        fail(f"{model!r} holds no saved model (config.json); pass a run's model/ directory, e.g. runs/demo/model")
    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        fail(f"{str(path)!r} has no tokenizer; pass the run's model/ directory (the model with its tokenizer), "
             "e.g. runs/demo/model")
    if prompt is not None and prompt_file is not None:
        fail("--prompt and --prompt-file: give one of them")
    if prompt_file is not None:
        try:
            prompt = Path(prompt_file).read_text(encoding="utf-8-sig")  # (a byte-order mark is not the prompt's)
        except (OSError, UnicodeDecodeError) as err:
            fail(f"--prompt-file: cannot read {prompt_file!r} ({err}); pass a UTF-8 text file")
    prompt = "def " if prompt is None else prompt
    from safetensors import SafetensorError

    try:
        text, stats = generate_text(str(path), prompt, max_new_tokens=max_new_tokens, temperature=temperature,
                                    seed=seed, device=dev, dtype=torch_dtype, top_k=top_k, top_p=top_p)
    except ValueError as err:  # (--temperature inf, --top-p 0)
        fail(f"generate: {err}")
    except (OSError, SafetensorError) as err:  # weights missing or unreadable (a half-copied model directory)
        fail(f"{str(path)!r}: cannot load the saved model ({str(err).strip()}); pass a complete model/ directory, "
             "e.g. runs/demo/model")
    typer.echo(text)
    rate = f", {stats['tokens_per_s']:.1f} tokens/s after the first" if stats["new_tokens"] > 1 else ""
    typer.echo(f"[{stats['prompt_tokens']} prompt tokens in {stats['prefill_s']:.2f} s, {stats['new_tokens']} new "
               f"tokens{rate}; {dev}, {str(torch_dtype).removeprefix('torch.')}]", err=True)


@app.command()
def run(config: Optional[str] = ConfigArg, overrides: Optional[List[str]] = OverridesOpt):
    """The whole recipe: cache, stage 1, stage 2, eval, into one run directory (resumable)."""
    cfg = _config(config, overrides)
    from hmscale.recipe import RecipeError, run_recipe
    from hmscale.train.engine import TrainingError

    try:
        res = run_recipe(cfg)
    except (RecipeError, ConfigError) as err:  # (ConfigError: e.g. a parallel.ray_address with no cluster)
        fail(str(err))
    except TrainingError as err:
        fail(str(err), code=1)
    print_results(res)


def print_results(res: dict) -> None:
    from hmscale.recipe import results_lines

    for line in results_lines(res):
        typer.echo(line)


@app.command()
def submit(
    config: Optional[str] = ConfigArg,
    overrides: Optional[List[str]] = OverridesOpt,
    address: str = typer.Option(..., help="Ray dashboard address, e.g. http://head:8265"),
    token_file: Optional[str] = typer.Option(None, help="Ray auth token file (default: $RAY_AUTH_TOKEN, the file "
                                                        "$RAY_AUTH_TOKEN_PATH names, ~/.ray/auth_token)"),
    follow: bool = typer.Option(True, help="stream logs until the job ends"),
    timeout: Optional[float] = typer.Option(None, help="stop the job after this many seconds of following it "
                                                       "(not with --no-follow)"),
    install: bool = typer.Option(False, help="have Ray pip-install hmscale's dependencies (not torch, triton, ray) "
                                             "into the job's environment on every node"),
):
    """Submit a recipe run to a Ray cluster (job submission API, token auth)."""
    if timeout is not None and not follow:  # (the timeout is kept by the following loop: the job ran on unstopped)
        fail(f"--timeout {timeout:g} with --no-follow: the job is stopped after --timeout only while `hmscale submit` "
             "follows it; drop --no-follow, or --timeout (stop the job yourself with `ray job stop`)")
    if timeout is not None and not timeout > 0:  # (the job was uploaded, started and stopped at its first poll)
        fail(f"--timeout: {timeout:g} s would stop the job as soon as it starts; give a positive number of seconds, "
             "or leave --timeout out to follow the job until it ends")
    cfg = _config(config, overrides, stage1=True)  # (the job runs the whole recipe: refused here, not on the cluster)
    from hmscale.submit import SubmitError, submit as submit_job

    try:
        status = submit_job(cfg, address, token_file=token_file, follow=follow, timeout_s=timeout, install=install,
                            log=lambda m: typer.echo(m))
    except SubmitError as err:
        fail(str(err))
    if status not in ("SUCCEEDED", "PENDING"):
        raise typer.Exit(1)


from scaling.cli import scale_app  # noqa: E402  (scaling studies: `hmscale scale plan | run`)

app.add_typer(scale_app, name="scale")


def _quiet_hub_progress_bars() -> None:
    """HMSCALE_NO_PROGRESS=1 (batch logs) also turns off transformers' / the hub's / datasets' progress bars ("Loading
    weights", "Writing model shards", "Generating test split"): in this process, and in the workers it starts (they inherit the environment)."""
    if os.environ.get("HMSCALE_NO_PROGRESS") != "1":
        return
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # (read as transformers is imported)
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")  # (datasets': "Generating test split", maps)
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    if "datasets" in sys.modules:
        import datasets

        datasets.disable_progress_bars()


def main(argv: list[str] | None = None) -> int:
    import errno

    _quiet_hub_progress_bars()
    try:
        rv = app(args=argv, prog_name="hmscale", standalone_mode=False)
    except typer.TyperException as e:  # (typer's click exceptions: a bad option or command, or no arguments)
        if type(e).__name__ == "NoArgsIsHelpError":  # `hmscale` / `hmscale scale` alone: the help is printed
            return e.exit_code
        # one line, as every other error (not typer's five-line box, its message wrapped at 80 columns)
        ctx = getattr(e, "ctx", None)
        hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
        typer.echo(f"hmscale: error: {' '.join(e.format_message().split())}{hint}", err=True)
        return e.exit_code
    except typer.Abort:
        typer.echo("Aborted!", err=True)
        return 1
    except SystemExit as e:
        return int(e.code or 0)
    except OSError as e:  # (stdout closed early, as by `| head`: what click's standalone mode does)
        if e.errno != errno.EPIPE:
            raise
        return 1
    return rv if isinstance(rv, int) and not isinstance(rv, bool) else 0  # (typer.Exit's code; commands return None)


if __name__ == "__main__":
    sys.exit(main())
