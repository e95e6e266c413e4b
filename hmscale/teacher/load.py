"""Load a GPT-NeoX teacher (Pythia) from a hub id or a local directory, frozen and in eval mode."""

from __future__ import annotations

import os
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[str(dtype)]
    except KeyError:
        raise ValueError(f"teacher.dtype: {dtype!r} is not supported; use float32 or bfloat16") from None


def looks_like_path(name_or_path: str) -> bool:
    """A local path rather than a hub id ("org/name")."""
    s = str(name_or_path)
    return s.startswith((".", "/", "~")) or s.count("/") > 1 or Path(s).exists()


def freeze(model):
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def load_teacher(name_or_path: str | os.PathLike, dtype="float32", device="cpu"):
    """`GPTNeoXForCausalLM` from a hub id (e.g. EleutherAI/pythia-160m) or a saved directory; frozen, eval."""
    from transformers import GPTNeoXForCausalLM

    torch_dtype = resolve_dtype(dtype)
    name = str(name_or_path)
    if looks_like_path(name):
        path = Path(name).expanduser()
        if not (path / "config.json").is_file():
            what = "does not exist" if not path.exists() else "has no config.json"
            raise FileNotFoundError(f"teacher.name_or_path: {name!r} {what}; point it at a saved GPTNeoX model or a hub id")
        source = str(path)
    else:
        source = name  # hub id: downloaded (or read from the local HF cache) by transformers
    try:
        model = GPTNeoXForCausalLM.from_pretrained(source, dtype=torch_dtype)
    except OSError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise OSError(f"teacher.name_or_path: cannot load {name!r} ({first}); check the hub id, network or HF cache") from err
    return freeze(model.to(device))
