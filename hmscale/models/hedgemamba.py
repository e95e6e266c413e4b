"""Stage-2 model: HedgeMamba, a pure SSD (Mamba-2 style) language model initialised from a Hedgehog student.

Block (GPT-NeoX layout, parallel residual or not, as the teacher): ``LN1 -> mixer``, ``LN2 -> MLP``.

Mixer, per head (h heads of size P, feature size F, d_state N = 2F, one B/C group per head):

- ``in_proj``: the teacher's fused ``query_key_value`` (interleaved ``[q_i|k_i|v_i]`` per head), unchanged;
- ``conv``: causal depthwise conv (width ``conv_width``) on the q, k, v channels; identity at init
  (weight 1 on the current-token tap, 0 elsewhere, bias 0);
- rotary on q, k (NeoX partial rotary), then the Hedgehog feature map: ``C = phi(q)``, ``B = phi(k)``, ``x = v``;
- SSD (``kernels.ssd`` / ``kernels.ssd_step``), ``normalize=True`` (the attention normaliser) by default:

  * ``dt = exp(clip(dt_proj(h)))`` with ``dt_proj`` (weight and bias) zero at init, so ``dt == 1`` exactly;
    the clip keeps ``dt`` in ``[dt_min, dt_max]``;
  * ``A = -exp(A_log) * relu(A_scale)`` with ``A_scale`` zero at init, so ``A == 0`` and the decay
    ``exp(dt A) == 1`` exactly. ``relu`` passes its gradient straight through (so ``A_scale`` can always
    recover) and keeps ``A <= 0`` (no growth);
  * ``D`` (skip) zero at init;

- gate: ``y * 2 sigmoid(z_proj(h))``, ``z_proj`` zero at init, so the gate is exactly 1;
- ``out_proj``: the teacher's ``dense``.

With every component on, the model at init computes exactly the Hedgehog student (tested).
Ablations (``gate``, ``conv``, ``ssm``, ``normalize``, ``feature_dim``) remove the component and its
parameters (``ssm=False``: ``dt = 1``, ``A = 0``, no ``D``).

``generate()`` keeps a :class:`HedgeMambaCache` per call: for each layer the conv state (last
``conv_width - 1`` inputs) and the SSD state ``(b, h, P[+1], N)``: O(1) memory per token. The prompt
goes through the chunked kernel (``return_final_state=True``), each new token through ``ssd_step``.
Left padding (``attention_mask`` zeros) is supported: padded tokens get ``dt = 0`` and zero inputs,
so they are invisible to the state; with the normaliser, the scan sees each row's leading padding moved to its end
(a position before any real token would divide 0 by 0, and the backward's NaN would reach every gradient).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.utils import ModelOutput

import kernels

from .feature_map import HedgehogFeatureMap, feature_map_init
from .hedgehog import causal_lm_loss
from .fused_ops import causal_depthwise_conv, sigmoid_gate, split_qkv_rotary
from .neox_attention import rotary_cos_sin

__all__ = [
    "ADDED_PARAM_NAMES",
    "FEATURE_MAP_PARAM_NAMES",
    "param_kind",
    "HedgeMambaConfig",
    "HedgeMambaForCausalLM",
    "HedgeMambaModel",
    "HedgeMambaCache",
    "HedgeMambaMixer",
    "HedgeMambaBlock",
    "CausalDepthwiseConv",
    "HedgeMambaCausalLMOutput",
]


def _validate(*, vocab_size, hidden_size, num_attention_heads, intermediate_size, hidden_act, rotary_pct, feature_dim,
              conv_width, chunk_size, dt_min, dt_max) -> None:
    """One-line ValueError naming the field for a HedgeMambaConfig that cannot be built or run."""
    def positive(name, value):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"HedgeMambaConfig: {name} must be a positive int, got {value!r}")

    for name, value in (("vocab_size", vocab_size), ("hidden_size", hidden_size),
                        ("num_attention_heads", num_attention_heads), ("conv_width", conv_width),
                        ("chunk_size", chunk_size)):
        positive(name, value)
    for name, value in (("intermediate_size", intermediate_size), ("feature_dim", feature_dim)):
        if value is not None:  # None: the default (4 * hidden_size, head_dim)
            positive(name, value)
    if hidden_size % num_attention_heads:
        raise ValueError(f"HedgeMambaConfig: hidden_size {hidden_size} is not a multiple of num_attention_heads "
                         f"{num_attention_heads}")
    if hidden_act not in ACT2FN:
        raise ValueError(f"HedgeMambaConfig: hidden_act {hidden_act!r} is not an activation transformers knows "
                         "(e.g. gelu, gelu_new, relu, silu)")
    if not 0.0 <= rotary_pct <= 1.0:
        raise ValueError(f"HedgeMambaConfig: rotary_pct must be in [0, 1] (the fraction of each head's dims rotary "
                         f"turns), got {rotary_pct}")
    if not 0.0 < dt_min <= dt_max:
        raise ValueError(f"HedgeMambaConfig: dt_min and dt_max must satisfy 0 < dt_min <= dt_max (dt's clip range), "
                         f"got dt_min={dt_min}, dt_max={dt_max}")


class HedgeMambaConfig(PretrainedConfig):
    model_type = "hedgemamba"

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoConfig"):
        """A no-op, as the model's (``HedgeMambaPreTrainedModel.register_for_auto_class``)."""

    def save_pretrained(self, save_directory, push_to_hub: bool = False, **kwargs):
        """transformers' save, plus what loads the directory with ``trust_remote_code=True``
        (``hmscale.models.remote_code``), written with config.json: the model's ``save_pretrained`` saves its config
        before it uploads (``push_to_hub=True``), so the upload carries them."""
        super().save_pretrained(save_directory, push_to_hub=push_to_hub, **kwargs)
        from .remote_code import write_remote_code

        write_remote_code(save_directory)

    def __init__(
        self,
        vocab_size: int = 50304,
        hidden_size: int = 512,
        num_hidden_layers: int = 6,
        num_attention_heads: int = 8,
        intermediate_size: int | None = None,
        hidden_act: str = "gelu",
        layer_norm_eps: float = 1e-5,
        rotary_pct: float = 0.25,
        rotary_emb_base: float = 10000.0,
        use_parallel_residual: bool = True,
        attention_bias: bool = True,
        feature_dim: int | None = None,
        gate: bool = True,
        conv: bool = True,
        ssm: bool = True,
        normalize: bool = True,
        conv_width: int = 4,
        chunk_size: int = 64,
        dt_min: float = 1e-4,
        dt_max: float = 100.0,
        max_position_embeddings: int = 2048,
        initializer_range: float = 0.02,
        use_cache: bool = True,
        bos_token_id: int | None = 0,
        eos_token_id: int | None = 0,
        pad_token_id: int | None = None,
        tie_word_embeddings: bool = False,
        **kwargs,
    ):
        _validate(vocab_size=vocab_size, hidden_size=hidden_size, num_attention_heads=num_attention_heads,
                  intermediate_size=intermediate_size, hidden_act=hidden_act, rotary_pct=rotary_pct,
                  feature_dim=feature_dim, conv_width=conv_width, chunk_size=chunk_size, dt_min=dt_min, dt_max=dt_max)
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size or 4 * hidden_size
        self.hidden_act = hidden_act
        self.layer_norm_eps = layer_norm_eps
        self.rotary_pct = rotary_pct
        self.rotary_emb_base = rotary_emb_base
        self.use_parallel_residual = use_parallel_residual
        self.attention_bias = attention_bias
        self.feature_dim = feature_dim or hidden_size // num_attention_heads
        self.gate = gate
        self.conv = conv
        self.ssm = ssm
        self.normalize = normalize
        self.conv_width = conv_width
        self.chunk_size = chunk_size
        self.dt_min = dt_min
        self.dt_max = dt_max
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.use_cache = use_cache
        # pad_token_id always set (None by default): transformers 5 raises AttributeError reading an unset one
        super().__init__(bos_token_id=bos_token_id, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                         tie_word_embeddings=tie_word_embeddings, **kwargs)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def rotary_ndims(self) -> int:
        return int(self.head_dim * self.rotary_pct)

    @property
    def d_state(self) -> int:
        return 2 * self.feature_dim


# --------------------------------------------------------------------------- cache


class HedgeMambaCache:
    """Recurrent generation state: per layer a conv state (b, C, W-1) and an SSD state (b, h, P[+1], N).

    Its size does not grow with the number of tokens. ``seqlen`` counts the tokens consumed.
    """

    is_compileable = False
    is_croppable = False

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.conv_states: list[torch.Tensor | None] = [None] * num_layers
        self.ssm_states: list[torch.Tensor | None] = [None] * num_layers
        self.seqlen = 0

    @property
    def is_linear(self):
        return [True] * self.num_layers

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seqlen

    def __len__(self):
        return self.num_layers

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        for i in range(self.num_layers):
            for states in (self.conv_states, self.ssm_states):
                if states[i] is not None:
                    states[i] = states[i].index_select(0, beam_idx.to(states[i].device))

    def batch_repeat_interleave(self, repeats: int) -> None:
        for states in (self.conv_states, self.ssm_states):
            for i, s in enumerate(states):
                if s is not None:
                    states[i] = s.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.reorder_cache(indices)

    def crop(self, max_length: int):
        raise NotImplementedError("HedgeMambaCache is recurrent and cannot be cropped")

    def nbytes(self) -> int:
        return sum(s.numel() * s.element_size() for st in (self.conv_states, self.ssm_states) for s in st if s is not None)

    @property
    def batch_size(self) -> int | None:
        """The rows the states hold (None before the first forward)."""
        return next((s.shape[0] for st in (self.ssm_states, self.conv_states) for s in st if s is not None), None)

    def check_batch(self, rows: int) -> None:
        """One-line ValueError when an input of ``rows`` rows would continue states of another batch (the conv's
        concatenation failed deep inside the first layer)."""
        held = self.batch_size
        if held is None or held == rows:
            return
        how = (f"cache.batch_repeat_interleave({rows // held}) repeats each of its rows {rows // held} times"
               if rows % held == 0 else "cache.batch_select_indices(rows) keeps some of its rows")
        raise ValueError(f"HedgeMamba: the cache holds the state of {held} row(s), the input has {rows}; continue it "
                         f"with an input of {held} row(s) ({how})")


# --------------------------------------------------------------------------- mixer pieces


class CausalDepthwiseConv(nn.Module):
    """Causal depthwise conv over channels: ``y_t = b + sum_j w[:, j] x_{t - (W-1) + j}`` (tap W-1 = current token).

    Identity at init. Runs from a carried state (the previous W-1 inputs) and respects document boundaries.
    """

    def __init__(self, channels: int, width: int):
        super().__init__()
        self.channels = channels
        self.width = width
        self.weight = nn.Parameter(self.identity_weight(channels, width))
        self.bias = nn.Parameter(torch.zeros(channels))

    @staticmethod
    def identity_weight(channels: int, width: int) -> torch.Tensor:
        w = torch.zeros(channels, width)
        w[:, -1] = 1.0
        return w

    def forward(self, x: torch.Tensor, state: torch.Tensor | None = None, seq_idx: torch.Tensor | None = None):
        """x (b, l, C); state (b, C, W-1) or None. Returns (y (b, l, C), new state (b, C, W-1))."""
        b, l, c = x.shape
        W = self.width
        if state is None:
            prev = x.new_zeros(b, W - 1, c)
        else:
            prev = state.transpose(1, 2).to(x.dtype)
        if seq_idx is None and W > 1:  # no document boundaries: the Triton kernel on CUDA (fused_ops)
            y, new_state = causal_depthwise_conv(x, prev, self.weight, self.bias)
            return y, new_state.transpose(1, 2).contiguous()
        xp = torch.cat([prev, x], dim=1)  # (b, W-1+l, C)
        w = self.weight.to(x.dtype)
        doc = docp = None
        if seq_idx is not None:
            doc = kernels.reference.doc_ids_from_seq_idx(seq_idx, b, l, x.device)  # (the scan's own document ids)
            docp = torch.cat([doc.new_zeros(b, W - 1), doc], dim=1)  # carried inputs belong to document 0
        y = xp[:, W - 1:] * w[:, W - 1]
        for j in range(W - 1):
            term = xp[:, j:j + l] * w[:, j]
            if doc is not None:
                term = term * (docp[:, j:j + l] == doc).unsqueeze(-1).to(x.dtype)
            y = y + term
        y = y + self.bias.to(x.dtype)
        new_state = xp[:, xp.shape[1] - (W - 1):]
        if doc is not None and W > 1:
            keep = (docp[:, docp.shape[1] - (W - 1):] == doc[:, -1:]).unsqueeze(-1).to(x.dtype)
            new_state = new_state * keep
        return y, new_state.transpose(1, 2).contiguous()


def _ssd_scan(x, *args, **kwargs):
    """``kernels.ssd``. In a ``torch.compile`` graph the Triton scan is one opaque custom op inside the graph
    (``kernels.ssd_autograd.core_fwd_op``: no graph break); the plain-PyTorch backends run outside the graph
    (their chunked math would compile into a large graph for nothing)."""
    if torch.compiler.is_compiling() and kernels.resolve_backend(x) != "triton":
        return _ssd_scan_outside_graph(x, *args, **kwargs)
    return kernels.ssd(x, *args, **kwargs)


@torch.compiler.disable
def _ssd_scan_outside_graph(*args, **kwargs):
    return kernels.ssd(*args, **kwargs)


def _rotate_rows(t: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """t (b, l, ...) with row i rotated left by shift[i] along dim 1 (position j takes position j + shift[i])."""
    b, l = t.shape[:2]
    idx = (torch.arange(l, device=t.device)[None, :] + shift[:, None]) % l
    return t.gather(1, idx.view(b, l, *([1] * (t.dim() - 2))).expand_as(t))


class _ReluStraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a):
        return a.clamp(min=0)

    @staticmethod
    def backward(ctx, g):
        return g


class HedgeMambaMLP(nn.Module):
    def __init__(self, config: HedgeMambaConfig):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(config.hidden_size, config.intermediate_size)
        self.dense_4h_to_h = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = ACT2FN[config.hidden_act]

    def forward(self, x):
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(x)))


# parameter names (last two components) of the parts HedgeMamba adds to the teacher's weights, and of its feature
# maps: together the mixer's recurrent parts (what stage 1's mixer transfer trains; stage 2's lr groups)
ADDED_PARAM_NAMES = ("conv.weight", "conv.bias", "dt_proj.weight", "dt_proj.bias", "mixer.A_log", "mixer.A_scale",
                     "mixer.D", "z_proj.weight", "z_proj.bias")
FEATURE_MAP_PARAM_NAMES = ("feature_map.weight", "feature_map.bias")


def param_kind(name: str) -> str:
    """'added', 'feature_map' or 'teacher' (weights copied from the teacher) for a HedgeMamba parameter name."""
    tail = ".".join(name.split(".")[-2:])
    return "added" if tail in ADDED_PARAM_NAMES else "feature_map" if tail in FEATURE_MAP_PARAM_NAMES else "teacher"


class HedgeMambaMixer(nn.Module):
    """The SSD mixer replacing one attention layer (see the module docstring)."""

    def __init__(self, config: HedgeMambaConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        d = config.hidden_size
        self.n_heads = config.num_attention_heads  # local heads (tensor parallelism shards them)
        self.head_dim = config.head_dim
        self.in_proj = nn.Linear(d, 3 * d, bias=config.attention_bias)
        self.conv = CausalDepthwiseConv(3 * d, config.conv_width) if config.conv else None
        self.feature_map = HedgehogFeatureMap(self.n_heads, self.head_dim, config.feature_dim)
        if config.ssm:
            self.dt_proj = nn.Linear(d, self.n_heads, bias=True)
            self.A_log = nn.Parameter(torch.zeros(self.n_heads))
            self.A_scale = nn.Parameter(torch.zeros(self.n_heads))
            self.D = nn.Parameter(torch.zeros(self.n_heads))
        self.z_proj = nn.Linear(d, d, bias=True) if config.gate else None
        self.out_proj = nn.Linear(d, d, bias=config.attention_bias)
        self.reset_exact_init()

    @torch.no_grad()
    def reset_exact_init(self) -> None:
        """The identity-at-init values of the recurrent parts (conv, feature map, dt, A, D, gate)."""
        if self.conv is not None:
            init.copy_(self.conv.weight, CausalDepthwiseConv.identity_weight(*self.conv.weight.shape))
            init.zeros_(self.conv.bias)
        fm = self.feature_map
        init.copy_(fm.weight, feature_map_init(fm.n_heads, fm.head_dim, fm.feature_dim))
        init.zeros_(fm.bias)
        if self.config.ssm:
            init.zeros_(self.dt_proj.weight)
            init.zeros_(self.dt_proj.bias)
            init.zeros_(self.A_log)
            init.zeros_(self.A_scale)
            init.zeros_(self.D)
        if self.z_proj is not None:
            init.zeros_(self.z_proj.weight)
            init.zeros_(self.z_proj.bias)

    def ssm_parameters(self, h: torch.Tensor):
        """dt (b, l, h) fp32, A (h,) fp32, D (h,) or None for the LayerNorm-ed input h (b, l, d)."""
        b, l, _ = h.shape
        if not self.config.ssm:
            return (torch.ones(b, l, self.n_heads, dtype=torch.float32, device=h.device),
                    torch.zeros(self.n_heads, dtype=torch.float32, device=h.device), None)
        z = self.dt_proj(h).float().clamp(math.log(self.config.dt_min), math.log(self.config.dt_max))
        dt = torch.exp(z)
        A = -torch.exp(self.A_log.float()) * _ReluStraightThrough.apply(self.A_scale.float())
        return dt, A, self.D

    def forward(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: HedgeMambaCache | None = None,
                seq_idx: torch.Tensor | None = None, token_mask: torch.Tensor | None = None) -> torch.Tensor:
        """h (b, l, d) the LayerNorm-ed input; rope the rotary (cos, sin) tables of the positions (b or 1, l, r),
        computed once per model forward (``rotary_cos_sin``)."""
        b, l, _ = h.shape
        y = self.head_outputs(h, rope, cache, seq_idx, token_mask)
        return self.out_proj(y.reshape(b, l, self.n_heads * self.head_dim))

    def head_outputs(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: HedgeMambaCache | None = None,
                     seq_idx: torch.Tensor | None = None, token_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The per-head outputs (b, l, h, P), gated, before ``out_proj``: the counterpart of the teacher's per-head
        attention output (what stage 1's mixer transfer aligns with it). Arguments as in ``forward``."""
        b, l, _ = h.shape
        H = self.n_heads
        # layer_idx is read only with a cache: torch.compile guards on every int attribute it reads, and one
        # guard per layer would recompile each block (and fall back to eager past the recompile limit)
        i = self.layer_idx if cache is not None else None
        conv_state = cache.conv_states[i] if cache is not None else None
        ssm_state = cache.ssm_states[i] if cache is not None else None
        qkv = self.in_proj(h)
        if token_mask is not None:
            qkv = qkv * token_mask.unsqueeze(-1).to(qkv.dtype)
        if self.conv is not None:
            qkv, new_conv = self.conv(qkv, conv_state, seq_idx)
            if cache is not None:
                cache.conv_states[i] = new_conv
        cos, sin = rope
        q, k, v = split_qkv_rotary(qkv, H, cos, sin)
        Cf, Bf = self.feature_map(q), self.feature_map(k)
        dt, A, D = self.ssm_parameters(h)
        if token_mask is not None:
            # a row that is all padding keeps its dt: with dt = 0 its normaliser would be 0 everywhere and the
            # backward's 0 / 0 NaN (its outputs are masked below, so nothing flows from it either way); not with a
            # cache (no backward there): a segment that is all padding for a row leaves that row's state as it was
            keep = token_mask if cache is not None else token_mask | ~token_mask.any(1, keepdim=True)
            dt = dt * keep.unsqueeze(-1).to(dt.dtype)
        norm = self.config.normalize
        lead = None
        if token_mask is not None and norm and seq_idx is None and l > 1:
            # a position before its row's first real token has a normaliser of 0 (dt = 0 so far): its output is
            # masked, but the backward's 0 / 0 through the kernel's division made every gradient NaN. The scan
            # takes each row rotated so that its leading padding comes last, where dt = 0 keeps it out of the state
            # and its normaliser is the real tokens' (the state after the last token is unchanged)
            lead = (token_mask.long().cumsum(1) == 0).sum(1)
            if bool(((lead > 0) & (lead < l)).any()):
                v, dt, Bf, Cf = (_rotate_rows(t, lead) for t in (v, dt, Bf, Cf))
            else:
                lead = None
        if cache is not None and ssm_state is not None and l == 1 and seq_idx is None:
            y, ssm_state = kernels.ssd_step(ssm_state, v[:, 0], dt[:, 0], A, Bf[:, 0], Cf[:, 0], D=D, normalize=norm)
            y = y.unsqueeze(1)
        elif cache is not None:
            y, ssm_state = _ssd_scan(v, dt, A, Bf, Cf, chunk_size=self.config.chunk_size, D=D,
                                       initial_state=ssm_state, seq_idx=seq_idx, normalize=norm,
                                       return_final_state=True)
        else:
            y = _ssd_scan(v, dt, A, Bf, Cf, chunk_size=self.config.chunk_size, D=D, seq_idx=seq_idx,
                            normalize=norm)
        if cache is not None:
            cache.ssm_states[i] = ssm_state
        if lead is not None:
            y = _rotate_rows(y, -lead)
        if token_mask is not None:
            y = torch.where(token_mask[:, :, None, None], y, torch.zeros_like(y))
        if self.z_proj is not None:
            y = sigmoid_gate(y, self.z_proj(h))
        return y


class HedgeMambaBlock(nn.Module):
    def __init__(self, config: HedgeMambaConfig, layer_idx: int):
        super().__init__()
        self.use_parallel_residual = config.use_parallel_residual
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mixer = HedgeMambaMixer(config, layer_idx)
        self.mlp = HedgeMambaMLP(config)

    def forward(self, x, rope, cache=None, seq_idx=None, token_mask=None):
        a = self.mixer(self.input_layernorm(x), rope, cache, seq_idx, token_mask)
        if self.use_parallel_residual:
            return x + a + self.mlp(self.post_attention_layernorm(x))
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x))


# --------------------------------------------------------------------------- HF classes


@dataclass
class HedgeMambaOutput(ModelOutput):
    last_hidden_state: torch.FloatTensor | None = None
    cache: HedgeMambaCache | None = None
    hidden_states: tuple[torch.FloatTensor, ...] | None = None


@dataclass
class HedgeMambaCausalLMOutput(ModelOutput):
    loss: torch.FloatTensor | None = None
    logits: torch.FloatTensor | None = None
    cache: HedgeMambaCache | None = None
    hidden_states: tuple[torch.FloatTensor, ...] | None = None


TIED_HEAD_KEY, TIED_EMBEDDING_KEY = "lm_head.weight", "backbone.embed_in.weight"


def _one_tied_matrix(model, state_dict):
    """With ``tie_word_embeddings`` the checkpoint holds one matrix, the input embedding's (transformers ties the head
    to it on load). A given state dict may hold the head as a separate copy (``export_hf`` clones each entry; a
    vocabulary-parallel head is gathered from its shards): it is dropped here when it equals the embedding (the
    checkpoint kept an extra vocab x hidden copy) and refused when it does not (the load would silently replace the
    saved head by the embedding). Returns the state dict to save (None: the model's own, checked alike)."""
    if state_dict is None:
        head = getattr(getattr(model, "lm_head", None), "weight", None)
        emb = getattr(model.get_input_embeddings(), "weight", None) if hasattr(model, "get_input_embeddings") else None
        if head is None or emb is None or head is emb:
            return None
        pair = head, emb
    else:
        if TIED_HEAD_KEY not in state_dict or TIED_EMBEDDING_KEY not in state_dict:
            return state_dict
        pair = state_dict[TIED_HEAD_KEY], state_dict[TIED_EMBEDDING_KEY]
    head, emb = pair
    if head is emb or "meta" in (head.device.type, emb.device.type):
        return state_dict
    if head.shape != emb.shape or not torch.equal(head.detach(), emb.detach().to(head.device, head.dtype)):
        diff = (f"max |difference| {float((head.detach().float() - emb.detach().float().to(head.device)).abs().max()):.3g}"
                if head.shape == emb.shape else f"shapes {tuple(head.shape)} and {tuple(emb.shape)}")
        raise ValueError(f"save_pretrained: tie_word_embeddings is set but lm_head.weight is not the input embedding "
                         f"backbone.embed_in.weight ({diff}), and a tied checkpoint keeps the embedding only; tie them "
                         "(model.tie_weights()) or set config.tie_word_embeddings=False")
    if state_dict is None:
        return None
    return {k: v for k, v in state_dict.items() if k != TIED_HEAD_KEY}


class HedgeMambaPreTrainedModel(PreTrainedModel):
    config_class = HedgeMambaConfig
    config: HedgeMambaConfig
    base_model_prefix = "backbone"
    _no_split_modules = ["HedgeMambaBlock"]
    supports_gradient_checkpointing = True
    _is_stateful = True

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoModel"):
        """A no-op: transformers calls it on a remote-code load, and ``save_pretrained`` would then copy hmscale's
        model sources into every later save; the one-line module of ``remote_code`` serves instead."""

    def save_pretrained(self, save_directory, is_main_process: bool = True, state_dict=None, **kwargs):
        """transformers' save; the config's save adds what loads it with ``trust_remote_code=True``
        (``HedgeMambaConfig.save_pretrained``). LoRA adapters (``hmscale.models.lora``) are folded into their layers'
        weights in the saved copy (the model keeps them): the saved model is a plain HedgeMamba computing what this
        one computes."""
        from .lora import LoRALinear, is_lora_param, merged_state_dict

        if any(isinstance(m, LoRALinear) for m in self.modules()):
            if isinstance(getattr(self, "lm_head", None), LoRALinear) and self.config.tie_word_embeddings:
                raise ValueError("save_pretrained: lm_head has a LoRA adapter but is tied to the input embeddings "
                                 "(tie_word_embeddings), so the folded adapter would be dropped; untie them or "
                                 "leave lm_head out of the LoRA targets")
            if state_dict is None:
                state_dict = self.state_dict()
            if any(is_lora_param(k) for k in state_dict):
                state_dict = merged_state_dict(self, state_dict)
        if getattr(self.config, "tie_word_embeddings", False):
            state_dict = _one_tied_matrix(self, state_dict)
        super().save_pretrained(save_directory, is_main_process=is_main_process, state_dict=state_dict, **kwargs)

    def _initialize_weights(self, module, *args, **kwargs):
        """transformers' dispatch, except that a mixer always gets its exact init: for custom code transformers skips
        a module whose own (non-recursive) parameters are all initialised, which a mixer with none of its own
        (``ssm=False``: no ``A_log``/``A_scale``/``D``) vacuously is, and its ``z_proj`` kept ``nn.Linear``'s random
        init (the gate was no longer 1 at init). ``reset_exact_init`` writes through ``transformers.initialization``,
        which leaves loaded (flagged) tensors alone, so this is safe under ``from_pretrained``."""
        if isinstance(module, HedgeMambaMixer) and not getattr(module, "_is_hf_initialized", False):
            self._init_weights(module)
            module._is_hf_initialized = True
            return
        super()._initialize_weights(module, *args, **kwargs)  # (its signature moved across transformers versions)

    @torch.no_grad()
    def _init_weights(self, module):
        if isinstance(module, HedgeMambaMixer):
            module.reset_exact_init()  # runs after its children (post-order), so it wins
        elif isinstance(module, (CausalDepthwiseConv, HedgehogFeatureMap)):
            pass  # set by the parent mixer
        else:
            super()._init_weights(module)


class HedgeMambaModel(HedgeMambaPreTrainedModel):
    def __init__(self, config: HedgeMambaConfig):
        super().__init__(config)
        self.embed_in = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([HedgeMambaBlock(config, i) for i in range(config.num_hidden_layers)])
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_in

    def set_input_embeddings(self, value):
        self.embed_in = value

    def forward(self, input_ids=None, inputs_embeds=None, position_ids=None, cache=None, use_cache=False,
                seq_idx=None, attention_mask=None, output_hidden_states=None, return_dict=None,
                **kwargs) -> HedgeMambaOutput:
        # (None: the config's, as transformers' models read them: AutoModel users set them there)
        if output_hidden_states is None:
            output_hidden_states = self.config.output_hidden_states
        if return_dict is None:
            return_dict = self.config.return_dict
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("HedgeMamba: pass exactly one of input_ids or inputs_embeds")
        x = self.embed_in(input_ids) if inputs_embeds is None else inputs_embeds
        b, l = x.shape[:2]
        if use_cache and cache is None:
            cache = HedgeMambaCache(self.config.num_hidden_layers)
        if not use_cache:
            cache = None
        offset = cache.seqlen if cache is not None else 0
        if cache is not None:
            cache.check_batch(b)
        token_mask = None
        if attention_mask is not None:
            if attention_mask.dim() != 2:
                raise ValueError("HedgeMamba: attention_mask must be 2-D (batch, length) of 0/1")
            n = attention_mask.shape[1]
            if n < l or (offset and n != offset + l):  # (the positions below count the whole mask's real tokens)
                raise ValueError(f"HedgeMamba: attention_mask has {n} positions for {offset} cached and {l} new "
                                 f"tokens; pass the mask of all {offset + l} (transformers' convention)")
            if not bool(attention_mask.bool().all()):  # (one host read per call where nothing is padded)
                am = attention_mask[:, -l:].bool()
                if not bool(am.all()):
                    token_mask = am
                # positions count each row's real tokens: also for new tokens after a left-padded prompt in the cache
                if position_ids is None:
                    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -l:]
        if position_ids is None:
            position_ids = (torch.arange(l, device=x.device) + offset)[None, :]
        if seq_idx is not None and l == 1 and seq_idx.shape[-1] == 1:
            # one token is one document, and a carried state belongs to the input's first document: the same as no
            # seq_idx (and a decode step then takes ssd_step)
            seq_idx = None
        if seq_idx is not None:
            seq_idx = seq_idx.to(torch.int32)
        # the rotary tables once for all layers (they depend on the positions only)
        rope = rotary_cos_sin(position_ids, self.config.rotary_ndims, self.config.rotary_emb_base, dtype=x.dtype)
        hidden = [x] if output_hidden_states else None
        ckpt = self.gradient_checkpointing and self.training and cache is None and torch.is_grad_enabled()
        for layer in self.layers:
            if ckpt:  # always non-reentrant: correct with frozen embeddings, whatever the transformers version
                x = checkpoint(layer.__call__, x, rope, None, seq_idx, token_mask, use_reentrant=False)
            else:
                x = layer(x, rope, cache, seq_idx, token_mask)
            if hidden is not None:
                hidden.append(x)
        x = self.final_layer_norm(x)
        if hidden is not None:  # as GPT-NeoX (and transformers' convention): the last one after the final LayerNorm
            hidden[-1] = x
        if cache is not None:
            cache.seqlen += l
        out = HedgeMambaOutput(last_hidden_state=x, cache=cache, hidden_states=tuple(hidden) if hidden else None)
        return out if return_dict else out.to_tuple()


def _generate_cache_key() -> str:
    """The ``model_kwargs`` name by which transformers' generate() carries a cache between steps and beam search reorders
    it: the first of its ``ALL_CACHE_NAMES`` ("cache" in 5.24, "past_key_values" in 5.17; read at call time)."""
    from transformers.generation import utils

    names = getattr(utils, "ALL_CACHE_NAMES", None)
    return names[0] if names else "past_key_values"


def _expand_like_the_input(cache: HedgeMambaCache, rows: int) -> None:
    """generate() repeats each input row ``k`` times (``num_return_sequences``, ``num_beams``) but not a cache passed in
    (``generate(ids, cache=prefilled, ...)``): repeat each of its rows ``k`` times alike, so that row ``i * k + j`` of
    the input continues the state of row ``i``. A cache of one row thus serves a batch that shares its prefix."""
    held = cache.batch_size
    if held is not None and held != rows and rows % held == 0:
        cache.batch_repeat_interleave(rows // held)


def _labels_for_kept_logits(labels: torch.Tensor, logits_to_keep, kept: int) -> torch.Tensor:
    """The labels lined up with logits kept by ``logits_to_keep``: with an int k > 0, the last k positions' labels (the
    loss is then the next-token loss over the k - 1 predictions inside them). A tensor of positions is refused (the
    next-token shift needs consecutive positions)."""
    if isinstance(logits_to_keep, torch.Tensor):
        raise ValueError("labels=: not with logits_to_keep given as a tensor of positions (the next-token loss needs "
                         "consecutive positions); pass an int logits_to_keep or compute the loss from the logits")
    if isinstance(logits_to_keep, int) and logits_to_keep > 0:
        labels = labels[:, -logits_to_keep:]
    if labels.shape[1] != kept:
        raise ValueError(f"labels=: {labels.shape[1]} positions for {kept} positions of logits; pass labels of the "
                         "input's shape")
    return labels


class HedgeMambaForCausalLM(HedgeMambaPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "backbone.embed_in.weight"}  # tied only with config.tie_word_embeddings

    def __init__(self, config: HedgeMambaConfig):
        super().__init__(config)
        self.backbone = HedgeMambaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # we bring our own recurrent cache (created in forward when use_cache)

    def _update_model_kwargs_for_generation(self, outputs, model_kwargs, *args, **kwargs):
        """transformers' update, carrying the recurrent cache to the next step under the name this transformers'
        generate() keeps (and beam search reorders) a cache by: an older one (5.17, the GPU image's) reads no output
        named ``cache``, so every step recomputed the whole sequence and beams never reordered a cache passed in."""
        model_kwargs = super()._update_model_kwargs_for_generation(outputs, model_kwargs, *args, **kwargs)
        if getattr(outputs, "cache", None) is not None:
            model_kwargs[_generate_cache_key()] = outputs.cache
        return model_kwargs

    def get_input_embeddings(self):
        return self.backbone.embed_in

    def set_input_embeddings(self, value):
        self.backbone.embed_in = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new):
        self.lm_head = new

    def prepare_inputs_for_generation(self, input_ids, cache=None, attention_mask=None, inputs_embeds=None,
                                      use_cache=None, position_ids=None, next_sequence_length=None,
                                      is_first_iteration=False, **kwargs):
        if cache is None:  # (an older transformers carries it as past_key_values: _update_model_kwargs_for_generation)
            cache = kwargs.pop(_generate_cache_key(), None)
        past = cache.seqlen if cache is not None else 0
        if cache is not None:
            _expand_like_the_input(cache, (input_ids if input_ids is not None else inputs_embeds).shape[0])
        inputs = {}
        # the positions so far: after a prompt given as embeddings, input_ids holds only the generated tokens while the
        # cache counts the prompt's positions too
        total = (input_ids.shape[1] if input_ids is not None else 0) + (
            inputs_embeds.shape[1] if inputs_embeds is not None else 0)
        if inputs_embeds is not None and past == 0:
            inputs["inputs_embeds"] = inputs_embeds
            length = inputs_embeds.shape[1]
        else:
            # the tokens the cache has not consumed yet
            if total <= past:
                raise ValueError(f"generate: the cache has consumed {past} tokens, the input has {total}; pass the cache "
                                 "of all but the input's last token (model(ids[:, :-1], use_cache=True).cache)")
            ids = input_ids[:, input_ids.shape[1] - (total - past):]
            inputs["input_ids"] = ids.contiguous()
            length = ids.shape[1]
        if attention_mask is not None and not bool(attention_mask.all()):
            if position_ids is None:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
            inputs["attention_mask"] = attention_mask
        if position_ids is not None:
            position_ids = position_ids[..., -length:]
        inputs.update(cache=cache, use_cache=True if use_cache is None else use_cache, position_ids=position_ids)
        # logits_to_keep: generate() sets it to 1, so the prompt's prefill makes the last position's logits alone,
        # not (b, prompt length, vocab) of them
        for key in ("output_hidden_states", "logits_to_keep"):
            if key in kwargs:
                inputs[key] = kwargs[key]
        # seq_idx covers the prompt (generate does not extend it): the new tokens continue the prompt's last document,
        # the only one the cache holds
        seq_idx = kwargs.get("seq_idx")
        if seq_idx is not None and seq_idx.shape[-1] == total:
            inputs["seq_idx"] = seq_idx[..., seq_idx.shape[-1] - length:]
        return inputs

    def forward(self, input_ids=None, inputs_embeds=None, labels=None, cache=None, use_cache=None,
                position_ids=None, seq_idx=None, attention_mask=None, logits_to_keep=0,
                output_hidden_states=None, return_dict=None, **kwargs) -> HedgeMambaCausalLMOutput:
        if cache is None:
            cache = kwargs.pop("past_key_values", None)
        if output_hidden_states is None:
            output_hidden_states = self.config.output_hidden_states
        if return_dict is None:
            return_dict = self.config.return_dict
        out = self.backbone(input_ids=input_ids, inputs_embeds=inputs_embeds, position_ids=position_ids,
                            cache=cache, use_cache=bool(use_cache) or cache is not None, seq_idx=seq_idx,
                            attention_mask=attention_mask, output_hidden_states=bool(output_hidden_states),
                            return_dict=True)
        x = out.last_hidden_state
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            x = x[:, -logits_to_keep:]
        elif isinstance(logits_to_keep, torch.Tensor):
            x = x[:, logits_to_keep]
        logits = self.lm_head(x)
        if labels is not None and getattr(self, "vocab_shard", None) is not None:
            raise ValueError("labels=: the LM head is sharded by vocabulary (tensor parallelism), the logits are this "
                             "rank's slice; use hmscale.train.stage2.causal_lm_losses(..., vocab_shard=model.vocab_shard)")
        loss = None
        if labels is not None:
            loss = causal_lm_loss(logits, _labels_for_kept_logits(labels, logits_to_keep, x.shape[1]),
                                  kwargs.get("num_items_in_batch"))
        result = HedgeMambaCausalLMOutput(loss=loss, logits=logits, cache=out.cache, hidden_states=out.hidden_states)
        if not return_dict:
            return result.to_tuple()
        return result
