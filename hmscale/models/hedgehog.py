"""Stage-1 student: a live GPT-NeoX teacher whose softmax attention is replaced by Hedgehog linear attention.

Per layer, ``q, k, v`` come from the teacher's own ``query_key_value`` (rotary applied as in the teacher),
then ``o = normalised linear attention(phi(q), phi(k), v)`` computed by the SSD kernel with no decay
(``dt = 1``, ``A = 0``, ``normalize=True``, one group per head), then the teacher's ``dense``.
The teacher's modules are referenced, never copied; only the feature maps are trainable.

Stage 1 is layer-local: :func:`hedgehog_layer_output` runs one layer's attention from a cached
``attn_input`` (the LayerNorm-ed layer input) and returns both the linear and the teacher's softmax
attention outputs per head, and :func:`hedgehog_loss` is ``1 - cos`` over the head dim.
"""

from __future__ import annotations

import math
import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import CausalLMOutput

import kernels

from .feature_map import HedgehogFeatureMap
from .neox_attention import check_default_rope, positions_for, qkv_with_rotary

__all__ = [
    "HedgehogForCausalLM",
    "hedgehog_layer_output",
    "hedgehog_loss",
    "teacher_attention_output",
    "linear_attention",
    "document_softmax_attention",
    "causal_lm_loss",
]


def linear_attention(q_feat: torch.Tensor, k_feat: torch.Tensor, v: torch.Tensor, seq_idx=None,
                     chunk_size: int = 64) -> torch.Tensor:
    """Normalised causal linear attention through the SSD kernel.

    q_feat, k_feat (b, l, h, n) = phi(q), phi(k); v (b, l, h, p). Returns (b, l, h, p):
    ``o_t = sum_{s<=t} (q_t.k_s) v_s / sum_{s<=t} q_t.k_s`` (within a document when seq_idx is given).
    """
    b, l, h, _ = v.shape
    dt = torch.ones(b, l, h, dtype=torch.float32, device=v.device)
    A = torch.zeros(h, dtype=torch.float32, device=v.device)
    return kernels.ssd(v, dt, A, k_feat, q_feat, chunk_size=chunk_size, seq_idx=seq_idx, normalize=True)


def document_softmax_attention(q, k, v, seq_idx=None):
    """The teacher's causal softmax attention (b, l, h, p); with seq_idx, masked to each document."""
    if seq_idx is None:
        from .neox_attention import softmax_attention

        return softmax_attention(q, k, v)
    l = q.shape[1]
    causal = torch.ones(l, l, dtype=torch.bool, device=q.device).tril()
    change = torch.cumsum(torch.cat([torch.zeros_like(seq_idx[:, :1]), (seq_idx[:, 1:] != seq_idx[:, :-1]).to(seq_idx.dtype)], 1), 1)
    same = change[:, :, None] == change[:, None, :]
    mask = (causal & same)[:, None]  # (b, 1, l, l)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                         scale=1.0 / math.sqrt(q.shape[-1]))
    return out.transpose(1, 2)


def hedgehog_layer_output(attn_module, feature_map: HedgehogFeatureMap, attn_input: torch.Tensor, config,
                          position_ids: torch.Tensor | None = None, seq_idx: torch.Tensor | None = None,
                          with_teacher: bool = True, chunk_size: int = 64):
    """One layer's attention from its cached input, for the layer-local stage-1 loss.

    attn_input (b, l, d): the layer's LayerNorm-ed input (``input_layernorm(x)``), as cached.
    attn_module: the teacher layer's ``GPTNeoXAttention`` (its ``query_key_value`` is used; frozen).
    Returns ``(o_lin, o_teacher)``, each (b, l, h, p), the per-head outputs before the ``dense``
    projection; ``o_teacher`` is None when ``with_teacher=False`` (e.g. when the cache holds it).
    """
    q, k, v = qkv_with_rotary(attn_module, attn_input, config, position_ids)
    o_lin = linear_attention(feature_map(q), feature_map(k), v, seq_idx=seq_idx, chunk_size=chunk_size)
    o_teacher = None
    if with_teacher:
        with torch.no_grad():
            o_teacher = document_softmax_attention(q, k, v, seq_idx)
    return o_lin, o_teacher


@torch.no_grad()
def teacher_attention_output(attn_module, attn_input: torch.Tensor, config, position_ids: torch.Tensor | None = None,
                             seq_idx: torch.Tensor | None = None) -> torch.Tensor:
    """The teacher layer's per-head softmax attention output (b, l, h, p), before ``dense``, from its cached input."""
    q, k, v = qkv_with_rotary(attn_module, attn_input, config, position_ids)
    return document_softmax_attention(q, k, v, seq_idx)


def hedgehog_loss(o_lin: torch.Tensor, o_teacher: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``1 - cos(o_lin, o_teacher)`` over the head dim, averaged over tokens and heads (fp32 scalar).

    Accepts (b, l, h, p) or, when o_teacher is the flat (b, l, h*p) attention output, reshapes it.
    """
    if o_teacher.shape != o_lin.shape:
        o_teacher = o_teacher.reshape(o_lin.shape)
    cos = F.cosine_similarity(o_lin.float(), o_teacher.float(), dim=-1, eps=eps)
    return (1.0 - cos).mean()


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
    """Next-token cross-entropy (labels are the inputs; shifted here; -100 ignored), in fp32: the mean, or with
    ``num_items_in_batch`` (transformers' ``Trainer`` passes it under gradient accumulation) the sum over it."""
    shift_logits = logits[:, :-1].float()
    shift_labels = labels[:, 1:].to(logits.device)
    if num_items_in_batch is None:
        return F.cross_entropy(shift_logits.reshape(-1, shift_logits.shape[-1]), shift_labels.reshape(-1), ignore_index=-100)
    total = F.cross_entropy(shift_logits.reshape(-1, shift_logits.shape[-1]), shift_labels.reshape(-1), ignore_index=-100,
                            reduction="sum")
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


class HedgehogForCausalLM(nn.Module):
    """The stage-1 student: ``teacher`` (a ``GPTNeoXForCausalLM``, shared, frozen) + per-layer feature maps.

    ``forward(input_ids, labels=None, position_ids=None, seq_idx=None)`` -> ``CausalLMOutput(loss, logits)``.
    """

    def __init__(self, teacher, feature_dim: int | None = None, feature_maps: nn.ModuleList | None = None,
                 chunk_size: int = 64):
        super().__init__()
        if not hasattr(teacher, "gpt_neox"):  # what the student and the conversion read the teacher's weights from
            raise TypeError("HedgehogForCausalLM: the teacher must be a GPT-NeoX causal LM (GPTNeoXForCausalLM), "
                            f"got {type(teacher).__name__}")
        if feature_dim is not None and (isinstance(feature_dim, bool) or not isinstance(feature_dim, int)
                                        or feature_dim < 1):
            raise ValueError(f"HedgehogForCausalLM: feature_dim must be a positive int (or None: head_dim), "
                             f"got {feature_dim!r}")
        check_default_rope(teacher.config, "HedgehogForCausalLM")
        self.teacher = teacher
        self.config = teacher.config
        cfg = self.config
        self.n_heads = cfg.num_attention_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.feature_dim = feature_dim or self.head_dim
        self.chunk_size = chunk_size
        for p in teacher.parameters():
            p.requires_grad_(False)
        if feature_maps is None:
            ref = next(teacher.parameters())
            feature_maps = nn.ModuleList(
                HedgehogFeatureMap(self.n_heads, self.head_dim, self.feature_dim) for _ in range(cfg.num_hidden_layers)
            ).to(device=ref.device)
        if len(feature_maps) != cfg.num_hidden_layers:
            raise ValueError(f"feature_maps: {len(feature_maps)} maps for a {cfg.num_hidden_layers}-layer teacher")
        self.feature_maps = feature_maps
        self.feature_dim = feature_maps[0].feature_dim

    # ------------------------------------------------------------------ parameters
    def trainable_parameters(self):
        return [p for p in self.feature_maps.parameters()]

    def feature_map_state_dict(self) -> dict:
        return {k: v.detach().clone() for k, v in self.feature_maps.state_dict().items()}

    def load_feature_map_state_dict(self, state: dict) -> None:
        self.feature_maps.load_state_dict(state)

    @property
    def layers(self):
        return self.teacher.gpt_neox.layers

    @property
    def device(self):
        return next(self.teacher.parameters()).device

    # ------------------------------------------------------------------ forward
    def layer_attention(self, i: int, attn_input: torch.Tensor, position_ids=None, seq_idx=None) -> torch.Tensor:
        """Layer i's linear-attention output after ``dense`` (b, l, d)."""
        attn = self.layers[i].attention
        o_lin, _ = hedgehog_layer_output(attn, self.feature_maps[i], attn_input, self.config, position_ids,
                                         seq_idx, with_teacher=False, chunk_size=self.chunk_size)
        return attn.dense(o_lin.reshape(*o_lin.shape[:2], -1))

    def forward(self, input_ids=None, labels=None, position_ids=None, seq_idx=None, inputs_embeds=None,
                attention_mask=None, output_hidden_states: bool | None = None, return_dict: bool | None = None,
                use_cache: bool | None = None, **kwargs):
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("HedgehogForCausalLM: pass exactly one of input_ids or inputs_embeds")
        if use_cache:
            raise ValueError("HedgehogForCausalLM has no cache (use_cache=True): it recomputes whole rows; "
                             "HedgeMamba (convert.to_hedgemamba) decodes with a recurrent state")
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("HedgehogForCausalLM: padding in attention_mask is not supported; pack sequences and pass seq_idx")
        if output_hidden_states is None:
            output_hidden_states = self.config.output_hidden_states
        neox = self.teacher.gpt_neox
        x = neox.embed_in(input_ids) if inputs_embeds is None else inputs_embeds
        if position_ids is None:
            position_ids = positions_for(x[..., 0])
        hidden = [x] if output_hidden_states else None
        for i, layer in enumerate(neox.layers):
            a = self.layer_attention(i, layer.input_layernorm(x), position_ids, seq_idx)
            if layer.use_parallel_residual:
                x = x + a + layer.mlp(layer.post_attention_layernorm(x))
            else:
                x = x + a
                x = x + layer.mlp(layer.post_attention_layernorm(x))
            if hidden is not None:
                hidden.append(x)
        x = neox.final_layer_norm(x)
        if hidden is not None:  # as the teacher (GPT-NeoX): the last hidden state after the final LayerNorm
            hidden[-1] = x
        logits = self.teacher.get_output_embeddings()(x)
        loss = causal_lm_loss(logits, labels, kwargs.get("num_items_in_batch")) if labels is not None else None
        out = CausalLMOutput(loss=loss, logits=logits, hidden_states=tuple(hidden) if hidden else None)
        return out if (self.config.return_dict if return_dict is None else return_dict) else out.to_tuple()
