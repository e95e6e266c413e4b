"""Token budget policy: how many distillation tokens each size gets, and the stage split.

Rules (`BudgetRule.kind`):
- ``fraction`` (default): a fraction of the tokens the teacher was pretrained on. The default
  fraction 1/30 gives ~10B tokens for every Pythia size (Pythia saw 299.9B tokens), the budget of
  the HedgeMamba paper's Pythia-1B run.
- ``tokens_per_param``: ``tokens_per_param`` x the teacher's parameter count (Chinchilla-style).
- ``fixed``: ``tokens`` for every size.
Flavours without published pretraining tokens (the miniatures) use ``miniature_tokens`` under the
``fraction`` rule. ``min_tokens`` / ``max_tokens`` clamp the result. The stage split defaults to
10/90, the paper's best.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from hmscale.config import BudgetConfig
from hmscale.teacher.flavors import Flavor

DEFAULT_SPLIT = (0.1, 0.9)


@dataclass(frozen=True)
class Budget:
    total_tokens: int
    split: tuple[float, float] = DEFAULT_SPLIT

    @property
    def config(self) -> BudgetConfig:
        """The recipe's own budget section (validates the split; one place for the stage arithmetic)."""
        return BudgetConfig(total_tokens=self.total_tokens, split=tuple(self.split))

    @property
    def stage1_tokens(self) -> int:
        return self.config.stage1_tokens

    @property
    def stage2_tokens(self) -> int:
        return self.config.stage2_tokens

    def overrides(self) -> list[str]:
        """Dotted overrides that put this budget into a RunConfig."""
        return [f"budget.total_tokens={self.total_tokens}", f"budget.split=[{self.split[0]},{self.split[1]}]"]


@dataclass(frozen=True)
class BudgetRule:
    kind: Literal["fraction", "tokens_per_param", "fixed"] = "fraction"
    fraction: float = 1 / 30
    tokens_per_param: float = 20.0
    tokens: int = 10_000_000_000
    miniature_tokens: int = 400_000  # the config default: a CPU-sized budget
    min_tokens: int = 1
    max_tokens: int | None = None
    split: tuple[float, float] = field(default=DEFAULT_SPLIT)

    def __post_init__(self):
        if self.kind not in ("fraction", "tokens_per_param", "fixed"):
            raise ValueError(f"budget rule: kind {self.kind!r} must be fraction, tokens_per_param or fixed")
        if len(self.split) != 2 or any(s < 0 for s in self.split) or abs(sum(self.split) - 1) > 1e-6:
            raise ValueError(f"budget rule: split {list(self.split)} must be two non-negative fractions summing to 1")
        if self.fraction <= 0 or self.tokens_per_param <= 0 or self.tokens <= 0:
            raise ValueError("budget rule: fraction, tokens_per_param and tokens must be positive")

    def total_tokens(self, flavor: Flavor, params: int | None = None) -> int:
        if self.kind == "fixed":
            total = self.tokens
        elif self.kind == "tokens_per_param":
            if params is None:
                from scaling.planner import count_params

                params = count_params(flavor)
            total = self.tokens_per_param * params
        else:
            total = self.miniature_tokens if flavor.pretrain_tokens is None else self.fraction * flavor.pretrain_tokens
        total = max(int(round(total)), self.min_tokens)
        if self.max_tokens is not None:
            total = min(total, self.max_tokens)
        return total

    def budget(self, flavor: Flavor, params: int | None = None) -> Budget:
        return Budget(self.total_tokens(flavor, params), tuple(self.split))


def parse_split(text: str) -> tuple[float, float]:
    """`"10/90"`, `"0.1,0.9"` -> (0.1, 0.9)."""
    sep = "/" if "/" in text else ","
    parts = [float(p) for p in text.split(sep)]
    if len(parts) != 2 or sum(parts) <= 0:
        raise ValueError(f"split {text!r}: write two numbers, e.g. 10/90 or 0.1,0.9")
    s = sum(parts)
    return (parts[0] / s, parts[1] / s)
