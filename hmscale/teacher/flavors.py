"""Model flavours: the published Pythia sizes and Pythia-shaped miniatures.

One registry for every layer of the project (the teacher loader, the tests, the demo and
`scaling/`). A flavour is pure data; `neox_config` turns one into a `GPTNeoXConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Flavor:
    name: str
    n_layers: int
    d_model: int
    n_heads: int
    rotary_pct: float = 0.25
    vocab_size: int = 50304
    max_positions: int = 2048
    hub_id: str | None = None
    published_params: int | None = None  # as listed by the Pythia paper / model cards
    pretrain_tokens: int | None = None  # tokens the published teacher saw
    parallel_residual: bool = True

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def d_ff(self) -> int:
        return 4 * self.d_model

    @property
    def miniature(self) -> bool:
        return self.hub_id is None


PYTHIA_TOKENS = 299_892_736_000  # 143k steps x 2M tokens

PYTHIA: dict[str, Flavor] = {
    f.name: f
    for f in [
        Flavor("pythia-70m", 6, 512, 8, hub_id="EleutherAI/pythia-70m", published_params=70_426_624, pretrain_tokens=PYTHIA_TOKENS),
        Flavor("pythia-160m", 12, 768, 12, hub_id="EleutherAI/pythia-160m", published_params=162_322_944, pretrain_tokens=PYTHIA_TOKENS),
        Flavor("pythia-410m", 24, 1024, 16, hub_id="EleutherAI/pythia-410m", published_params=405_334_016, pretrain_tokens=PYTHIA_TOKENS),
        Flavor("pythia-1b", 16, 2048, 8, hub_id="EleutherAI/pythia-1b", published_params=1_011_781_632, pretrain_tokens=PYTHIA_TOKENS),
        Flavor("pythia-1.4b", 24, 2048, 16, hub_id="EleutherAI/pythia-1.4b", published_params=1_414_647_808, pretrain_tokens=PYTHIA_TOKENS),
        Flavor("pythia-2.8b", 32, 2560, 32, hub_id="EleutherAI/pythia-2.8b", published_params=2_775_208_960, pretrain_tokens=PYTHIA_TOKENS),
        Flavor("pythia-6.9b", 32, 4096, 32, vocab_size=50432, hub_id="EleutherAI/pythia-6.9b", published_params=6_857_302_016, pretrain_tokens=PYTHIA_TOKENS),
        Flavor("pythia-12b", 36, 5120, 40, vocab_size=50688, hub_id="EleutherAI/pythia-12b", published_params=11_846_072_320, pretrain_tokens=PYTHIA_TOKENS),
    ]
}

# Pythia-shaped miniatures: same architecture (parallel residual, partial rotary, 4x MLP),
# small enough to pretrain on CPU in seconds. Their vocabulary follows the tokenizer in use.
MINIATURE: dict[str, Flavor] = {
    f.name: f
    for f in [
        Flavor("pythia-nano", 2, 64, 4, vocab_size=512, max_positions=512),
        Flavor("pythia-micro", 4, 128, 4, vocab_size=2048, max_positions=1024),
        Flavor("pythia-mini", 6, 256, 8, vocab_size=4096, max_positions=2048),
        # Pythia-70m's shape with a small local vocabulary: pretrained on the spot (fidelity benchmark)
        Flavor("pythia-70m-local", 6, 512, 8, vocab_size=8192, max_positions=2048),
    ]
}

FLAVORS: dict[str, Flavor] = {**MINIATURE, **PYTHIA}


def get_flavor(name: str) -> Flavor:
    try:
        return FLAVORS[name]
    except KeyError:
        raise ValueError(f"unknown flavour {name!r}; choose one of: {', '.join(FLAVORS)}") from None


def neox_config(flavor: Flavor | str, vocab_size: int | None = None, **overrides):
    """A `transformers.GPTNeoXConfig` for a flavour (vocab_size overrides the flavour's)."""
    from transformers import GPTNeoXConfig

    f = get_flavor(flavor) if isinstance(flavor, str) else flavor
    kwargs = dict(
        vocab_size=vocab_size or f.vocab_size,
        hidden_size=f.d_model,
        num_hidden_layers=f.n_layers,
        num_attention_heads=f.n_heads,
        intermediate_size=f.d_ff,
        rotary_pct=f.rotary_pct,
        max_position_embeddings=f.max_positions,
        use_parallel_residual=f.parallel_residual,
        tie_word_embeddings=False,
        hidden_act="gelu",
        attention_dropout=0.0,
        hidden_dropout=0.0,
        layer_norm_eps=1e-5,
        bos_token_id=0,
        eos_token_id=0,
    )
    kwargs.update(overrides)
    cfg = GPTNeoXConfig(**kwargs)
    # transformers 5 keeps rotary settings in rope_parameters; make sure the fraction is the one asked for, in
    # either name (an override as partial_rotary_factor or inside rope_parameters was replaced by the flavour's)
    fraction = kwargs["rotary_pct"]
    if "partial_rotary_factor" in overrides:
        fraction = overrides["partial_rotary_factor"]
    elif "rotary_pct" not in overrides and "partial_rotary_factor" in (overrides.get("rope_parameters") or {}):
        fraction = overrides["rope_parameters"]["partial_rotary_factor"]
    params = dict(getattr(cfg, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0})
    params["partial_rotary_factor"] = fraction
    cfg.rope_parameters = params
    return cfg
