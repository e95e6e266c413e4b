"""SSD (Mamba-2 state-space duality) kernels and the mixer's glue around them (Hedgehog feature map, causal
depthwise conv, qkv split with rotary, output gate): Triton on CUDA, plain PyTorch elsewhere.

Public API (see DESIGN.md, "Contracts"):

- ``ssd(x, dt, A, B, C, chunk_size=64, D=None, initial_state=None, seq_idx=None, normalize=False,
  return_final_state=False, backend=None)``
- ``ssd_step(state, x_t, dt_t, A, B_t, C_t, D=None, normalize=False, backend=None) -> (y_t, new_state)``
- ``ssd_reference`` (quadratic form), ``ssd_recurrent_reference`` (token loop), ``ssd_chunked_torch``
  (the CPU path), ``ssd_triton`` (the Triton path).
- ``hedgehog_feature_map(u, weight, bias)``: the Hedgehog feature map fused in Triton (``feature_map.py``),
  beside ``hedgehog_feature_map_reference``.
- ``causal_depthwise_conv_triton(x, prev, weight, bias)``: the mixer's short causal conv (``conv.py``), beside
  ``causal_depthwise_conv_reference``; ``split_qkv_rotary_triton(qkv, n_heads, cos, sin)``: the qkv split with
  NeoX partial rotary (``rotary.py``; its reference is the model's plain NeoX split + rotary);
  ``sigmoid_gate_triton(y, z)``: the output gate ``y * 2 sigmoid(z)`` (``gate.py``), beside ``sigmoid_gate_reference``.

Backend choice: the ``backend`` argument, else the environment variable ``HMSCALE_SSD_BACKEND``
(``auto`` | ``triton`` | ``torch`` | ``reference``), else ``auto``: Triton for CUDA tensors, the chunked
PyTorch path otherwise. Forcing ``triton`` on CPU tensors needs ``TRITON_INTERPRET=1`` (tests do this).

The normaliser (``normalize=True``) is divided without an epsilon.
"""

from __future__ import annotations

import os

from .chunked_torch import ssd_chunked_torch
from .reference import (causal_depthwise_conv_reference, hedgehog_feature_map_reference, sigmoid_gate_reference,
                        ssd_recurrent_reference, ssd_reference)

__all__ = ["ssd", "ssd_step", "ssd_reference", "ssd_recurrent_reference", "ssd_chunked_torch",
           "ssd_triton", "ssd_step_torch", "ssd_step_triton", "resolve_backend",
           "hedgehog_feature_map", "hedgehog_feature_map_reference",
           "causal_depthwise_conv_triton", "causal_depthwise_conv_reference", "split_qkv_rotary_triton",
           "sigmoid_gate_triton", "sigmoid_gate_reference"]

_BACKENDS = ("auto", "triton", "torch", "reference")


def resolve_backend(tensor, backend=None) -> str:
    choice = (backend or os.environ.get("HMSCALE_SSD_BACKEND", "auto")).lower()
    if choice not in _BACKENDS:
        raise ValueError(f"unknown SSD backend {choice!r}; expected one of {_BACKENDS}")
    if choice == "auto":
        return "triton" if tensor.is_cuda else "torch"
    return choice


def ssd(x, dt, A, B, C, chunk_size=64, D=None, initial_state=None, seq_idx=None, normalize=False,
        return_final_state=False, backend=None):
    kw = dict(chunk_size=chunk_size, D=D, initial_state=initial_state, seq_idx=seq_idx,
              normalize=normalize, return_final_state=return_final_state)
    which = resolve_backend(x, backend)
    if which == "triton":
        from .ssd_autograd import ssd_triton
        return ssd_triton(x, dt, A, B, C, **kw)
    if which == "reference":
        return ssd_reference(x, dt, A, B, C, **kw)
    return ssd_chunked_torch(x, dt, A, B, C, **kw)


def ssd_step(state, x_t, dt_t, A, B_t, C_t, D=None, normalize=False, backend=None):
    which = resolve_backend(x_t, backend)
    if which == "triton":
        from .step import ssd_step_triton
        return ssd_step_triton(state, x_t, dt_t, A, B_t, C_t, D=D, normalize=normalize)
    from .step import ssd_step_torch
    return ssd_step_torch(state, x_t, dt_t, A, B_t, C_t, D=D, normalize=normalize)


def __getattr__(name):  # lazy: importing kernels must not require a working Triton
    if name == "ssd_triton":
        from .ssd_autograd import ssd_triton
        return ssd_triton
    if name == "sigmoid_gate_triton":
        from .gate import sigmoid_gate_triton
        return sigmoid_gate_triton
    if name == "split_qkv_rotary_triton":
        from .rotary import split_qkv_rotary_triton
        return split_qkv_rotary_triton
    if name == "causal_depthwise_conv_triton":
        from .conv import causal_depthwise_conv_triton
        return causal_depthwise_conv_triton
    if name == "hedgehog_feature_map":
        from .feature_map import hedgehog_feature_map
        return hedgehog_feature_map
    if name in ("ssd_step_torch", "ssd_step_triton"):
        from . import step
        return getattr(step, name)
    raise AttributeError(name)
