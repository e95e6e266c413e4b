"""What identifies a run directory's models, for resuming it: every setting but evaluation, locations and placement.

Evaluation settings may change between reruns (the eval stage is redone when those it reads change; how often stage 2
validates, ``NOT_TRAINING``, changes no weight), a run directory and the caches may be moved, and the same run may be
resumed by the other engine or on another cluster; any other change makes it another run, and the settings that differ
are named.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import yaml

from hmscale.config import ConfigError, RunConfig, build_config
from hmscale.data.cachedir import stable_hash  # RunConfig.hash's digest, of any JSON tree

NOT_IDENTITY = ("eval", "output_dir")  # whole sections
# where things are kept and how the work is placed: none of them changes what is trained
PLACEMENT = ("data.cache_dir", "cache.root", "cache.engine", "cache.workers", "cache.max_retries",
             "cache.allow_exceed_disk", "parallel.engine", "parallel.ray_address", "parallel.max_failures",
             "parallel.checkpoint_every", "parallel.keep_checkpoints")
# settings inside the training sections that change no trained weight (stage 2's validation: lines of metrics.jsonl);
# the key holds them at their defaults (not dropped: every run keyed before, at the default, keeps its key)
NOT_TRAINING = ("stage2.eval_every",)


def _default(dotted: str):
    section, field = dotted.split(".")
    return RunConfig.model_fields[section].annotation.model_fields[field].default


def _identity_tree(tree: dict, settled: bool = True) -> dict:
    """A config tree without the settings that are not part of a run's identity (``settled``: ``NOT_TRAINING`` at
    their defaults; without, as runs were keyed before 2026-12-06)."""
    out = {k: copy.deepcopy(v) for k, v in tree.items() if k not in NOT_IDENTITY}
    for dotted in PLACEMENT:
        section, field = dotted.split(".")
        if isinstance(out.get(section), dict):
            out[section].pop(field, None)
    for dotted in NOT_TRAINING if settled else ():
        section, field = dotted.split(".")
        if isinstance(out.get(section), dict) and field in out[section]:
            out[section][field] = _default(dotted)
    return out


def training_hash(cfg: RunConfig) -> str:
    """The run's key: a hash of every setting but ``NOT_IDENTITY`` and ``PLACEMENT`` (``NOT_TRAINING`` held at
    their defaults)."""
    return stable_hash(_identity_tree(cfg.model_dump(mode="json")))


def eval_hash(cfg: RunConfig) -> str:
    """The settings the recipe's eval stage reads (eval.tasks are `hmscale eval`'s)."""
    return stable_hash([cfg.eval.max_sequences, cfg.eval.context_length, cfg.eval.generate_tokens])


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


def changed_settings(tree: dict, cfg: RunConfig, inputs_dir: str | None = None) -> list[str]:
    """The training settings ('field: old -> new') in which ``cfg`` differs from a saved config tree (read through
    the current schema: fields added since take their defaults). Inputs read by path (``INPUTS``) are compared by the
    files they name, the saved tree's relative ones from ``inputs_dir`` (where its run read them; default: here), the
    config's from here: `hmscale submit` to a cluster on this machine writes them absolute, `hmscale run` keeps them
    as given, and either resumes the other's run."""
    try:
        tree = build_config(tree).model_dump(mode="json")
    except ConfigError:
        pass
    old, new = _flat(tree), _flat(cfg.model_dump(mode="json"))
    same = {k for k in INPUTS if k in old and k in new
            and _resolved(k, old[k], inputs_dir) == _resolved(k, new[k], None)}
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new))
            if k.split(".")[0] not in NOT_IDENTITY and k not in PLACEMENT and k not in NOT_TRAINING
            and k not in same and old.get(k) != new.get(k)]


INPUTS = ("data.paths", "teacher.name_or_path", "tokenizer.name_or_path")  # inputs a run reads by path


def _resolved(key: str, value, base: str | None):
    """An input setting with its relative local paths made absolute against ``base`` (default: here); a hub id, a
    glob's pattern characters and anything not text stay as they are."""
    from hmscale.config import looks_like_path

    root = Path(base or os.getcwd())
    absolute = lambda p: os.path.abspath(root / os.path.expanduser(p))  # noqa: E731
    if key == "data.paths" and isinstance(value, list):
        return [absolute(p) if isinstance(p, str) else p for p in value]
    if isinstance(value, str) and looks_like_path(value, root):
        return absolute(value)
    return value


def keyed_by(tree: dict, stored_hash: str | None) -> bool:
    """Whether a run's stored key was computed from this saved config tree: ``training_hash`` of it as it was saved
    (before fields were added to the schema since), with ``NOT_TRAINING`` as given (how runs were keyed before
    2026-12-06), the tree without eval / output_dir only (how runs were keyed on 2026-12-05, before ``PLACEMENT``), or
    the whole tree's hash (before that). Then config.yaml vouches for the run, and ``changed_settings`` says whether it
    is this config's."""
    keys = (stable_hash(_identity_tree(tree)), stable_hash(_identity_tree(tree, settled=False)),
            stable_hash({k: v for k, v in tree.items() if k not in NOT_IDENTITY}), stable_hash(tree))
    return stored_hash in keys


def run_mismatch(run_dir: Path, stored_hash: str | None, cfg: RunConfig) -> list[str] | None:
    """Whether the run kept in ``run_dir`` (its stored key; None: it keeps none, as the stage commands) is ``cfg``'s
    run: None when it is (the same key, or a key an older hmscale computed from a config.yaml of the same training
    settings, or, without a key, a config.yaml of the same settings), else the differing settings ('field: old ->
    new'; empty when config.yaml is missing or unreadable, so the run cannot be matched)."""
    if stored_hash is not None and stored_hash == training_hash(cfg):
        return None
    tree = saved_tree(run_dir)
    if tree is None:
        return []
    diff = changed_settings(tree, cfg, _inputs_dir(run_dir))
    if diff == [] and (stored_hash is None or keyed_by(tree, stored_hash)):
        return None
    return diff or ["its key does not match its config.yaml"]


def _inputs_dir(run_dir: Path) -> str | None:
    """Where the run in ``run_dir`` read its relative inputs (results.json's inputs_dir, which the recipe writes)."""
    from hmscale.recipe import run_inputs_dir

    return run_inputs_dir(run_dir)


def different_run(run_dir: Path, diff: list[str], fix: str = "choose another output_dir or delete that directory",
                  what: str = "output_dir", finished: bool = False) -> str:
    """The one-line refusal for ``run_mismatch``'s answer (``diff``)."""
    run = "a finished run" if finished else "a run"
    if not diff:
        return (f"{what}: {run_dir} holds {run} whose config.yaml is missing or unreadable, so it cannot be matched "
                f"to this config; {fix}")
    listed = f" ({', '.join(diff[:4])}{', ...' if len(diff) > 4 else ''})"
    return f"{what}: {run_dir} holds {run} of a different config{listed}; {fix}"


def saved_config_mismatch(run_dir: Path, cfg: RunConfig) -> str | None:
    """For a directory without a stored key (the stage commands keep no results.json; a recipe run killed before its
    first record): the refusal when ``run_dir`` already holds a run (its config.yaml) of other training settings, else
    None. ``cfg`` with absolute paths, as runs save it."""
    if not (Path(run_dir) / "config.yaml").exists():
        return None
    diff = run_mismatch(run_dir, None, cfg)
    return None if diff is None else different_run(run_dir, diff)


INPUTS_FILE = "inputs.json"  # in a run directory: the inputs read by path, absolute, as its stages read them


def recorded_inputs_dir(run_dir) -> str | None:
    """The folder the relative inputs of the run's config.yaml were read from, found from ``INPUTS_FILE`` (the stages'
    absolute record); None when nothing relative is there to place, or without a record."""
    import json

    try:
        rec = json.loads((Path(run_dir) / INPUTS_FILE).read_text())
        tree = yaml.safe_load((Path(run_dir) / "config.yaml").read_text()) or {}
    except (OSError, ValueError, yaml.YAMLError):
        return None
    if not isinstance(rec, dict) or not isinstance(tree, dict):
        return None
    data, pairs = tree.get("data") or {}, []
    if isinstance(data.get("paths"), list) and isinstance(rec.get("data.paths"), list):
        pairs += zip(data["paths"], rec["data.paths"])
    for section in ("teacher", "tokenizer"):
        pairs.append(((tree.get(section) or {}).get("name_or_path"), rec.get(f"{section}.name_or_path")))
    for given, absolute in pairs:
        if not (isinstance(given, str) and isinstance(absolute, str)) or given == absolute:
            continue  # (a hub id, an absolute path)
        given = os.path.expanduser(given)
        for base in Path(absolute).parents:  # where `given` was resolved from: the folder it names `absolute` in
            if os.path.abspath(base / given) == absolute:
                return str(base)
    return None
