"""Ray job entry point for a whole recipe run (what `hmscale submit` starts on the cluster).

    ray job submit --working-dir . -- python -m ray_jobs.run_recipe --config configs/demo.yaml -s seed=1
"""

from __future__ import annotations

import argparse
import os
import sys


def required_distributions() -> list[str]:
    """hmscale's runtime requirements (distribution names): the uploaded checkout's pyproject.toml, else the
    installed package's metadata."""
    from importlib import metadata
    from pathlib import Path

    from hmscale.requirements import distribution_name, pyproject_dependencies

    deps = pyproject_dependencies(Path(__file__).resolve().parents[1])
    if deps is None:  # hmscale installed without its checkout (or Python 3.10)
        try:
            deps = [r for r in metadata.requires("hmscale") or [] if "extra ==" not in r]
        except metadata.PackageNotFoundError:
            return []
    return [distribution_name(d) for d in deps]


def missing_dependencies() -> list[str]:
    from importlib import metadata

    missing = []
    for d in required_distributions():
        try:
            metadata.distribution(d)
        except metadata.PackageNotFoundError:
            missing.append(d)
    return missing


def main(argv: list[str] | None = None) -> int:
    missing = missing_dependencies()
    if missing:
        base = [d for d in missing if d in ("torch", "triton", "ray")]
        fix = ("install them in every node's image (`--install` leaves torch, triton and ray to the nodes)" if base else
               "submit with `hmscale submit --install` (Ray pip-installs hmscale's dependencies into the job's "
               "environment) or install them on every node")
        print(f"hmscale: error: the job's Python lacks {', '.join(missing)}; {fix}", file=sys.stderr)
        return 2
    from hmscale.config import ConfigError, build_config, load_config

    if os.environ.get("HMSCALE_NO_PROGRESS") == "1":  # as `hmscale run`: the hub's bars too ("Loading weights")
        from hmscale.cli import _quiet_hub_progress_bars

        _quiet_hub_progress_bars()
    ap = argparse.ArgumentParser(prog="python -m ray_jobs.run_recipe")
    ap.add_argument("--config", default=None, help="YAML config (default: $HMSCALE_CONFIG_B64 or the embedded demo)")
    ap.add_argument("-s", "--set", action="append", default=[], dest="overrides", help="dotted override")
    args = ap.parse_args(argv)
    try:
        if args.config is None and os.environ.get("HMSCALE_CONFIG_B64"):
            from hmscale.submit import decode_config

            cfg = build_config(decode_config(os.environ["HMSCALE_CONFIG_B64"]), args.overrides)
        else:
            cfg = load_config(args.config, args.overrides)
    except ConfigError as err:
        print(f"hmscale: error: {err}", file=sys.stderr)
        return 2
    from hmscale.submit import job_copy_refusal

    refusal = job_copy_refusal(cfg)
    if refusal:
        print(f"hmscale: error: {refusal}", file=sys.stderr)
        return 2
    from hmscale.recipe import RecipeError, run_recipe
    from hmscale.train.engine import TrainingError

    try:
        results = run_recipe(cfg)
    except (RecipeError, ConfigError) as err:  # as `hmscale run`: one line, 2 = bad input (another run's directory,
        # a bad setting, a cluster that cannot be joined)
        print(f"hmscale: error: {err}", file=sys.stderr)
        return 2
    except TrainingError as err:
        print(f"hmscale: error: {err}", file=sys.stderr)
        return 1
    from hmscale.recipe import results_lines

    for line in results_lines(results):  # the table `hmscale run` prints, in the job's log
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
