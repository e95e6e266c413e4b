"""What identifies a run directory's models, for resuming it: every setting but ``eval`` and ``output_dir``.

Evaluation settings may change between reruns (the eval stage is redone when those it reads change) and a run
directory may be moved; any other change makes it another run, and the settings that differ are named.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from hmscale.config import ConfigError, RunConfig, build_config
from hmscale.data.cachedir import stable_hash  # RunConfig.hash's digest, of any JSON tree

NOT_IDENTITY = ("eval", "output_dir")


def training_hash(cfg: RunConfig) -> str:
    """The run's key: a hash of every setting but ``NOT_IDENTITY``."""
    return cfg.hash(*(k for k in cfg.model_dump() if k not in NOT_IDENTITY))


def eval_hash(cfg: RunConfig) -> str:
    """The settings the recipe's eval stage reads (eval.tasks and generate_tokens are `hmscale eval`'s / generate's)."""
    return stable_hash([cfg.eval.max_sequences, cfg.eval.context_length])


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def saved_tree(run_dir: Path) -> dict | None:
    """The config tree the run directory was last given (config.yaml); None when missing or unreadable."""
    try:
        return yaml.safe_load((Path(run_dir) / "config.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        return None


def changed_settings(tree: dict, cfg: RunConfig) -> list[str]:
    """The training settings ('field: old -> new') in which ``cfg`` differs from a saved config tree (read through
    the current schema: fields added since take their defaults)."""
    try:
        tree = build_config(tree).model_dump(mode="json")
    except ConfigError:
        pass
    old, new = _flat(tree), _flat(cfg.model_dump(mode="json"))
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new))
            if k.split(".")[0] not in NOT_IDENTITY and old.get(k) != new.get(k)]


def keyed_by(tree: dict, stored_hash: str | None) -> bool:
    """Whether a run's stored key was computed from this saved config tree: ``training_hash`` of it as it was saved
    (before fields were added to the schema since), or the whole tree's hash (how runs were keyed before
    2026-12-05). Then config.yaml vouches for the run, and ``changed_settings`` says whether it is this config's."""
    return stored_hash in (stable_hash({k: v for k, v in tree.items() if k not in NOT_IDENTITY}), stable_hash(tree))
