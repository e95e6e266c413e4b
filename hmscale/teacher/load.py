"""Load a GPT-NeoX teacher (Pythia) from a hub id or a local directory, frozen and in eval mode."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from hmscale.hf_load import from_pretrained
from hmscale.models.neox_attention import check_default_rope

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[str(dtype)]
    except KeyError:
        raise ValueError(f"teacher.dtype: {dtype!r} is not supported; use float32 or bfloat16") from None


def freeze(model):
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def _first_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def check_architecture(name: str, config: dict) -> None:
    """Refuse a checkpoint that is not a GPT-NeoX causal LM, before any weight is allocated: `from_pretrained` would
    read another architecture's config.json as GPTNeoXConfig's defaults (a 20B-parameter model for GPT-2's) or
    initialise every weight at random (Llama's: no key matches), both without an error."""
    model_type = config.get("model_type")
    if model_type != "gpt_neox" and not (model_type is None and "GPTNeoXForCausalLM" in (config.get("architectures") or [])):
        archs = ", ".join(config.get("architectures") or []) or "no architectures listed"
        raise ValueError(f"teacher.name_or_path: {name!r} is a {model_type or 'untyped'} checkpoint ({archs}), not "
                         "GPT-NeoX; the teacher must be a GPT-NeoX (Pythia) GPTNeoXForCausalLM")


def check_rope(name: str, config) -> None:
    """The capture and both students recompute q, k with the plain (default) rotary embedding of
    `hmscale.models.neox_attention`: a scaled rotary (linear, dynamic, yarn, ...) would be silently not the teacher's.
    `config`: the model's config, or config.json as read (checked before transformers builds the model, which raised
    a bare KeyError for a rope type it does not know)."""
    check_default_rope(config, f"teacher.name_or_path: {name!r}")


def load_teacher(name_or_path: str | os.PathLike, dtype="float32", device="cpu"):
    """`GPTNeoXForCausalLM` from a hub id (e.g. EleutherAI/pythia-160m) or a saved directory; frozen, eval.

    Refused with one line: another architecture, a checkpoint missing weights (which `from_pretrained` would
    initialise at random: e.g. a `GPTNeoXModel` without its LM head), weights whose shapes differ from its
    config.json, a damaged (e.g. truncated) safetensors file or shard index, a scaled rotary embedding, a config.json
    transformers refuses (a field of the wrong type, heads that do not divide the hidden size)."""
    import json

    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # huggingface_hub < 0.32 (transformers 4 may install one): no strict configs, nothing to catch
        StrictDataclassError = ()
    from safetensors import SafetensorError
    from transformers import GPTNeoXForCausalLM, PretrainedConfig

    from hmscale.config import looks_like_path

    torch_dtype = resolve_dtype(dtype)
    name = str(name_or_path)
    if looks_like_path(name):
        path = Path(name).expanduser()
        if not (path / "config.json").is_file():
            what = ("does not exist" if not path.exists() else
                    "is a file, not a model directory" if path.is_file() else "has no config.json")
            raise FileNotFoundError(f"teacher.name_or_path: {name!r} {what}; point it at a saved GPTNeoX model or a hub id")
        source = str(path)
    else:
        source = name  # hub id: downloaded (or read from the local HF cache) by transformers
    try:
        config_dict, _ = PretrainedConfig.get_config_dict(source)
        check_architecture(name, config_dict)
        check_rope(name, config_dict)
        model, info = from_pretrained(GPTNeoXForCausalLM, source, dtype=torch_dtype, output_loading_info=True)
    except StrictDataclassError as err:  # transformers 5's config validation (not a ValueError; several lines)
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        raise ValueError(f"teacher.name_or_path: {name!r}: transformers refuses its config.json "
                         f"({lines[-1] if lines else type(err).__name__}); fix config.json") from err
    except json.JSONDecodeError as err:  # (config.json's own is an OSError above) a partly copied shard index
        raise ValueError(f"teacher.name_or_path: cannot load {name!r}: its weight index (*.index.json) is damaged or "
                         f"incomplete ({_first_line(err)}); copy or download it again") from err
    except OSError as err:
        raise OSError(f"teacher.name_or_path: cannot load {name!r} ({_first_line(err)}); check the hub id, network or "
                      "HF cache") from err
    except SafetensorError as err:  # a partly copied or downloaded weight file (no command catches this type)
        raise ValueError(f"teacher.name_or_path: cannot load {name!r}: a weight file is damaged or incomplete "
                         f"({_first_line(err)}); copy or download it again") from err
    except RuntimeError as err:
        if "ignore_mismatched_sizes" not in str(err):  # (an out-of-memory error is a RuntimeError too)
            raise
        # weights whose shapes differ from the config (transformers prints a table of them first)
        raise ValueError(f"teacher.name_or_path: cannot load {name!r}: the shapes of its weights differ from its "
                         "config.json (the MISMATCH rows above); fix the config or the weights") from err
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ValueError(f"teacher.name_or_path: {name!r} lacks weights {', '.join(missing[:3])}{more} (they would be "
                         "random); save the whole GPTNeoXForCausalLM (model.save_pretrained)")
    # weights the config does not use (transformers drops them, a table on stderr): a config.json of fewer layers or
    # without attention biases gave another, smaller model (transformers' own ignore list, e.g. the old attention
    # buffers and rotary inv_freq, is not reported; other cached tables, not weights or biases, are let through)
    unused = sorted(k for k in info.get("unexpected_keys") or () if k.endswith((".weight", ".bias")))
    if unused:
        more = f" and {len(unused) - 3} more" if len(unused) > 3 else ""
        raise ValueError(f"teacher.name_or_path: {name!r} has weights its config.json does not use: "
                         f"{', '.join(unused[:3])}{more} (they would be dropped); fix config.json (e.g. "
                         "num_hidden_layers, attention_bias) to match the weights")
    check_rope(name, model.config)
    return freeze(model.to(device))
