"""Saved HedgeMamba directories that load with ``trust_remote_code=True``, without importing hmscale first.

``AutoModelForCausalLM.from_pretrained(d)`` finds HedgeMamba once ``hmscale.models`` is imported (it registers the
model type). Tools that only take a path (``lm_eval --model hf --model_args pretrained=d,trust_remote_code=True``,
``transformers.pipeline``, a colleague's notebook) do not import it; for them every HedgeMamba ``save_pretrained``
adds what transformers' remote-code loading reads: an ``auto_map`` in config.json and a one-line module that takes
the classes from the installed hmscale package (the model code is not copied: one implementation, the installed one).
"""

from __future__ import annotations

import json
from pathlib import Path

MODULE = "modeling_hedgemamba"
SHIM = (
    "# Written by hmscale (HedgeMamba's save_pretrained): `trust_remote_code=True` loads HedgeMamba from the installed\n"
    "# hmscale package; the model's code is not copied here.\n"
    "try:\n"
    "    from hmscale.models.hedgemamba import HedgeMambaConfig, HedgeMambaForCausalLM, HedgeMambaModel  # noqa: F401\n"
    "except ModuleNotFoundError as err:\n"
    "    if (err.name or \"hmscale\").split(\".\")[0] != \"hmscale\":  # hmscale is there, something it imports is not\n"
    "        raise\n"
    "    raise ImportError(\"this HedgeMamba model needs the hmscale package: pip install -e <hmscale checkout> \"\n"
    "                      \"(it is not on PyPI)\") from err\n"
)
AUTO_MAP = {"AutoConfig": f"{MODULE}.HedgeMambaConfig", "AutoModelForCausalLM": f"{MODULE}.HedgeMambaForCausalLM",
            "AutoModel": f"{MODULE}.HedgeMambaModel"}


def write_remote_code(model_dir: str | Path) -> None:
    """Add the shim module and config.json's ``auto_map`` to a saved HedgeMamba directory."""
    d = Path(model_dir)
    cfg_path = d / "config.json"
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("model_type") != "hedgemamba":
        raise ValueError(f"{cfg_path}: model_type {cfg.get('model_type')!r}, not a HedgeMamba model")
    (d / f"{MODULE}.py").write_text(SHIM)
    cfg["auto_map"] = AUTO_MAP
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
