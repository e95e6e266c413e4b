"""Plots for run reports (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import io
import json
from pathlib import Path

from hmscale.atomic import atomic_write_bytes


def _save(fig, out: Path) -> Path:
    """The figure as a PNG at ``out``, atomically: a rerun killed while rewriting a plot leaves the previous one whole
    (matplotlib writes into the named file as it renders)."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return atomic_write_bytes(out, buf.getvalue())


def _series(path: Path, key: str = "loss", kind: str = "train") -> tuple[list[int], list[float]]:
    steps, values = [], []
    if not path.exists():
        return steps, values
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if key in row and "step" in row and row.get("kind", "train") == kind:
            steps.append(int(row["step"]))
            values.append(float(row[key]))
    return steps, values


def loss_plot(run_dir: str | Path) -> Path | None:
    """losses.png: stage-1 cosine loss and stage-2 cross-entropy against steps; None when no metrics exist."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    # stage 2's "loss" weighs in KD and the hidden-state term (ce_weight, kd_weight, hidden_weight): the panel labelled
    # cross-entropy plots its "ce" (metrics without one: the loss, which then is the CE)
    ce = _series(run_dir / "stage2" / "metrics.jsonl", "ce")
    curves = {"stage1": _series(run_dir / "stage1" / "metrics.jsonl"),
              "stage2": ce if ce[0] else _series(run_dir / "stage2" / "metrics.jsonl")}
    if not any(steps for steps, _ in curves.values()):
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for ax, (name, (steps, values)), ylabel in zip(axes, curves.items(), ("1 - cos (attention outputs)", "cross-entropy")):
        ax.set_title(name)
        if not steps:  # no axes made up around nothing
            # a stage that trained no step (budget.split gives it no tokens) says so at its start
            untrained = _series(run_dir / name / "metrics.jsonl", "total_steps", kind="event")[1][-1:] == [0.0]
            ax.text(0.5, 0.5, "no step trained\n(budget.split gives it no tokens)" if untrained
                    else "no training steps recorded", ha="center", va="center", transform=ax.transAxes)
            ax.set_xticks([])
            ax.set_yticks([])
            continue
        ax.plot(steps, values, alpha=0.35, label="per step")
        if len(values) >= 10:
            ema, smooth = values[0], []
            for v in values:
                ema = 0.9 * ema + 0.1 * v
                smooth.append(ema)
            ax.plot(steps, smooth, label="moving average")
            ax.legend()
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return _save(fig, run_dir / "losses.png")


def long_context_plot(run_dir: str | Path, lc: dict, labels: dict | None = None) -> Path:
    """long_context.png: each model's perplexity per target-position bucket (``hmscale.eval.long_context``), the
    training length marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hmscale.eval.long_context import models_in_order

    labels = labels or {}
    mids = [(lo * hi) ** 0.5 for lo, hi in lc["buckets"]]  # geometric middle: the buckets double
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name in models_in_order(lc, labels):
        ax.plot(mids, lc["ppl"][name], marker="o", label=labels.get(name, name))
    ax.axvline(lc["train_seq_len"], color="grey", linestyle="--", linewidth=1, label="training length")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("target position (bucket middle)")
    ax.set_ylabel("perplexity")
    ax.set_title(f"{lc['rows']} rows of {lc['length']:,} tokens")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return _save(fig, Path(run_dir) / "long_context.png")
