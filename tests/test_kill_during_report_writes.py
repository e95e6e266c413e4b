"""A run killed while its report is (re)written, or killed between an atomic write and its rename, and Ctrl-C
outside training: what a reader and the rerun find in the run directory."""

import io
import json

import pytest

from hmscale.config import build_config


class Killed(BaseException):
    """What a SIGKILL mid-write leaves: the code after the interrupted call never runs."""


def _metrics(run_dir):
    for stage in ("stage1", "stage2"):
        (run_dir / stage).mkdir(parents=True, exist_ok=True)
        (run_dir / stage / "metrics.jsonl").write_text(
            "".join(json.dumps({"step": s, "loss": 1.0 / (s + 1), "kind": "train"}) + "\n" for s in range(12)))


def test_a_plot_killed_mid_write_leaves_the_previous_plot_whole(tmp_path, monkeypatch):
    """Every rerun of a finished run rewrites its plots: a kill while the PNG is being written must leave the one the
    report points at whole (the rerun's half-written bytes never under that name)."""
    from matplotlib.figure import Figure

    from hmscale.report import long_context_plot, loss_plot

    _metrics(tmp_path)
    lc = {"buckets": [[1, 64], [64, 128]], "ppl": {"teacher": [3.0, 4.0], "hedgemamba": [3.5, 3.9]},
          "train_seq_len": 64, "rows": 2, "length": 128}
    before = {p.name: p.read_bytes() for p in (loss_plot(tmp_path), long_context_plot(tmp_path, lc))}
    real = Figure.savefig

    def torn(self, fname, *args, **kwargs):  # writes half of the image where it was told, then the process dies
        buf = io.BytesIO()
        real(self, buf, *args, **{k: v for k, v in kwargs.items() if k != "format"}, format="png")
        half = buf.getvalue()[: len(buf.getvalue()) // 2]
        if hasattr(fname, "write"):
            fname.write(half)
        else:
            with open(fname, "wb") as f:
                f.write(half)
        raise Killed

    monkeypatch.setattr(Figure, "savefig", torn)
    for plot in (lambda: loss_plot(tmp_path), lambda: long_context_plot(tmp_path, lc)):
        with pytest.raises(Killed):
            plot()
    assert {name: (tmp_path / name).read_bytes() for name in before} == before


def test_a_rerun_removes_what_killed_atomic_writes_left(tmp_path, monkeypatch):
    """SIGKILL between an atomic write's temporary and its rename leaves `.NAME.XXXXXXXX.tmp` beside the file; the
    rerun of the run directory removes them (the run directory is the recipe's)."""
    from hmscale import recipe

    cfg = build_config({}, [f"output_dir={tmp_path}", "parallel.engine=local"])
    leftovers = [tmp_path / ".results.json.ab12cd34.tmp", tmp_path / ".report.md.x_y9z0qq.tmp",
                 tmp_path / ".losses.png.k2j3h4g5.tmp", tmp_path / "stage1" / ".summary.json.q1w2e3r4.tmp",
                 tmp_path / "stage2" / ".metrics.jsonl.a1s2d3f4.tmp",
                 tmp_path / "stage1" / "student" / ".student.json.z9x8c7v6.tmp"]
    for p in leftovers:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("{partial")
    kept = [tmp_path / "notes.tmp", tmp_path / "stage2" / "summary.json"]
    for p in kept:
        p.write_text("{}")

    class Stop(Exception):
        pass

    def stop(*a, **k):
        raise Stop

    import ray_jobs.distill

    monkeypatch.setattr(ray_jobs.distill, "prepare", stop)  # everything before the data: the run directory's set-up
    with pytest.raises(Stop):
        recipe.run_recipe(cfg, log=lambda *a: None)
    assert [p for p in leftovers if p.exists()] == []
    assert all(p.exists() for p in kept)


def test_ctrl_c_outside_training_says_how_to_resume(tmp_path, monkeypatch, capsys):
    """Ctrl-C in the data, teacher, cache, evaluation or report steps: one line on stderr naming the rerun that
    resumes (the training loop prints its own), and the interrupt goes on up (exit code 130)."""
    from hmscale import recipe

    cfg = build_config({}, [f"output_dir={tmp_path}", "parallel.engine=local"])

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    import ray_jobs.distill

    monkeypatch.setattr(ray_jobs.distill, "prepare", interrupted)
    with pytest.raises(KeyboardInterrupt):
        recipe.run_recipe(cfg, log=lambda *a: None)
    err = capsys.readouterr().err
    assert "interrupted" in err and "hmscale run" in err and str(tmp_path) in err and "resume" in err


def test_a_rerun_after_a_kill_past_training_keeps_the_trainings_time(tmp_path, monkeypatch):
    """Killed after both trainings finished but before the recipe recorded them: the rerun skips them (run_distill
    returns their recorded summaries) and the distill stage's time is theirs, not the ~0 s of the skip."""
    import types

    import ray_jobs.distill
    from hmscale import recipe

    cfg = build_config({}, [f"output_dir={tmp_path}", "parallel.engine=local"])
    data = types.SimpleNamespace(plan=types.SimpleNamespace(total_tokens=10), val_tokens=[1], vocab_size=5)
    monkeypatch.setattr(ray_jobs.distill, "prepare",
                        lambda cfg, log, check_data, stages=None: {"data": data, "teacher": None, "cache_dir": None})
    monkeypatch.setattr(ray_jobs.distill, "run_distill", lambda *a, **k: {
        "stage1": {"seconds": 12.5, "tokens": 100, "skipped": True},
        "stage2": {"seconds": 30.25, "tokens": 200, "skipped": True}, "seconds": 0.0})

    class Stop(Exception):
        pass

    def stop(*a, **k):
        raise Stop

    monkeypatch.setattr("hmscale.teacher.get_teacher", lambda *a, **k: None)  # (the eval's reload: stubbed too)
    monkeypatch.setattr("hmscale.train.stage1.load_stage1_student", stop)  # the eval stage: not this test's
    with pytest.raises(Stop):
        recipe.run_recipe(cfg, log=lambda *a: None)
    stages = json.loads((tmp_path / "results.json").read_text())["stages"]
    assert stages["stage1"]["seconds"] == 12.5 and stages["stage2"]["seconds"] == 30.25
    assert 42.75 <= stages["distill"]["seconds"] < 44.0
