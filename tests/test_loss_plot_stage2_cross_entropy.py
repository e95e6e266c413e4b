"""losses.png's stage-2 panel, labelled "cross-entropy", plots the cross-entropy.

It plotted the stage's ``loss``, which is ``ce_weight * ce + kd_weight * kd (+ hidden_weight * hidden)``: with
knowledge distillation on (stage2.kd_weight > 0) or ce_weight != 1 the curve under the "cross-entropy" label was
another quantity (here 0.5 CE + 0.5 KD)."""

import json

import hmscale.report as report


def _write_metrics(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_stage2_panel_plots_the_cross_entropy(tmp_path, monkeypatch):
    seen = {}

    def capture(fig, out):
        import matplotlib.pyplot as plt

        seen["axes"] = {ax.get_title(): (ax.get_ylabel(), [list(map(float, ln.get_ydata())) for ln in ax.get_lines()])
                        for ax in fig.axes}
        plt.close(fig)
        return out

    monkeypatch.setattr(report, "_save", capture)
    ce = [6.0 - 0.1 * i for i in range(12)]
    kd = [2.0 - 0.05 * i for i in range(12)]
    _write_metrics(tmp_path / "stage2" / "metrics.jsonl",
                   [{"kind": "train", "step": i, "loss": 0.5 * c + 0.5 * k, "ce": c, "kd": k, "lr": 1e-3}
                    for i, (c, k) in enumerate(zip(ce, kd))] + [{"kind": "eval", "step": 11, "val_loss": 5.0}])
    s1 = [0.5 - 0.01 * i for i in range(12)]
    _write_metrics(tmp_path / "stage1" / "metrics.jsonl", [{"kind": "train", "step": i, "loss": v} for i, v in enumerate(s1)])
    assert report.loss_plot(tmp_path) is not None
    label2, lines2 = seen["axes"]["stage2"]
    assert label2 == "cross-entropy" and lines2[0] == ce  # the per-step curve is the CE, as labelled
    label1, lines1 = seen["axes"]["stage1"]
    assert lines1[0] == s1  # stage 1 keeps its (cosine) loss


def test_stage2_metrics_without_ce_still_plot_the_loss(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(report, "_save", lambda fig, out: seen.setdefault("fig", fig) and out)
    loss = [3.0, 2.5, 2.0]
    _write_metrics(tmp_path / "stage2" / "metrics.jsonl", [{"kind": "train", "step": i, "loss": v} for i, v in enumerate(loss)])
    assert report.loss_plot(tmp_path) is not None
    ax = next(a for a in seen["fig"].axes if a.get_title() == "stage2")
    assert list(map(float, ax.get_lines()[0].get_ydata())) == loss
