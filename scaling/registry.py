"""The sizes a scaling study runs over: the eight published Pythia sizes and the miniatures.

Built on the one flavour registry (`hmscale.teacher.flavors`); this module only adds size
resolution (`"70m"`, `"pythia-1b"`, `"nano"`, groups `"pythia"`, `"miniatures"`, `"all"`) and the
published numbers next to each size.
"""

from __future__ import annotations

from dataclasses import dataclass

from hmscale.teacher.flavors import FLAVORS, MINIATURE, PYTHIA, Flavor

PYTHIA_SIZES: tuple[str, ...] = tuple(PYTHIA)  # 70m ... 12b, smallest first
MINIATURE_SIZES: tuple[str, ...] = tuple(MINIATURE)  # nano, micro, mini, 70m-local

GROUPS: dict[str, tuple[str, ...]] = {
    "pythia": PYTHIA_SIZES,
    "miniature": MINIATURE_SIZES,
    "miniatures": MINIATURE_SIZES,
    "all": MINIATURE_SIZES + PYTHIA_SIZES,
}


@dataclass(frozen=True)
class Size:
    """One size of a study: the flavour plus the published numbers (None for miniatures)."""

    flavor: Flavor

    @property
    def name(self) -> str:
        return self.flavor.name

    @property
    def hub_id(self) -> str | None:
        return self.flavor.hub_id

    @property
    def published_params(self) -> int | None:
        return self.flavor.published_params

    @property
    def pretrain_tokens(self) -> int | None:
        return self.flavor.pretrain_tokens

    @property
    def miniature(self) -> bool:
        return self.flavor.miniature

    def describe(self) -> dict:
        f = self.flavor
        return {
            "size": f.name,
            "layers": f.n_layers,
            "d_model": f.d_model,
            "heads": f.n_heads,
            "head_dim": f.head_dim,
            "rotary_pct": f.rotary_pct,
            "vocab_size": f.vocab_size,
            "hub_id": f.hub_id,
            "published_params": f.published_params,
            "pretrain_tokens": f.pretrain_tokens,
        }


def canonical_name(name: str) -> str:
    """`"70m"`, `"Pythia-70M"`, `"pythia-70m"` -> `"pythia-70m"`; `"nano"` -> `"pythia-nano"`."""
    key = name.strip().lower()
    if key in FLAVORS:
        return key
    if f"pythia-{key}" in FLAVORS:
        return f"pythia-{key}"
    raise ValueError(
        f"unknown size {name!r}; choose from {', '.join(FLAVORS)} (or short names like 70m, nano) "
        f"or a group: {', '.join(GROUPS)}"
    )


def resolve_sizes(spec: str | list[str] | tuple[str, ...] | None = None) -> list[Size]:
    """Sizes from a spec: comma-separated names and/or groups; None = the 8 Pythia sizes.

    Order follows the input, duplicates are dropped.
    """
    if spec is None:
        items: list[str] = list(PYTHIA_SIZES)
    else:
        raw = [spec] if isinstance(spec, str) else list(spec)
        items = [p for part in raw for p in str(part).split(",") if p.strip()]
        if not items:
            raise ValueError("no sizes given; pass e.g. --sizes 70m,160m or a group (pythia, miniatures, all)")
    names: list[str] = []
    for item in items:
        key = item.strip().lower()
        expanded = GROUPS[key] if key in GROUPS else (canonical_name(key),)
        for n in expanded:
            if n not in names:
                names.append(n)
    return [Size(FLAVORS[n]) for n in names]


def get_size(name: str) -> Size:
    return Size(FLAVORS[canonical_name(name)])
