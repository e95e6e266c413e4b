"""Ray job entry point for a whole recipe run (what `hmscale submit` starts on the cluster).

    ray job submit --working-dir . -- python -m ray_jobs.run_recipe --config configs/demo.yaml -s seed=1
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

# import name -> distribution, for what a job needs on the node that runs it
NEEDED = {"torch": "torch", "deepspeed": "deepspeed", "transformers": "transformers", "datasets": "datasets",
          "webdataset": "webdataset", "safetensors": "safetensors", "pydantic": "pydantic", "yaml": "pyyaml",
          "tokenizers": "tokenizers", "typer": "typer"}


def missing_dependencies() -> list[str]:
    return [dist for mod, dist in NEEDED.items() if importlib.util.find_spec(mod) is None]


def main(argv: list[str] | None = None) -> int:
    missing = missing_dependencies()
    if missing:
        print(f"hmscale: error: this node's Python lacks {', '.join(missing)}; submit with `hmscale submit --install` "
              "(Ray pip-installs hmscale's dependencies into the job's environment) or install them on every node",
              file=sys.stderr)
        return 2
    from hmscale.config import ConfigError, build_config, load_config

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
    from hmscale.recipe import run_recipe

    results = run_recipe(cfg)
    print({k: results[k] for k in ("teacher_ppl", "hedgehog_ppl", "hedgemamba_ppl") if k in results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
