"""What a finished run tells its user: report.md, the printed table, losses.png and the run
directory's plots say what the run did, no more.

* ``budget.split=[1, 0]`` / ``[0, 1]`` train no step of one stage (README): the report showed that stage as a row of
  zeros and its model under its trained name, and losses.png an empty panel with made-up axes (-0.04 .. 0.04).
* A rerun with other eval.* settings left the previous evaluation's long_context.png in the run directory next to a
  report that no longer has a long-context table.
* LoRA, ``stage2.trainable=mixers`` and KD runs wrote the same report as full fine-tuning with CE alone.
* A stage trained before this `hmscale run` (``hmscale stage1`` first, or a killed run) and skipped showed its seconds
  as this run's."""

import json

import hmscale.report as report
from hmscale.config import build_config


def _results(split=(0.1, 0.9), skipped=()):
    t1, t2 = (2048 if split[0] else 0), (16384 if split[1] else 0)

    def stage(tokens, name):
        steps = tokens // 2048
        summary = {"done": True, "tokens": tokens, "total_steps": steps, "end_step": steps, "seconds": 1.5 if steps else 1e-6,
                   "final_loss": 0.5 if steps else None, "stage": name}
        if name in skipped:
            summary["skipped"] = True
        return {"seconds": round(summary["seconds"], 2), "tokens": tokens, "summary": summary}

    return {"teacher_ppl": 97.24, "hedgehog_ppl": 119.36, "hedgemamba_ppl": 119.36, "stage1_transfer": "attention",
            "eval_tokens": 16320, "tokens": {"stage1": t1, "stage2": t2},
            "stages": {"prepare": {"seconds": 2.5}, "stage1": stage(t1, "stage1"), "stage2": stage(t2, "stage2"),
                       "distill": {"seconds": 4.0}, "eval": {"seconds": 1.7}}}


def _stage_row(text, name):
    return next(line for line in text.splitlines() if line.startswith(f"| {name}") and "|" in line[2:])


def test_a_stage_given_no_tokens_is_reported_as_untrained(tmp_path, capsys):
    from hmscale.cli import print_results
    from hmscale.recipe import write_report

    text = write_report(tmp_path, _results((1.0, 0.0)), build_config({}, ["budget.split=[1,0]"])).read_text()
    row = _stage_row(text, "stage2")
    assert "no step" in row and "budget.split" in row, row
    assert "no step" not in _stage_row(text, "stage1")
    # the model table says that HedgeMamba is the converted stage-1 model, not a trained stage 2
    note = [line for line in text.splitlines() if "trained no step" in line]
    assert len(note) == 1 and "HedgeMamba (stage 2)" in note[0] and "stage-1 model converted" in note[0], note
    print_results(_results((1.0, 0.0)))
    assert any("trained no step" in line for line in capsys.readouterr().out.splitlines())

    text = write_report(tmp_path, _results((0.0, 1.0)), build_config({}, ["budget.split=[0,1]"])).read_text()
    assert "no step" in _stage_row(text, "stage1") and "no step" not in _stage_row(text, "stage2")
    note = [line for line in text.splitlines() if "trained no step" in line]
    assert len(note) == 1 and "Hedgehog (stage 1)" in note[0] and "as initialised" in note[0], note
    assert "nan" not in text.lower()

    text = write_report(tmp_path, _results(), build_config({})).read_text()
    assert "no step" not in text


def test_the_loss_panel_of_an_untrained_stage_says_so(tmp_path, monkeypatch):
    seen = {}

    def capture(fig, out):
        seen["axes"] = {ax.get_title(): ax for ax in fig.axes}
        return out

    monkeypatch.setattr(report, "_save", capture)
    (tmp_path / "stage1").mkdir()
    (tmp_path / "stage2").mkdir()
    (tmp_path / "stage1" / "metrics.jsonl").write_text(json.dumps({"kind": "event", "step": 0, "total_steps": 0}) + "\n")
    (tmp_path / "stage2" / "metrics.jsonl").write_text(
        "".join(json.dumps({"kind": "train", "step": i, "loss": 4.0 - i, "ce": 4.0 - i}) + "\n" for i in range(3)))
    assert report.loss_plot(tmp_path) is not None
    empty, trained = seen["axes"]["stage1"], seen["axes"]["stage2"]
    assert not empty.get_lines() and any("no step" in t.get_text() for t in empty.texts)
    assert list(empty.get_xticks()) == [] and list(empty.get_yticks()) == []  # no made-up -0.04 .. 0.04 axes
    assert trained.get_lines() and not trained.texts


def test_a_rerun_without_context_length_removes_the_old_plot(tmp_path):
    from hmscale.recipe import write_report

    lc = {"length": 1024, "train_seq_len": 256, "rows": 2, "rows_from": "documents",
          "buckets": [[1, 256], [256, 512], [512, 1024]],
          "ppl": {"teacher": [40.0, 50.0, 60.0], "hedgehog": [45.0, 44.0, 43.0], "hedgemamba": [39.0, 35.0, 33.5]}}
    write_report(tmp_path, {**_results(), "long_context": lc}, build_config({}, ["eval.context_length=1024"]))
    assert (tmp_path / "long_context.png").exists()
    text = write_report(tmp_path, _results(), build_config({})).read_text()
    assert "long_context" not in text
    assert not (tmp_path / "long_context.png").exists()  # not another evaluation's plot beside this report


def test_stage2_settings_are_in_the_report(tmp_path):
    from hmscale.recipe import write_report

    plain = write_report(tmp_path, _results(), build_config({})).read_text()
    line = next(ln for ln in plain.splitlines() if ln.startswith("Stage 2"))
    assert "all weights" in line and "cross-entropy" in line and "KD" not in line and "LoRA" not in line

    lora = write_report(tmp_path, _results(), build_config({}, ["stage2.lora_rank=4"])).read_text()
    line = next(ln for ln in lora.splitlines() if ln.startswith("Stage 2"))
    assert "LoRA rank 4" in line and "in_proj, out_proj" in line

    mix = write_report(tmp_path, _results(), build_config({}, ["stage2.trainable=mixers", "stage2.kd_weight=0.5",
                                                               "stage2.kd_source=online"])).read_text()
    line = next(ln for ln in mix.splitlines() if ln.startswith("Stage 2"))
    assert "mixers" in line and "0.5 x KD" in line and "online" in line and "all weights" not in line


def test_a_stage_done_before_this_run_is_marked_skipped(tmp_path):
    from hmscale.recipe import write_report

    text = write_report(tmp_path, _results(skipped=("stage1",)), build_config({})).read_text()
    assert "skipped" in _stage_row(text, "stage1")
    assert "skipped" not in _stage_row(text, "stage2")
    assert "skipped" not in write_report(tmp_path, _results(), build_config({})).read_text()


def test_a_stage_without_metrics_is_not_blamed_on_the_split(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(report, "_save", lambda fig, out: seen.setdefault("fig", fig) and out)
    (tmp_path / "stage2").mkdir()
    (tmp_path / "stage2" / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 0, "loss": 4.0}) + "\n")
    assert report.loss_plot(tmp_path) is not None
    ax = next(a for a in seen["fig"].axes if a.get_title() == "stage1")
    assert [t.get_text() for t in ax.texts] == ["no training steps recorded"]


def test_the_settings_of_an_untrained_stage2_do_not_claim_training(tmp_path):
    from hmscale.recipe import write_report

    text = write_report(tmp_path, _results((1.0, 0.0)), build_config({}, ["budget.split=[1,0]"])).read_text()
    line = next(ln for ln in text.splitlines() if ln.startswith("Stage 2 settings"))
    assert line.endswith("(No step trained.)")


def test_distill_time_counts_a_resumed_stage_s_earlier_attempts():
    """A run killed inside stage 2 and rerun: stage 2's seconds (over every attempt) were 75.7 s in a distill row of
    23.4 s and a wall_seconds of 26.7 s, the first attempt's time counted in the stage and not in what holds it."""
    from hmscale.recipe import earlier_seconds

    res = {"stage1": {"seconds": 11.1, "skipped": True, "resumed_seconds": 0.0},
           "stage2": {"seconds": 75.7, "resumed_seconds": 64.0, "start_step": 40}, "seconds": 12.3}
    assert earlier_seconds(res) == 11.1 + 64.0
    assert earlier_seconds({"stage1": {"seconds": 1.0}, "stage2": {"seconds": 2.0}}) == 0.0  # fresh; older summaries
    assert earlier_seconds({"stage1": {"seconds": 1.0, "skipped": True, "resumed_seconds": 0.4}}) == 1.0


def test_a_resumed_stage_summary_says_its_earlier_seconds(tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "train"))
    from test_engine_resume import ArraySource, _cfg, tiny_student, toks

    from hmscale.train.stage2 import run_stage2

    cfg = _cfg()
    part = run_stage2(cfg, tmp_path, student=tiny_student()[1], source=ArraySource(toks()), stop_at_step=3, export=False)
    assert part["resumed_seconds"] == 0.0
    rest = run_stage2(cfg, tmp_path, student=tiny_student(seed=5)[1], source=ArraySource(toks()), export=False)
    meta3 = json.loads((tmp_path / "stage2" / "checkpoints" / "step_00000003" / "meta.json").read_text())
    assert rest["start_step"] == 3 and rest["resumed_seconds"] == meta3["stage_seconds"] > 0
    assert rest["seconds"] > rest["resumed_seconds"]
    assert json.loads((tmp_path / "stage2" / "summary.json").read_text())["resumed_seconds"] == rest["resumed_seconds"]


def test_the_engine_named_is_the_one_that_trained(tmp_path):
    """A finished run (trained with parallel.engine=ray) rerun with engine=local and other eval.* settings redoes only
    the evaluation; its report said "engine local"."""
    from hmscale.recipe import write_report

    results = _results()
    results["stages"]["distill"]["engine"] = "ray"
    text = write_report(tmp_path, results, build_config({}, ["parallel.engine=local"])).read_text()
    assert "engine ray." in text and "engine local" not in text
    del results["stages"]["distill"]["engine"]  # (a run recorded before the engine was)
    assert "engine local." in write_report(tmp_path, results, build_config({}, ["parallel.engine=local"])).read_text()


def test_hmscale_eval_says_which_stage1_model_it_scored(tmp_path, monkeypatch):
    """`hmscale eval` printed hedgehog_ppl without stage1_transfer: with stage1.transfer=mixer that number is the
    mixer-transfer model's, which the run's results.json (and report) say and its JSON did not."""
    import hmscale.data
    import hmscale.recipe as recipe
    import hmscale.teacher
    import hmscale.train.stage1

    cfg = build_config({}, [f"output_dir={tmp_path}", "stage1.transfer=mixer"])
    monkeypatch.setattr(recipe, "_check_identity", lambda *a, **k: None)
    monkeypatch.setattr(hmscale.data, "prepare_data", lambda cfg, log=None: "data")
    monkeypatch.setattr(hmscale.teacher, "get_teacher", lambda cfg, data, log=None: "teacher")
    monkeypatch.setattr(hmscale.train.stage1, "load_stage1_student", lambda run_dir, teacher: "stage1")
    monkeypatch.setattr(recipe, "load_final_model", lambda run_dir, data=None: "final")
    monkeypatch.setattr(recipe, "evaluate_models", lambda cfg, data, models, log=None: {f"{n}_ppl": 1.0 for n in models})
    (tmp_path / "results.json").write_text("{}")
    out = recipe.evaluate_run(cfg, log=lambda *a: None)
    assert out["stage1_transfer"] == "mixer" and out["hedgehog_ppl"] == 1.0
