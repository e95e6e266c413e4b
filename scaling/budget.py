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

import math
from dataclasses import dataclass, field
from typing import Literal

from pydantic import ValidationError

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
        problem = split_problem(self.split)
        if problem:
            raise ValueError(f"budget rule: {problem}")
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


def split_problem(split) -> str | None:
    """What is wrong with a stage split by the recipe's own rule (``budget.split``, ``BudgetConfig``), else None."""
    try:
        BudgetConfig(split=tuple(split))
    except ValidationError as err:
        return err.errors()[0]["msg"].removeprefix("Value error, ")
    return None


def parse_split(text: str, option: str = "--split") -> tuple[float, float]:
    """`"10/90"` (percentages), `"0.1,0.9"` or `"0.1/0.9"` (fractions) -> (0.1, 0.9).

    Numbers summing to more than 1 are percentages; either way the result must pass ``budget.split``'s rule (two
    non-negative fractions summing to 1): nothing is renormalised, so ``50/60`` is an error, as in the config.
    Errors are one line naming ``option``.
    """
    hint = "write stage-1/stage-2 percentages summing to 100 (e.g. 10/90) or fractions summing to 1 (e.g. 0.1,0.9)"
    sep = "/" if "/" in text else ","
    try:
        parts = [float(p) for p in text.split(sep)]
    except ValueError:
        parts = []
    if len(parts) != 2 or not all(math.isfinite(p) for p in parts):
        raise ValueError(f"{option}: {text!r} is not two numbers; {hint}")
    percent = sum(parts) > 1 + 1e-6
    if percent:
        parts = [p / 100 for p in parts]
    if split_problem(parts):
        raise ValueError(f"{option}: {text!r} read as {'percentages' if percent else 'fractions'} is the split "
                         f"{[round(p, 6) for p in parts]}, not two non-negative fractions summing to 1 (budget.split's "
                         f"rule); {hint}")
    return (parts[0], parts[1])
