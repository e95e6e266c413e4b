"""Scaling plots (PNG, matplotlib Agg, written atomically).

- ``ppl_vs_params.png``: perplexity against teacher parameters: teacher, Hedgehog (stage 1) and
  HedgeMamba (stage 2).
- ``gap_vs_tokens.png``: HedgeMamba minus teacher perplexity against distillation tokens, one point
  per size.
- ``projected_cost.png``: projected GPU-hours per size, stacked by stage (cache, stage 1, stage 2).
"""

from __future__ import annotations

import io
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from hmscale.atomic import atomic_write_bytes  # noqa: E402


def _f(x) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _save(fig, path: Path) -> Path:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return atomic_write_bytes(path, buf.getvalue())


def _log_axis(ax, axis: str) -> None:
    """Log scale, its labels chosen from the axis' view (after autoscaling: one size, or equal budgets, widen it to
    two decades): over a decade or more matplotlib's own log labels; within less, a few plain ticks, as on a linear
    axis (every minor tick labelled collides)."""
    from matplotlib.ticker import MaxNLocator, NullFormatter, NullLocator, ScalarFormatter

    getattr(ax, f"set_{axis}scale")("log")
    lo, hi = sorted(getattr(ax, f"get_{axis}lim")())
    if lo > 0 and hi / lo < 10:
        a = getattr(ax, f"{axis}axis")
        a.set_major_locator(MaxNLocator(nbins=4))
        a.set_major_formatter(ScalarFormatter(useOffset=False))  # as many digits as the ticks need
        a.set_minor_locator(NullLocator())
        a.set_minor_formatter(NullFormatter())


def _empty(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="gray")


def plot_ppl_vs_params(rows: list[dict], path: str | Path) -> Path:
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    any_point = False
    for key, label, style in (
        ("teacher_ppl", "teacher (Transformer)", "o-"),
        ("hedgehog_ppl", "Hedgehog (stage 1)", "s--"),
        ("hedgemamba_ppl", "HedgeMamba (stage 2)", "^-"),
    ):
        pts = sorted((_f(r.get("params")), _f(r.get(key)), r.get("size")) for r in rows if _f(r.get("params")) and _f(r.get(key)))
        if pts:
            any_point = True
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label)
    if any_point:
        _log_axis(ax, "x")
        _log_axis(ax, "y")
        ax.legend()
        for r in rows:
            x, y = _f(r.get("params")), _f(r.get("teacher_ppl"))
            if x and y:
                ax.annotate(str(r.get("size", "")).replace("pythia-", ""), (x, y), textcoords="offset points", xytext=(3, -10), fontsize=7)
    else:
        _empty(ax, "no finished sizes yet")
    ax.set_xlabel("teacher parameters")
    ax.set_ylabel("validation perplexity")
    ax.set_title("Perplexity vs parameters")
    ax.grid(True, which="both", alpha=0.3)
    return _save(fig, Path(path))


def plot_gap_vs_tokens(rows: list[dict], path: str | Path) -> Path:
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    pts = [(_f(r.get("total_tokens")), _f(r.get("gap")), r.get("size")) for r in rows]
    pts = [p for p in pts if p[0] and p[1] is not None]
    if pts:
        ax.scatter([p[0] for p in pts], [p[1] for p in pts])
        for x, y, name in pts:
            ax.annotate(str(name).replace("pythia-", ""), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        _log_axis(ax, "x")
        ax.axhline(0.0, color="gray", lw=0.8)
    else:
        _empty(ax, "no finished sizes yet")
    ax.set_xlabel("distillation tokens (stage 1 + stage 2)")
    ax.set_ylabel("perplexity gap (HedgeMamba - teacher)")
    ax.set_title("Gap vs tokens")
    ax.grid(True, which="both", alpha=0.3)
    return _save(fig, Path(path))


def plot_projected_cost(plan_rows: list[dict], path: str | Path) -> Path:
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    if plan_rows:
        names = [str(r["size"]).replace("pythia-", "") for r in plan_rows]
        bottom = [0.0] * len(plan_rows)
        for st, label in (("cache", "teacher cache"), ("stage1", "stage 1"), ("stage2", "stage 2")):
            vals = [_f(r.get(f"gpu_hours_{st}")) or 0.0 for r in plan_rows]
            ax.bar(names, vals, bottom=bottom, label=label)
            bottom = [b + v for b, v in zip(bottom, vals)]
        if max(bottom) > 0 and max(bottom) / max(min(b for b in bottom if b > 0), 1e-30) > 100:
            ax.set_yscale("log")
        for i, r in enumerate(plan_rows):
            ax.annotate(f"{r.get('gpus', '?')} GPU", (i, bottom[i]), ha="center", va="bottom", fontsize=7)
        ax.legend()
    else:
        _empty(ax, "no plan")
    ax.set_xlabel("size")
    ax.set_ylabel("projected GPU-hours")
    ax.set_title("Projected cost")
    ax.grid(True, axis="y", alpha=0.3)
    return _save(fig, Path(path))


def plot_all(rows: list[dict], plan_rows: list[dict], out_dir: str | Path) -> list[Path]:
    out = Path(out_dir)
    return [
        plot_ppl_vs_params(rows, out / "ppl_vs_params.png"),
        plot_gap_vs_tokens(rows, out / "gap_vs_tokens.png"),
        plot_projected_cost(plan_rows, out / "projected_cost.png"),
    ]
