"""Per-layer capture of a GPT-NeoX teacher's attention: its input, q/k/v and per-head output.

Hooks sit on each chosen layer's attention module: a forward pre-hook reads the attention input
(the output of the layer's first LayerNorm); q, k (after partial rotary), v and the per-head causal
softmax output (before the `dense` output projection) are computed from it with the shared math of
`hmscale.models.neox_attention`, the same code the students use. Tests check the result against
the model's own forward: `dense(attn_output)` equals the module's output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hmscale.models.neox_attention import qkv_with_rotary, softmax_attention


@dataclass
class LayerCapture:
    attn_input: torch.Tensor  # (b, l, d)   LN1(x), the attention module's input
    q: torch.Tensor  # (b, l, h, p)   after rotary
    k: torch.Tensor  # (b, l, h, p)   after rotary
    v: torch.Tensor  # (b, l, h, p)
    attn_output: torch.Tensor  # (b, l, h, p)   per-head softmax attention output, before dense

    def merged_output(self) -> torch.Tensor:
        """attn_output with heads merged, (b, l, h*p): the input of the dense projection."""
        b, l, h, p = self.attn_output.shape
        return self.attn_output.reshape(b, l, h * p)


class _StopForward(Exception):
    pass


def _layers_of(model):
    base = getattr(model, "gpt_neox", model)
    return base.layers


def _resolve_layers(model, layers) -> list[int]:
    n = len(_layers_of(model))
    if layers is None or layers == "all":
        return list(range(n))
    out = sorted({int(i) % n if int(i) < 0 else int(i) for i in layers})
    bad = [i for i in out if not 0 <= i < n]
    if bad:
        raise IndexError(f"capture layers {bad} out of range: the teacher has {n} layers")
    return out


class capture_hooks:
    """Context manager: hooks the chosen layers; after any teacher forward, `.results` holds the captures.

        with capture_hooks(teacher, layers=[0, 2]) as cap:
            logits = teacher(input_ids).logits
        cap.results[2].attn_output  # (b, l, h, p)

    `positions` (b or 1, l) overrides the position ids (default: those the model is called with,
    else 0..l-1). With `stop_after_last=True` the forward is cut short after the last hooked layer
    (use `capture_layers`, which catches that).
    """

    def __init__(self, model, layers=None, positions: torch.Tensor | None = None, stop_after_last: bool = False):
        self.model = model
        self.layers = _resolve_layers(model, layers)
        self.positions = positions
        self.stop_after_last = stop_after_last
        self.results: dict[int, LayerCapture] = {}
        self._handles = []

    def _pre_hook(self, idx: int):
        config = self.model.config

        def hook(module, args, kwargs):
            h = args[0] if args else kwargs["hidden_states"]
            past = kwargs.get("layer_past")
            if past is not None and past.get_seq_length(idx) > 0:
                raise RuntimeError("capture hooks need whole sequences: call the teacher without a KV cache of earlier tokens")
            positions = self.positions
            if positions is None:
                positions = kwargs.get("position_ids")
            with torch.no_grad():
                q, k, v = qkv_with_rotary(module, h, config, positions)
                o = softmax_attention(q, k, v)
            self.results[idx] = LayerCapture(
                attn_input=h.detach(), q=q.detach(), k=k.detach(), v=v.detach(), attn_output=o.detach()
            )
            if self.stop_after_last and idx == self.layers[-1]:
                raise _StopForward

        return hook

    def __enter__(self):
        layers = _layers_of(self.model)
        for i in self.layers:
            self._handles.append(layers[i].attention.register_forward_pre_hook(self._pre_hook(i), with_kwargs=True))
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        return exc[0] is _StopForward  # swallow only our own early stop


@torch.no_grad()
def capture_layers(teacher, input_ids: torch.Tensor, layers=None, positions: torch.Tensor | None = None) -> dict[int, LayerCapture]:
    """Run the teacher on input_ids (b, l) and return {layer: LayerCapture} for the chosen layers (all by default).

    The forward stops after the last chosen layer (no wasted compute on later layers or the LM head).
    """
    with capture_hooks(teacher, layers, positions=positions, stop_after_last=True) as cap:
        base = getattr(teacher, "gpt_neox", teacher)
        kwargs = {"position_ids": positions} if positions is not None else {}
        base(input_ids=input_ids, use_cache=False, **kwargs)
    return cap.results
