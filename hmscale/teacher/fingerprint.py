"""A content fingerprint of a teacher: its architecture config and every weight, bit for bit."""

from __future__ import annotations

import hashlib
import json

import torch

# keys that name where or with what a model was saved, not what it computes
_VOLATILE = {"_name_or_path", "transformers_version", "_commit_hash", "torch_dtype", "dtype", "architectures"}


def config_json(model) -> str:
    cfg = model.config.to_dict()
    cfg = {k: v for k, v in cfg.items() if k not in _VOLATILE}
    return json.dumps(cfg, sort_keys=True, default=str)


def teacher_fingerprint(model) -> str:
    """sha256 over the config json and all weights (sorted by name; name, dtype, shape and raw bytes)."""
    h = hashlib.sha256()
    h.update(config_json(model).encode())
    state = model.state_dict()
    for name in sorted(state):
        t = state[name].detach()
        h.update(f"\0{name}\0{str(t.dtype)}\0{tuple(t.shape)}\0".encode())
        flat = t.to("cpu").contiguous().reshape(-1)
        h.update(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")
    return h.hexdigest()
