"""Ray job: the HedgeMamba recipe over Pythia sizes, collected into one results table.

    python -m ray_jobs.scaling --sizes 70m,160m,410m --out runs/scale [--config base.yaml] [-s k=v ...]
    ray job submit --working-dir . -- python -m ray_jobs.scaling --sizes pythia --out /shared/scale

Each size runs as a Ray task with its own resources (see `scaling.sweep`); finished sizes
(a results.json in OUT/runs/<size> holding the final evaluation of a run of the same training settings) are
skipped, so rerunning the same command resumes. A size directory holding a run of other training settings stops
the study before any work, with a one-line error naming the changed settings (exit code 2).
Writes OUT/results.csv, OUT/results.json and OUT/plots/*.png.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ray_jobs.scaling", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", default=["pythia"], help="sizes or groups (70m 160m | pythia | miniatures | all); commas allowed")
    p.add_argument("--out", required=True, help="sweep directory (runs/<size>, cache/, results.csv, plots/)")
    p.add_argument("--config", default=None, help="base YAML config applied to every size")
    p.add_argument("-s", "--set", dest="overrides", action="append", default=[], help="dotted override for every size (repeatable)")
    p.add_argument("--address", default=None, help="Ray cluster address (default: an embedded local cluster)")
    p.add_argument("--num-cpus", type=int, default=None, help="logical CPUs of the embedded local cluster")
    p.add_argument("--cpus-per-size", type=float, default=1.0, help="CPUs each size's task asks for")
    p.add_argument("--resources", default=None, help='JSON per-size resources, e.g. \'{"pythia-12b": {"num_gpus": 4}, "*": {"num_cpus": 2}}\'')
    p.add_argument("--budget-fraction", type=float, default=None, help="distillation tokens as a fraction of the teacher's pretraining tokens (default 1/30; published sizes, "
                   "not the miniatures, whose budget is fixed; no effect with budget.total_tokens set)")
    p.add_argument("--split", default=None, help="stage split, e.g. 10/90 (default)")
    p.add_argument("--local", action="store_true", help="run sizes one after another in this process (no Ray)")
    p.add_argument("--recipe", default="hmscale.recipe:run_recipe", help=argparse.SUPPRESS)
    p.add_argument("--no-plots", action="store_true")
    return p.parse_args(argv)


def _resources(text: str | None):
    if not text:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"--resources: not valid JSON ({err.msg}); e.g. "
                         '\'{"pythia-12b": {"num_gpus": 4}, "*": {"num_cpus": 2}}\'') from None


def _placement_problem(a: argparse.Namespace) -> str | None:
    """The first option that places the sizes' Ray tasks given beside one that makes them not apply, in one line:
    each was dropped without a word (--local runs no Ray task; a joined cluster has its own CPUs)."""
    if a.local:
        given = [(opt, v) for opt, v in (("--address", a.address), ("--num-cpus", a.num_cpus),
                                         ("--resources", a.resources),
                                         ("--cpus-per-size", None if a.cpus_per_size == 1.0 else a.cpus_per_size))
                 if v is not None]
        if given:
            opt, value = given[0]
            return (f"{opt} {value}: places the sizes' Ray tasks, but --local runs every size in this process, one "
                    f"after another; remove {opt} or --local")
    if a.num_cpus is not None and a.address:
        return (f"--num-cpus {a.num_cpus}: sizes the embedded cluster, but --address {a.address} joins a running one "
                "(its own CPUs); remove --num-cpus")
    return None


def _rule_notes(a: argparse.Namespace, base: dict) -> list[str]:
    """The budget options given that this sweep does not use (the config's own setting wins, or no size reads it)."""
    from scaling.registry import resolve_sizes
    from scaling.sweep import _has_key

    notes = []
    if a.budget_fraction is not None:
        if _has_key(base, a.overrides, "budget.total_tokens"):
            notes.append("--budget-fraction has no effect: budget.total_tokens is set")
        elif all(s.miniature for s in resolve_sizes(list(a.sizes))):
            notes.append("--budget-fraction has no effect on the miniature sizes (no published pretraining tokens: "
                         "each gets a fixed budget); set budget.total_tokens (-s budget.total_tokens=N) instead")
    if a.split is not None and _has_key(base, a.overrides, "budget.split"):
        notes.append("--split has no effect: budget.split is set (in the config or a -s override); remove one of them")
    return notes


def main(argv=None) -> int:
    from hmscale.config import ConfigError, read_config_tree
    from scaling.budget import BudgetRule, parse_split
    from scaling.sweep import run_sweep

    a = parse_args(argv)
    try:
        if a.num_cpus is not None and a.num_cpus < 1:  # (0 would read as "not given": every core of the machine)
            raise ValueError(f"--num-cpus: {a.num_cpus} must be at least 1 (logical CPUs of the embedded cluster)")
        problem = _placement_problem(a)
        if problem:
            raise ValueError(problem)
        base = read_config_tree(a.config) if a.config else {}
        rule_kw = {}
        if a.budget_fraction is not None:
            if not a.budget_fraction > 0:
                raise ValueError(f"--budget-fraction: {a.budget_fraction} must be positive (1/30 ~ 10B tokens per Pythia size)")
            rule_kw["fraction"] = a.budget_fraction
        if a.split is not None:
            rule_kw["split"] = parse_split(a.split)
        for note in _rule_notes(a, base):
            print(f"hmscale: note: {note}", file=sys.stderr)
        rows = run_sweep(
            a.sizes, a.out, overrides=a.overrides, base_tree=base, rule=BudgetRule(**rule_kw),
            engine="local" if a.local else "ray", ray_address=a.address, ray_num_cpus=a.num_cpus,
            cpus_per_size=a.cpus_per_size, resources=_resources(a.resources),
            recipe=a.recipe, plots=not a.no_plots,
        )
    except (ConfigError, ValueError) as err:
        print(f"hmscale: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # the sweep directory or its tables cannot be written (read-only, full disk): one line
        where = f"{err.filename}: " if err.filename else ""
        print(f"hmscale: error: {where}{err.strerror or err}; give --out a directory you can write (with room)",
              file=sys.stderr)
        return 1
    for r in rows:
        print(f"{r['size']:>14}  {r['status']:>8}  teacher {r.get('teacher_ppl')}  hedgemamba {r.get('hedgemamba_ppl')}  gap {r.get('gap')}")
    print(f"table: {Path(a.out) / 'results.csv'}")
    return 0 if all(r["status"] in ("done", "skipped") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
