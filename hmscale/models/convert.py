"""Conversions between the recipe's models, with the exact weight mapping, and the logit check.

- :func:`to_hedgehog`: teacher (``GPTNeoXForCausalLM``) -> stage-1 student sharing the teacher's weights;
- :func:`to_hedgemamba`: stage-1 student -> ``HedgeMambaForCausalLM`` (copies: embeddings, LayerNorms,
  ``query_key_value`` -> ``mixer.in_proj`` (same interleaved layout), ``dense`` -> ``mixer.out_proj``, MLP,
  final LayerNorm, output embedding (tied to the input embedding when the teacher's are: ``tie_word_embeddings``
  follows the teacher), feature maps); the recurrent parts take their exact identity init;
- :func:`compare_logits`: both models on one batch, largest absolute and relative logit difference.
"""

from __future__ import annotations

import torch

from hmscale.config import ComponentsConfig

from .hedgehog import HedgehogForCausalLM
from .hedgemamba import HedgeMambaConfig, HedgeMambaForCausalLM, param_kind
from .neox_attention import check_default_rope, rope_theta, rotary_fraction

__all__ = ["to_hedgehog", "to_hedgemamba", "to_mixer_student", "recurrent_state", "load_recurrent_state",
           "hedgemamba_config_from_teacher", "teacher_ties_embeddings", "compare_logits"]


def to_hedgehog(teacher, feature_dim: int | None = None) -> HedgehogForCausalLM:
    """The stage-1 student around ``teacher`` (frozen, shared); trainable parameters: the feature maps only."""
    return HedgehogForCausalLM(teacher, feature_dim=feature_dim)


def _components_dict(components) -> dict:
    if components is None:
        return ComponentsConfig().model_dump()
    if isinstance(components, ComponentsConfig):
        return components.model_dump()
    if isinstance(components, dict):
        return ComponentsConfig(**components).model_dump()
    raise TypeError(f"components: expected a ComponentsConfig or a dict, got {type(components).__name__}")


def hedgemamba_config_from_teacher(teacher_config, feature_dim: int | None = None, components=None,
                                   chunk_size: int = 64) -> HedgeMambaConfig:
    check_default_rope(teacher_config, "hedgemamba_config_from_teacher")  # (HedgeMamba's rotary is the default one)
    c = _components_dict(components)
    return HedgeMambaConfig(
        vocab_size=teacher_config.vocab_size,
        hidden_size=teacher_config.hidden_size,
        num_hidden_layers=teacher_config.num_hidden_layers,
        num_attention_heads=teacher_config.num_attention_heads,
        intermediate_size=teacher_config.intermediate_size,
        hidden_act=teacher_config.hidden_act,
        layer_norm_eps=teacher_config.layer_norm_eps,
        rotary_pct=rotary_fraction(teacher_config),
        rotary_emb_base=rope_theta(teacher_config),
        use_parallel_residual=teacher_config.use_parallel_residual,
        attention_bias=getattr(teacher_config, "attention_bias", True),
        feature_dim=feature_dim,
        gate=c["gate"],
        conv=c["conv"],
        ssm=c["ssm"],
        normalize=c["normalize"],
        conv_width=c["conv_width"],
        chunk_size=chunk_size,
        max_position_embeddings=teacher_config.max_position_embeddings,
        bos_token_id=teacher_config.bos_token_id,
        eos_token_id=teacher_config.eos_token_id,
        pad_token_id=getattr(teacher_config, "pad_token_id", None),
        # the teacher's tie (Pythia: untied): a tied teacher's one embedding matrix stays one matrix in HedgeMamba
        tie_word_embeddings=teacher_ties_embeddings(teacher_config),
    )


def teacher_ties_embeddings(teacher_config) -> bool:
    """Whether the teacher's output embedding (LM head) is its input embedding matrix (``tie_word_embeddings``)."""
    return bool(getattr(teacher_config, "tie_word_embeddings", False))


@torch.no_grad()
def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"to_hedgemamba: {name} has shape {tuple(src.shape)} in the student, {tuple(dst.shape)} in HedgeMamba")
    dst.copy_(src.to(dst.dtype))


def to_hedgemamba(student: HedgehogForCausalLM, components=None) -> HedgeMambaForCausalLM:
    """The stage-2 model computing, at init, exactly what ``student`` computes (when every component is on)."""
    teacher = student.teacher
    tcfg = teacher.config
    cfg = hedgemamba_config_from_teacher(tcfg, feature_dim=student.feature_dim, components=components,
                                         chunk_size=student.chunk_size)
    ref = next(teacher.parameters())
    model = HedgeMambaForCausalLM(cfg).to(device=ref.device, dtype=torch.float32)
    neox = teacher.gpt_neox
    bb = model.backbone
    _copy(bb.embed_in.weight, neox.embed_in.weight, "embed_in.weight")
    for i, (src, dst) in enumerate(zip(neox.layers, bb.layers)):
        for ln in ("input_layernorm", "post_attention_layernorm"):
            _copy(getattr(dst, ln).weight, getattr(src, ln).weight, f"layers.{i}.{ln}.weight")
            _copy(getattr(dst, ln).bias, getattr(src, ln).bias, f"layers.{i}.{ln}.bias")
        pairs = [
            (dst.mixer.in_proj, src.attention.query_key_value, "attention.query_key_value"),
            (dst.mixer.out_proj, src.attention.dense, "attention.dense"),
            (dst.mlp.dense_h_to_4h, src.mlp.dense_h_to_4h, "mlp.dense_h_to_4h"),
            (dst.mlp.dense_4h_to_h, src.mlp.dense_4h_to_h, "mlp.dense_4h_to_h"),
        ]
        for d_lin, s_lin, name in pairs:
            _copy(d_lin.weight, s_lin.weight, f"layers.{i}.{name}.weight")
            if s_lin.bias is not None:
                _copy(d_lin.bias, s_lin.bias, f"layers.{i}.{name}.bias")
        fm = student.feature_maps[i]
        _copy(dst.mixer.feature_map.weight, fm.weight, f"feature_maps.{i}.weight")
        _copy(dst.mixer.feature_map.bias, fm.bias, f"feature_maps.{i}.bias")
    _copy(bb.final_layer_norm.weight, neox.final_layer_norm.weight, "final_layer_norm.weight")
    _copy(bb.final_layer_norm.bias, neox.final_layer_norm.bias, "final_layer_norm.bias")
    if cfg.tie_word_embeddings:
        # one matrix, as in the teacher: the head is the embedding just copied. HedgeMamba ties them at build through
        # transformers' tie_weights, which another thread's from_pretrained replaces by a no-op for as long as it
        # loads (transformers' no_tie_weights patches the class): tie here by hand, whatever that build did
        model.lm_head.weight = bb.embed_in.weight
        if not torch.equal(teacher.get_output_embeddings().weight, neox.embed_in.weight):
            raise ValueError("to_hedgemamba: the teacher's config ties its word embeddings (tie_word_embeddings=True) "
                             "but its embed_out and embed_in weights differ; load the teacher so that they are tied, "
                             "or set tie_word_embeddings=False in its config")
    else:
        _copy(model.lm_head.weight, teacher.get_output_embeddings().weight, "embed_out.weight")
    return model.to(dtype=ref.dtype)


def to_mixer_student(teacher, components=None, feature_dim: int | None = None) -> HedgeMambaForCausalLM:
    """The stage-1 student of ``stage1.transfer=mixer``: HedgeMamba at its exact init from ``teacher`` (so it
    computes the Hedgehog student), with only the mixers' recurrent parts trainable (feature maps, conv,
    dt/A/D, gate); everything copied from the teacher stays frozen."""
    model = to_hedgemamba(to_hedgehog(teacher, feature_dim=feature_dim), components)
    for name, p in model.named_parameters():
        p.requires_grad_(param_kind(name) != "teacher")
    return model


def recurrent_state(model: HedgeMambaForCausalLM, layers=None) -> dict:
    """``{"<layer>.<name>": tensor}`` of the mixers' recurrent parts (fp32 CPU copies), for ``layers`` (all)."""
    out = {}
    for l, block in enumerate(model.backbone.layers):
        if layers is not None and l not in layers:
            continue
        for name, p in block.mixer.named_parameters():
            if param_kind(f"mixer.{name}") != "teacher":
                out[f"{l}.{name}"] = p.detach().float().cpu().clone()
    return out


@torch.no_grad()
def load_recurrent_state(model: HedgeMambaForCausalLM, state: dict) -> None:
    """Inverse of :func:`recurrent_state` (every recurrent parameter of every layer must be present)."""
    want = set(recurrent_state(model))
    if set(state) != want:
        missing, extra = sorted(want - set(state)), sorted(set(state) - want)
        raise ValueError(f"recurrent state: missing {missing[:4]}, unexpected {extra[:4]} (components differ?)")
    for key, t in state.items():
        l, name = key.split(".", 1)
        _copy(model.backbone.layers[int(l)].mixer.get_parameter(name), t, key)


@torch.no_grad()
def compare_logits(model_a, model_b, input_ids: torch.Tensor, **kwargs) -> dict:
    """Run both models on ``input_ids``; ``max_abs`` = max |a - b|, ``max_rel`` = max_abs / max |a| (fp32)."""
    a = model_a(input_ids=input_ids, **kwargs).logits.float()
    b = model_b(input_ids=input_ids, **kwargs).logits.float()
    diff = (a - b).abs()
    max_abs = float(diff.max())
    scale = float(a.abs().max())
    return {"max_abs": max_abs, "max_rel": max_abs / max(scale, 1e-30)}
