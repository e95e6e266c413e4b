"""Tensor parallelism for HedgeMamba, applied from outside the model code.

Whole heads per rank: rank r of a tp group of size t keeps heads ``[r h/t, (r+1) h/t)``. GPT-NeoX's fused
``query_key_value`` is interleaved per head (``[q_i|k_i|v_i]``), so a rank's rows of ``in_proj`` (and
the conv channels) are one contiguous block of ``3 P h/t`` rows. Per-head pieces (feature maps, dt
projection, ``A_log``, ``A_scale``, ``D``, gate projection rows) are sliced the same way; ``out_proj`` is
row-parallel over the same heads. The MLP is column-parallel in ``dense_h_to_4h`` and row-parallel in
``dense_4h_to_h``. Embeddings and LayerNorms stay replicated; the LM head too, unless ``vocab_parallel``
shards it by vocabulary rows (``vocab.py``: the model then returns each rank's slice of the logits, and
the losses use the vocabulary-parallel statistics there; stage 2 does this whenever tp divides the vocabulary).

Collectives per block: two all-reduces forward (after ``out_proj`` and ``dense_4h_to_h``) and two
backward: the mixer's three column-parallel layers (``in_proj``, ``dt_proj``, ``z_proj``) read the same
input, which passes ``copy_to_tp_region`` once (a forward pre-hook on the mixer), so its gradient is
all-reduced once, not three times.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from hmscale.config import ConfigError
from hmscale.models.hedgemamba import HedgeMambaBlock

from .layers import ColumnParallelLinear, RowParallelLinear, copy_to_tp_region, mark_tp_param
from .mesh import ParallelMesh
from .vocab import shard_lm_head

__all__ = ["apply_tensor_parallel", "check_tp_divides", "gather_tensor_parallel_state_dict", "full_numel"]


def check_tp_divides(n_heads: int, tp: int, intermediate_size: int | None = None) -> None:
    """A ``ConfigError`` (one line) unless tp divides the heads and the MLP width: the same on every worker and every
    restart (Ray Train's workers stop on it instead of retrying)."""
    if n_heads % tp:
        raise ConfigError(f"parallel.tp: {tp} does not divide the model's {n_heads} attention heads; pick a divisor of {n_heads}")
    if intermediate_size is not None and intermediate_size % tp:
        raise ConfigError(f"parallel.tp: {tp} does not divide the MLP width {intermediate_size}; pick a divisor of it")


def full_numel(p: torch.Tensor, tp_size: int) -> int:
    """Elements of the whole (unsharded) parameter of which ``p`` is this rank's shard: a tensor-parallel slice
    (``tp_split_dim``) counts ``tp_size`` times, a replicated one once (ZeRO-3's partitioned ``ds_numel`` too)."""
    n = int(getattr(p, "ds_numel", p.numel()))
    return n * tp_size if getattr(p, "tp_split_dim", None) is not None else n


def _slice_param(p: nn.Parameter, index: torch.Tensor, dim: int = 0) -> nn.Parameter:
    new = nn.Parameter(p.detach().index_select(dim, index.to(p.device)).clone(), requires_grad=p.requires_grad)
    return mark_tp_param(new, dim)


def _mixer_input_hook(mesh: ParallelMesh):
    """Forward pre-hook: the mixer's input (replicated over the tp group) enters the tp region once."""

    def hook(module, args):
        return (copy_to_tp_region(args[0], mesh.tp_group, mesh.tp_size), *args[1:])

    return hook


_SHARDED_LINEARS = ("mixer.in_proj", "mixer.dt_proj", "mixer.z_proj", "mixer.out_proj", "mlp.dense_h_to_4h",
                    "mlp.dense_4h_to_h")


def _check_plain_linears(model: nn.Module, vocab_parallel: bool) -> None:
    """A one-line ValueError where a layer to shard is not a plain ``nn.Linear`` (a ``LoRALinear``): the shards are
    rebuilt from its weight and bias alone, and whatever else it holds (the adapters) would be dropped silently.
    (Layers sharded already pass: the loop below says the model is already sharded.)"""
    layers = [(f"{bn}.{ln}" if bn else ln, block.get_submodule(ln.split(".")[0]), ln.split(".")[1])
              for bn, block in model.named_modules() if isinstance(block, HedgeMambaBlock) for ln in _SHARDED_LINEARS]
    if vocab_parallel:
        layers.append(("lm_head", model, "lm_head"))
    for name, parent, attr in layers:
        layer = getattr(parent, attr, None)
        if layer is not None and type(layer) not in (nn.Linear, ColumnParallelLinear, RowParallelLinear):
            raise ValueError(f"apply_tensor_parallel: {name} is a {type(layer).__name__}, not a plain nn.Linear (LoRA "
                             "adapters train with parallel.tp=1 only); sharding it would drop what it adds to the "
                             "linear layer")


def apply_tensor_parallel(model: nn.Module, mesh: ParallelMesh, *, vocab_parallel: bool = False) -> nn.Module:
    """Shard a ``HedgeMambaForCausalLM`` (or ``HedgeMambaModel``) in place over ``mesh``'s tp group; returns it.

    vocab_parallel: also shard the LM head by vocabulary rows (``vocab.shard_lm_head``; a causal LM only)."""
    cfg = model.config
    tp = mesh.tp_size
    check_tp_divides(cfg.num_attention_heads, tp, cfg.intermediate_size)
    if vocab_parallel and tp > 1 and cfg.vocab_size % tp:
        raise ValueError(f"parallel.tp: {tp} does not divide the vocabulary ({cfg.vocab_size}); pick a divisor of it")
    if tp > 1:
        _check_plain_linears(model, vocab_parallel)  # before anything changes
    model.tp_mesh = mesh
    if tp == 1:
        return model
    r = mesh.tp_rank
    H, P = cfg.num_attention_heads, cfg.head_dim
    hl = H // tp
    heads = torch.arange(r * hl, (r + 1) * hl)
    qkv_rows = torch.arange(r * hl * 3 * P, (r + 1) * hl * 3 * P)  # interleaved [q|k|v] per head: contiguous
    head_rows = torch.arange(r * hl * P, (r + 1) * hl * P)
    il = cfg.intermediate_size // tp
    mlp_rows = torch.arange(r * il, (r + 1) * il)
    for block in [m for m in model.modules() if isinstance(m, HedgeMambaBlock)]:
        mx = block.mixer
        if mx.n_heads != H:
            raise ValueError("apply_tensor_parallel: the model is already sharded")
        mx.in_proj = ColumnParallelLinear.from_linear(mx.in_proj, qkv_rows, mesh, reduce_input_grad=False)
        if mx.conv is not None:
            mx.conv.weight = _slice_param(mx.conv.weight, qkv_rows)
            mx.conv.bias = _slice_param(mx.conv.bias, qkv_rows)
            mx.conv.channels = len(qkv_rows)
        fm = mx.feature_map
        fm.weight = _slice_param(fm.weight, heads)
        fm.bias = _slice_param(fm.bias, heads)
        fm.n_heads = hl
        if cfg.ssm:
            mx.dt_proj = ColumnParallelLinear.from_linear(mx.dt_proj, heads, mesh, reduce_input_grad=False)
            mx.A_log = _slice_param(mx.A_log, heads)
            mx.A_scale = _slice_param(mx.A_scale, heads)
            mx.D = _slice_param(mx.D, heads)
        if mx.z_proj is not None:
            mx.z_proj = ColumnParallelLinear.from_linear(mx.z_proj, head_rows, mesh, reduce_input_grad=False)
        mx.out_proj = RowParallelLinear.from_linear(mx.out_proj, head_rows, mesh)
        mx.n_heads = hl
        mx.register_forward_pre_hook(_mixer_input_hook(mesh))
        mlp = block.mlp
        mlp.dense_h_to_4h = ColumnParallelLinear.from_linear(mlp.dense_h_to_4h, mlp_rows, mesh)
        mlp.dense_4h_to_h = RowParallelLinear.from_linear(mlp.dense_4h_to_h, mlp_rows, mesh)
    if vocab_parallel:
        if not hasattr(model, "lm_head"):
            raise ValueError(f"apply_tensor_parallel: vocab_parallel needs a causal LM with an lm_head, not {type(model).__name__}")
        shard_lm_head(model, mesh)
    return model


@torch.no_grad()
def gather_tensor_parallel_state_dict(model: nn.Module, mesh: ParallelMesh) -> dict:
    """The full (unsharded) state dict of a tensor-parallel model (collective over the tp group)."""
    out = {}
    params = dict(model.named_parameters())
    for name, t in model.state_dict().items():
        p = params.get(name)
        dim = getattr(p, "tp_split_dim", None) if p is not None else None
        if dim is None or mesh.tp_size == 1:
            out[name] = t.detach().clone()
            continue
        parts = [torch.empty_like(t) for _ in range(mesh.tp_size)]
        dist.all_gather(parts, t.detach().contiguous(), group=mesh.tp_group)
        out[name] = torch.cat(parts, dim=dim)
    return out
