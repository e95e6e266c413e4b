"""CUDA graphs for the student's blocks in training, applied from outside the model code.

The HedgeMamba student is host-bound on an H200: its step issues thousands of small kernel launches, and the
GPU waits on the host between them (BENCHMARKS.md, "Student training"). ``apply_cuda_graphs`` captures each
block's forward and backward as CUDA graphs (``torch.cuda.make_graphed_callables``, one memory pool shared by
the blocks in their order) for the training shape, so a block costs two graph launches instead of a few hundred
kernel launches.

A captured block runs its graphs only for the captured case: training mode with grad enabled, an input of the
captured shape, dtype and ``requires_grad``, no generation cache, no ``seq_idx`` or token mask. Anything else
(validation, generation, the last short batch) runs the block's ordinary forward. The graphs read the
parameters in place, so they are captured after the optimizer owns its final parameter storage (after
``deepspeed.initialize``), and parameters must not be replaced afterwards.

Not with tensor parallelism (collectives inside graphs are not verified) nor with ``parallel.compile``.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["apply_cuda_graphs"]


class _BlockCall(nn.Module):
    """``block(x, (cos, sin))`` with tensor-only arguments, the form ``make_graphed_callables`` captures; it
    holds the block as a submodule, so the block's parameters are the graph's parameters."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x, cos, sin):
        return self.block(x, (cos, sin))


def _dispatch(block: nn.Module, call: nn.Module, eager_forward, shape, dtype, x_requires_grad: bool):
    def forward(x, rope, cache=None, seq_idx=None, token_mask=None):
        captured = (cache is None and seq_idx is None and token_mask is None and block.training
                    and torch.is_grad_enabled() and tuple(x.shape) == shape and x.dtype == dtype
                    and x.requires_grad == x_requires_grad and rope[0].shape[0] == 1)
        if captured:
            return call(x, rope[0], rope[1])
        return eager_forward(x, rope, cache, seq_idx, token_mask)

    return forward


def apply_cuda_graphs(model: nn.Module, batch_size: int, seq_len: int, *, inputs_require_grad: bool = False,
                      num_warmup_iters: int = 3) -> int:
    """Capture every HedgeMamba block of ``model`` (on its CUDA device, in training mode) for inputs of
    ``(batch_size, seq_len, hidden)``; returns how many were captured.

    inputs_require_grad: whether the first block's input requires grad (False with frozen input embeddings,
    as in stage 2); every later block's input does."""
    from hmscale.models.hedgemamba import HedgeMambaBlock
    from hmscale.models.neox_attention import rotary_cos_sin

    blocks = [m for m in model.modules() if isinstance(m, HedgeMambaBlock)]
    if not blocks:
        raise ValueError(f"apply_cuda_graphs: {type(model).__name__} has no HedgeMamba blocks")
    device = next(model.parameters()).device
    if device.type != "cuda":
        raise ValueError("parallel.cuda_graphs: CUDA graphs need the model on a GPU; set parallel.use_gpu=true "
                         "or parallel.cuda_graphs=false")
    if any(getattr(m, "gradient_checkpointing", False) for m in model.modules()):
        raise ValueError("apply_cuda_graphs: activation checkpointing re-runs the blocks in the backward; turn it off")
    if any(getattr(b, "_hmscale_graphed", False) for b in blocks):
        raise ValueError("apply_cuda_graphs: the blocks are already captured")
    cfg = blocks[0].mixer.config
    dtype = blocks[0].input_layernorm.weight.dtype
    shape = (batch_size, seq_len, cfg.hidden_size)
    positions = torch.arange(seq_len, device=device)[None, :]
    cos, sin = rotary_cos_sin(positions, cfg.rotary_ndims, cfg.rotary_emb_base, dtype=dtype)
    calls, samples = [], []
    for i, block in enumerate(blocks):
        x = torch.randn(shape, device=device, dtype=dtype, requires_grad=inputs_require_grad or i > 0)
        calls.append(_BlockCall(block))
        samples.append((x, cos, sin))
    was_training = model.training
    model.train()
    graphed = torch.cuda.make_graphed_callables(tuple(calls), tuple(samples), num_warmup_iters=num_warmup_iters)
    model.train(was_training)
    for i, (block, call) in enumerate(zip(blocks, graphed)):
        eager = block.forward
        # an instance attribute: the module tree (and so the state dict) stays as it was
        block.forward = _dispatch(block, call, eager, shape, dtype, inputs_require_grad or i > 0)
        block._hmscale_graphed = True
    return len(blocks)
