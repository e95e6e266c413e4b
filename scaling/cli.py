"""`hmscale scale plan | run`: the scaling sub-commands (registered by hmscale/cli.py)."""

from __future__ import annotations

import math
from typing import List, Optional

import typer

scale_app = typer.Typer(
    no_args_is_help=True,
    help="Scaling studies across Pythia sizes: plan (cost, memory, layout) | run (the recipe per size on Ray).",
    pretty_exceptions_enable=False,
)

SizesOpt = typer.Option(None, "--sizes", help="sizes or groups, comma separated or repeated: 70m,160m | pythia | miniatures | all (default: pythia)")


def _fail(message: str, code: int = 2):
    typer.echo(f"hmscale: error: {message}", err=True)
    raise typer.Exit(code)


def parse_tokens(text: str | None, option: str = "--tokens") -> int | None:
    """A token count as written on the command line: 10000000000, 10_000_000_000 or 1e10 (a whole number)."""
    if text is None:
        return None
    try:
        value = float(text.replace("_", "")) if text.strip() else math.nan
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value != int(value):
        raise ValueError(f"{option}: {text!r} is not a whole number of tokens; e.g. 10000000000 or 1e10")
    return int(value)


def plan_table(plans):
    from rich.table import Table

    from scaling.planner import fmt_bytes, fmt_count, fmt_hours

    t = Table(title="hmscale scaling plan (stage-2 training layout per size)", header_style="bold")
    for col, just in (
        ("size", "left"), ("params", "right"), ("vs pub", "right"), ("student", "right"),
        ("tokens", "right"), ("teacher GB(tp)", "right"), ("1-GPU GB", "right"),
        ("dp x tp Z", "right"), ("ckpt", "center"), ("GB/GPU", "right"),
        ("cache", "right"), ("GPU-h c/s1/s2", "right"), ("GPU-h", "right"),
    ):
        t.add_column(col, justify=just, no_wrap=True)
    for p in plans:
        err = "-" if p.params_error is None else f"{100 * p.params_error:+.2f}%"
        measured = p.measured_stages.split(",")
        mark = {s: "" if s in measured else "*" for s in ("cache", "stage1", "stage2")}  # * = from the FLOP model
        t.add_row(
            p.size, fmt_count(p.params), err, fmt_count(p.student_params), fmt_count(p.total_tokens),
            f"{p.teacher_mem_gb:.1f} ({p.teacher_tp})", f"{p.single_gpu_train_gb:.1f}",
            f"{p.dp}x{p.tp} Z{p.zero_stage}", "yes" if p.activation_checkpointing else "no",
            f"{p.train_mem_gb:.1f}", fmt_bytes(p.cache_gb * 1e9),
            "/".join(fmt_hours(p.gpu_hours[s]) + mark[s] for s in ("cache", "stage1", "stage2")),
            fmt_hours(p.gpu_hours_total) + ("" if p.throughput_source == "measured" else "*"),
        )
    return t


@scale_app.command("plan")
def plan_cmd(
    sizes: Optional[List[str]] = SizesOpt,
    gpu_mem: float = typer.Option(80.0, "--gpu-mem", help="GPU memory in GB"),
    seq_len: int = typer.Option(2048, "--seq-len"),
    micro_batch: int = typer.Option(4, "--micro-batch", help="stage-2 micro batch per GPU"),
    teacher_batch: int = typer.Option(8, "--teacher-batch", help="sequences per teacher forward in the cache pass (cache.batch_size)"),
    zero: Optional[int] = typer.Option(None, "--zero", help="force a ZeRO stage (default: the planner picks)"),
    tp: Optional[int] = typer.Option(None, "--tp", help="force a tensor-parallel degree"),
    max_tp: int = typer.Option(8, "--max-tp", help="largest tp (GPUs per node)"),
    budget_fraction: Optional[float] = typer.Option(None, "--budget-fraction", help="tokens as a fraction of the teacher's pretraining tokens (default 1/30 ~ 10B)"),
    tokens: Optional[str] = typer.Option(None, "--tokens", help="a fixed token budget for every size (e.g. 10000000000 "
                                                                "or 1e10)"),
    split: str = typer.Option("10/90", "--split", help="stage-1/stage-2 split"),
    token_fraction: float = typer.Option(1.0, "--token-fraction", help="fraction of tokens whose per-layer tensors are cached"),
    topk: int = typer.Option(0, "--topk", help="teacher top-k log-probs cached for KD"),
    lora_rank: int = typer.Option(0, "--lora-rank", help="stage 2 with LoRA adapters of this rank on the mixers' in_proj and out_proj (teacher weights frozen)"),
    throughput: Optional[List[str]] = typer.Option(None, "--throughput", help="measured tokens/s per GPU (repeatable): JSON {size: {cache|stage1|stage2: tok/s}}, CSV size,stage,tokens_per_s, or the JSON of benchmarks/train_throughput.py / cache_throughput.py"),
    csv_out: Optional[str] = typer.Option(None, "--csv", help="write the plan as CSV"),
    json_out: Optional[str] = typer.Option(None, "--json", help="write the plan as JSON"),
    plot: Optional[str] = typer.Option(None, "--plot", help="write the projected-cost plot (PNG)"),
):
    """Per size: parameters, memory per GPU, the smallest (dp, tp, ZeRO) that fits, cache bytes, GPU-hours."""
    from rich.console import Console

    from scaling.budget import BudgetRule, parse_split
    from scaling.planner import PlanSettings, load_throughput, plan, write_plan

    try:
        tokens = parse_tokens(tokens)
        for opt, value in (("--tokens", tokens), ("--budget-fraction", budget_fraction)):
            if value is not None and not value > 0:
                raise ValueError(f"{opt}: {value} must be positive")
        if tokens is not None and budget_fraction is not None:
            raise ValueError(f"--tokens {tokens} and --budget-fraction {budget_fraction:g}: give one of them (a fixed "
                             "budget for every size, or a fraction of each teacher's pretraining tokens)")
        rule = BudgetRule(kind="fixed", tokens=tokens, split=parse_split(split)) if tokens else BudgetRule(
            split=parse_split(split), **({"fraction": budget_fraction} if budget_fraction else {})
        )
        settings = PlanSettings(
            gpu_mem_gb=gpu_mem, seq_len=seq_len, micro_batch=micro_batch, teacher_micro_batch=teacher_batch,
            zero_stage=zero, tp=tp, max_tp=max_tp, token_fraction=token_fraction, topk=topk, budget=rule, lora_rank=lora_rank,
            throughput=load_throughput(*throughput) if throughput else None,
        )
        plans = plan(sizes or None, settings)
    except ValueError as err:
        _fail(str(err))
    console = Console()
    if not console.is_terminal:
        console = Console(width=170)
    console.print(plan_table(plans))
    if any(p.throughput_source != "measured" for p in plans):
        console.print("* from the FLOP model (scaling/planner.py), not measured: a stage --throughput does not give, "
                      "or a total that includes one.")
    try:
        write_plan(plans, csv_out, json_out)
        if plot:
            from scaling.plots import plot_projected_cost

            plot_projected_cost([p.row() for p in plans], plot)
    except OSError as err:  # a folder given as the file, a read-only place, a full disk: one line, not a traceback
        where = err.filename or next(x for x in (csv_out, json_out, plot) if x)
        _fail(f"cannot write {str(where)!r} ({err.strerror or type(err).__name__}); give --csv / --json / --plot a "
              "file path you can write", code=1)
    for path in (csv_out, json_out, plot):
        if path:
            console.print(f"wrote {path}")


@scale_app.command("run")
def run_cmd(
    config: Optional[str] = typer.Argument(None, help="base YAML config applied to every size"),
    sizes: Optional[List[str]] = SizesOpt,
    out: str = typer.Option("runs/scale", "--out", help="sweep directory"),
    overrides: Optional[List[str]] = typer.Option(None, "--set", "-s", help="dotted override for every size (repeatable)"),
    address: Optional[str] = typer.Option(None, "--address", help="Ray cluster address (default: embedded local cluster)"),
    num_cpus: Optional[int] = typer.Option(None, "--num-cpus", help="logical CPUs of the embedded cluster"),
    cpus_per_size: float = typer.Option(1.0, "--cpus-per-size", help="CPUs each size's Ray task asks for"),
    resources: Optional[str] = typer.Option(None, "--resources", help='JSON per-size resources, e.g. \'{"pythia-12b": {"num_gpus": 4}}\''),
    budget_fraction: Optional[float] = typer.Option(None, "--budget-fraction", help="each size's tokens as a fraction of "
                                                    "its teacher's pretraining tokens (default 1/30; published sizes "
                                                    "only, not the miniatures; budget.total_tokens, if set, wins)"),
    split: Optional[str] = typer.Option(None, "--split", help="stage-1/stage-2 split of each size's tokens (default "
                                                             "10/90; budget.split, if set, wins)"),
    local: bool = typer.Option(False, "--local", help="run sizes in this process, one after another (no Ray)"),
):
    """Run the recipe for every size (Ray tasks), skip finished sizes, write results.csv/json and plots."""
    from ray_jobs.scaling import main as job_main

    argv = ["--out", out, "--cpus-per-size", str(cpus_per_size)]
    if sizes:
        argv += ["--sizes", *sizes]
    if config:
        argv += ["--config", config]
    for o in overrides or []:
        argv += ["--set", o]
    if address:
        argv += ["--address", address]
    if num_cpus is not None:
        argv += ["--num-cpus", str(num_cpus)]
    if budget_fraction is not None:
        argv += ["--budget-fraction", str(budget_fraction)]
    if split is not None:
        argv += ["--split", split]
    if resources:
        argv += ["--resources", resources]
    if local:
        argv.append("--local")
    raise typer.Exit(job_main(argv))
