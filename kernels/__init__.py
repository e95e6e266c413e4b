"""SSD (Mamba-2 state-space duality) kernels and the mixer's glue around them (Hedgehog feature map, causal
depthwise conv, qkv split with rotary, output gate): Triton on CUDA, plain PyTorch elsewhere.

Public API (see DESIGN.md, "Contracts"):

- ``ssd(x, dt, A, B, C, chunk_size=64, D=None, initial_state=None, seq_idx=None, normalize=False,
  return_final_state=False, backend=None)``
- ``ssd_step(state, x_t, dt_t, A, B_t, C_t, D=None, normalize=False, backend=None) -> (y_t, new_state)``
- ``ssd_reference`` (quadratic form), ``ssd_recurrent_reference`` (token loop), ``ssd_chunked_torch``
  (the CPU path), ``ssd_triton`` (the Triton path).
- The mixer's glue, one Triton kernel each way, each beside its plain reference:
  ``hedgehog_feature_map(u, weight, bias)`` (``feature_map.py``; ``hedgehog_feature_map_reference``),
  ``causal_depthwise_conv_triton(x, prev, weight, bias)`` (``conv.py``; ``causal_depthwise_conv_reference``),
  ``split_qkv_rotary_triton(qkv, n_heads, cos, sin)`` (``rotary.py``; the model's plain NeoX split + rotary),
  ``sigmoid_gate_triton(y, z)`` (``gate.py``; ``sigmoid_gate_reference``).
- ``compat.mamba_chunk_scan_combined`` / ``compat.selective_state_update``: mamba_ssm's signatures (dt_bias,
  softplus, dt_limit, the z gate; the decode step in place) on ``ssd`` / ``ssd_step``.
- The training loss: ``cross_entropy_sum_triton(logits, target)`` and ``next_token_loss_sums(logits, input_ids,
  topk_ids=None, topk_logprobs=None, temperature=1.0)`` (cross-entropy and the cached top-k KD term;
  ``cross_entropy.py``; ``cross_entropy_reference``).

Backend choice: the ``backend`` argument, else the environment variable ``HMSCALE_SSD_BACKEND``
(``auto`` | ``triton`` | ``torch`` | ``reference``), else ``auto``: Triton for CUDA tensors, the chunked
PyTorch path otherwise (and for float64 inputs, which the Triton kernels do not compute). The model's glue follows the same choice outside compiled graphs (``glue_on_triton``). Forcing ``triton`` on CPU tensors needs ``TRITON_INTERPRET=1`` (tests do this; ``ssd`` then applies
``kernels.interpreter``'s bf16 fixes itself, as does ``ssd_step``).

``ssd_step`` is differentiable on both backends: the fused Triton step is one launch without autograd (under
``torch.no_grad`` / ``inference_mode``, or when no input requires grad); where autograd needs gradients its backward
differentiates the PyTorch step.

The normaliser (``normalize=True``) is divided without an epsilon.

Arguments are checked before any work, on shapes, dtypes and devices only (no host synchronisation): a wrong one
raises a one-line ``ValueError`` naming it (``check_ssd_args``; ``step.check_step_args`` for the decode step).
``seq_idx`` values are not read: a new document starts wherever it changes, whether it rises or not.
"""

from __future__ import annotations

import os

from .chunked_torch import check_ssd_args, ssd_chunked_torch
from .reference import (causal_depthwise_conv_reference, cross_entropy_reference, hedgehog_feature_map_reference, sigmoid_gate_reference,
                        ssd_recurrent_reference, ssd_reference)

__all__ = ["ssd", "ssd_step", "check_ssd_args", "ssd_reference", "ssd_recurrent_reference", "ssd_chunked_torch",
           "ssd_triton", "ssd_step_torch", "ssd_step_triton", "resolve_backend", "glue_on_triton",
           "hedgehog_feature_map", "hedgehog_feature_map_reference",
           "causal_depthwise_conv_triton", "causal_depthwise_conv_reference", "split_qkv_rotary_triton",
           "sigmoid_gate_triton", "sigmoid_gate_reference",
           "cross_entropy_sum_triton", "next_token_loss_sums", "cross_entropy_reference"]

_BACKENDS = ("auto", "triton", "torch", "reference")


def glue_on_triton(tensor) -> bool:
    """Whether the mixer's glue ops run their Triton kernels for this tensor: where the backend is Triton, and not
    inside a ``torch.compile`` graph (there inductor fuses the plain references instead)."""
    import torch

    return resolve_backend(tensor) == "triton" and not torch.compiler.is_compiling()


def resolve_backend(tensor, backend=None) -> str:
    choice = backend or os.environ.get("HMSCALE_SSD_BACKEND", "auto")
    if not isinstance(choice, str) or choice.lower() not in _BACKENDS:  # (a non-string: no AttributeError from .lower)
        raise ValueError(f"unknown SSD backend {choice!r}; expected one of {_BACKENDS}")
    choice = choice.lower()
    if choice == "auto":
        return "triton" if getattr(tensor, "is_cuda", False) else "torch"  # (a non-tensor: the checks name it)
    return choice


def ssd(x, dt, A, B, C, chunk_size=64, D=None, initial_state=None, seq_idx=None, normalize=False,
        return_final_state=False, backend=None):
    kw = dict(chunk_size=chunk_size, D=D, initial_state=initial_state, seq_idx=seq_idx,
              normalize=normalize, return_final_state=return_final_state)
    which = _scan_backend(x, backend)
    if which == "triton":
        _patch_interpreter()
        from .ssd_autograd import ssd_triton
        return ssd_triton(x, dt, A, B, C, **kw)  # checks its arguments (check_ssd_args)
    if which == "reference":
        check_ssd_args(x, dt, A, B, C, chunk_size, D, initial_state, seq_idx, normalize)
        return ssd_reference(x, dt, A, B, C, **kw)
    return ssd_chunked_torch(x, dt, A, B, C, **kw)  # checks its arguments


def _scan_backend(x, backend=None, also=None) -> str:
    """``resolve_backend``, except that ``auto`` runs float64 (``x`` or ``also``) on the PyTorch path: the Triton
    kernels compute in fp32 at most (the scan's backward has no float64 form), the PyTorch path in float64."""
    import torch

    which = resolve_backend(x, backend)
    if (which == "triton" and torch.float64 in (getattr(x, "dtype", None), getattr(also, "dtype", None))
            and (backend or os.environ.get("HMSCALE_SSD_BACKEND", "auto")).lower() == "auto"):
        return "torch"
    return which


def _patch_interpreter() -> None:
    """Under ``TRITON_INTERPRET=1`` the interpreter's bf16 dots multiply raw bits and its fp32 -> bf16 conversions
    truncate (``kernels.interpreter``): fix both before the first Triton kernel runs, so a CPU run of the Triton path
    computes what the GPU does (bf16 outputs were off by 1e9 relative without the first, half of all bf16 values one
    ulp toward zero without the second). Nothing happens otherwise."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        from .interpreter import patch_interpreter_bf16_dot, patch_interpreter_device_calls

        patch_interpreter_bf16_dot()
        patch_interpreter_device_calls()


def ssd_step(state, x_t, dt_t, A, B_t, C_t, D=None, normalize=False, backend=None):
    which = _scan_backend(x_t, backend, also=state)
    if which == "triton":
        _patch_interpreter()
        from .step import ssd_step_triton
        return ssd_step_triton(state, x_t, dt_t, A, B_t, C_t, D=D, normalize=normalize)
    from .step_torch import ssd_step_torch  # (no Triton import: the CPU decode path)
    return ssd_step_torch(state, x_t, dt_t, A, B_t, C_t, D=D, normalize=normalize)


# name -> submodule; imported on first use: importing kernels must not require a working Triton (and the
# attribute is looked up in the submodule on every access, so tests can patch it there)
_LAZY = {
    "ssd_triton": "ssd_autograd",
    "ssd_step_torch": "step_torch",
    "ssd_step_triton": "step",
    "hedgehog_feature_map": "feature_map",
    "causal_depthwise_conv_triton": "conv",
    "split_qkv_rotary_triton": "rotary",
    "sigmoid_gate_triton": "gate",
    "cross_entropy_sum_triton": "cross_entropy",
    "next_token_loss_sums": "cross_entropy",
}


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(name)
    import importlib

    if name != "ssd_step_torch":  # a Triton entry point
        _patch_interpreter()

    return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
