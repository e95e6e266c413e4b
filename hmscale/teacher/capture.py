"""Per-layer capture of a GPT-NeoX teacher's attention: its input, q/k/v and per-head output.

Hooks sit on each chosen layer's attention module: a forward pre-hook reads the attention input
(the output of the layer's first LayerNorm) and a pre-hook on its `dense` output projection reads
the per-head attention output the model itself computed (no second attention pass). q, k (after
partial rotary) and v are recomputed from the input with the shared math of
`hmscale.models.neox_attention`, the code the students use, only when asked for (`qkv=True`).
Tests check the result against the model's own forward: `dense(attn_output)` equals the module's
output, and the recomputed softmax attention of q, k, v equals attn_output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hmscale.models.neox_attention import check_default_rope, qkv_with_rotary
from hmscale.teacher.whole_sequences import whole_sequences


@dataclass
class LayerCapture:
    attn_input: torch.Tensor  # (b, l, d)   LN1(x), the attention module's input
    attn_output: torch.Tensor  # (b, l, h, p)   per-head softmax attention output, before dense
    q: torch.Tensor | None = None  # (b, l, h, p)   after rotary (qkv=True)
    k: torch.Tensor | None = None  # (b, l, h, p)   after rotary (qkv=True)
    v: torch.Tensor | None = None  # (b, l, h, p)   (qkv=True)

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
    asked = [int(i) for i in layers]
    bad = [i for i in asked if not -n <= i < n]  # as Python indexes a list: -n..n-1 (-4 of 3 layers did wrap to 2)
    if bad:
        raise IndexError(f"capture layers {bad} out of range: the teacher has {n} layers")
    return sorted({i % n for i in asked})


class capture_hooks:
    """Context manager: hooks the chosen layers; after any teacher forward, `.results` holds the captures.

        with capture_hooks(teacher, layers=[0, 2]) as cap:
            logits = teacher(input_ids).logits
        cap.results[2].attn_output  # (b, l, h, p)

    `positions` (b or 1, l) overrides the position ids (default: those the model is called with,
    else 0..l-1). With `stop_after_last=True` the forward is cut short after the last hooked layer
    (use `capture_layers`, which catches that).
    """

    def __init__(self, model, layers=None, positions: torch.Tensor | None = None, stop_after_last: bool = False,
                 qkv: bool = True):
        if qkv:  # q, k are recomputed with the default rotary (attn_input and attn_output are the model's own)
            check_default_rope(model.config, "capture (qkv=True)")
        self.model = model
        self.layers = _resolve_layers(model, layers)
        self.positions = positions
        self.stop_after_last = stop_after_last
        self.qkv = qkv
        self.results: dict[int, LayerCapture] = {}
        self._inputs: dict[int, tuple] = {}
        self._handles = []

    def _pre_hook(self, idx: int):
        config = self.model.config

        def hook(module, args, kwargs):
            h = args[0] if args else kwargs["hidden_states"]
            past = kwargs.get("layer_past")
            if past is not None and past.get_seq_length(idx) > 0:
                raise RuntimeError("capture hooks need whole sequences: call the teacher without a KV cache of earlier tokens")
            qkv = None
            if self.qkv:
                positions = self.positions
                if positions is None:
                    positions = kwargs.get("position_ids")
                with torch.no_grad():
                    qkv = tuple(t.detach() for t in qkv_with_rotary(module, h, config, positions))
            self._inputs[idx] = (h.detach(), qkv)

        return hook

    def _dense_hook(self, idx: int):
        n_heads = self.model.config.num_attention_heads

        def hook(module, args):
            merged = args[0].detach()  # (b, l, h*p): the attention output the model computed
            b, l, hp = merged.shape
            h, qkv = self._inputs.pop(idx)
            q, k, v = qkv if qkv is not None else (None, None, None)
            self.results[idx] = LayerCapture(attn_input=h, attn_output=merged.view(b, l, n_heads, hp // n_heads),
                                             q=q, k=k, v=v)
            if self.stop_after_last and idx == self.layers[-1]:
                raise _StopForward

        return hook

    def __enter__(self):
        layers = _layers_of(self.model)
        for i in self.layers:
            attention = layers[i].attention
            self._handles.append(attention.register_forward_pre_hook(self._pre_hook(i), with_kwargs=True))
            self._handles.append(attention.dense.register_forward_pre_hook(self._dense_hook(i)))
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        return exc[0] is _StopForward  # swallow only our own early stop


@torch.no_grad()
def capture_layers(teacher, input_ids: torch.Tensor, layers=None, positions: torch.Tensor | None = None,
                   qkv: bool = True) -> dict[int, LayerCapture]:
    """Run the teacher on input_ids (b, l) and return {layer: LayerCapture} for the chosen layers (all by default).

    The forward stops after the last chosen layer (no wasted compute on later layers or the LM head).
    qkv=False skips recomputing q, k, v (the cache stores only attn_input and attn_output). Without `positions`
    the forward runs under `whole_sequences` (no host synchronisation in transformers' mask builder).
    """
    with capture_hooks(teacher, layers, positions=positions, stop_after_last=True, qkv=qkv) as cap:
        base = getattr(teacher, "gpt_neox", teacher)
        if positions is not None:  # (packed documents: transformers' own mask builder applies them)
            base(input_ids=input_ids, use_cache=False, position_ids=positions)
        else:
            with whole_sequences(teacher):
                base(input_ids=input_ids, use_cache=False)
    return cap.results
