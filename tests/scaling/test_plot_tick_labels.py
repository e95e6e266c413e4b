"""Scaling plots stay readable with one size, equal token budgets and narrow ranges.

Every Pythia size gets the same ~10B-token budget by default (and every miniature 400K), so the gap-vs-tokens plot
has one x value; a study of one size has one x value on both plots. The log axes then labelled every minor tick on
top of the decade labels ("8e+08 9e+08 10^9 ..." printed over each other)."""

import pytest

import scaling.plots as plots


def _overlapping_tick_labels(fig) -> list[tuple[str, str]]:
    """Pairs of visible tick labels (inside the view) whose rendered boxes overlap."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    bad = []
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            lo, hi = sorted(axis.get_view_interval())
            labels = [t.label1 for t in axis.get_major_ticks() + axis.get_minor_ticks()
                      if t.label1.get_visible() and t.label1.get_text() and lo <= t.get_loc() <= hi]
            boxes = [(lab.get_text(), lab.get_window_extent(renderer)) for lab in labels]
            bad += [(a[0], b[0]) for i, a in enumerate(boxes) for b in boxes[i + 1:] if a[1].overlaps(b[1])]
    return bad


@pytest.fixture
def figures(monkeypatch):
    import matplotlib.pyplot as plt

    seen = []

    def capture(fig, path):
        seen.append((path.name, _overlapping_tick_labels(fig), len([t for ax in fig.axes for t in ax.get_xticklabels()
                                                                   + ax.get_xticklabels(minor=True) if t.get_text()])))
        plt.close(fig)
        return path

    monkeypatch.setattr(plots, "_save", capture)
    return seen


@pytest.mark.parametrize("xs", [
    [1.0e5],                      # one size
    [1.0e10, 1.0e10, 1.0e10],     # every Pythia size at the default budget
    [1.0e5, 9.0e5],               # just under a decade
    [4.0e5, 4.4e5], [4.0e5, 4.1e5],  # tokens trained, a little apart
    [1.0e5, 3.0e5], [1.0e5, 1.0e8],
])
def test_log_axes_tick_labels_do_not_overlap(tmp_path, figures, xs):
    rows = [{"size": f"pythia-s{i}", "params": x, "teacher_ppl": 10.0 + i, "hedgehog_ppl": 13.0 + i,
             "hedgemamba_ppl": 10.5 + i, "gap": 0.5 - i, "total_tokens": x} for i, x in enumerate(xs)]
    plots.plot_ppl_vs_params(rows, tmp_path / "ppl.png")
    plots.plot_gap_vs_tokens(rows, tmp_path / "gap.png")
    for name, overlaps, n_xlabels in figures:
        assert overlaps == [], (name, overlaps[:3])
        assert n_xlabels >= 1, name  # the x axis still says where the points are
