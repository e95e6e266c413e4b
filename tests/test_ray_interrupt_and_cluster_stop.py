"""What a run's Ray leaves behind when it stops: Ctrl-C during Ray Train (Ray's own SIGINT handler ended the run
through ``sys.exit``, so the recipe's resume line was never printed) and the embedded cluster a run started (up until
the process ended)."""

import os
import signal
import sys
import threading
import time
from types import SimpleNamespace

import pytest


@pytest.mark.ray
def test_ctrl_c_during_ray_training_is_an_interrupt(ray_cluster, tmp_path, monkeypatch):
    """fit()'s SIGINT handler aborts the workers, then sys.exit, which Ray's interrupted get raises as SystemExit(1):
    `hmscale run` ended without the recipe's resume line (and a script calling the recipe saw no KeyboardInterrupt)."""
    from hmscale.config import build_config
    from ray_jobs import distill

    started = tmp_path / "started"

    def slow_train_func(config):  # (a closure: Ray sends it by value, with the marker's path)
        started.write_text("1")
        time.sleep(120)

    monkeypatch.setattr(distill, "train_func", slow_train_func)
    cfg = build_config({}, ["parallel.engine=ray", "parallel.num_workers=1", "parallel.max_failures=0",
                            f"output_dir={tmp_path / 'run'}"])
    before = signal.getsignal(signal.SIGINT)

    def interrupt():
        deadline = time.time() + 90
        while not started.exists() and time.time() < deadline:
            time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt, daemon=True).start()
    t0 = time.time()
    with pytest.raises(KeyboardInterrupt):
        distill._run_ray(cfg, {"stages": ["stage1"]}, tmp_path / "run", storage_path=str(tmp_path / "ray"),
                         log=lambda *_: None)
    assert started.exists()
    assert time.time() - t0 < 100, "the interrupt did not stop the training"
    assert signal.getsignal(signal.SIGINT) is before


def test_the_run_stops_its_embedded_ray_cluster_before_the_evaluation_and_on_failure(tmp_path, monkeypatch):
    """The embedded Ray cluster a run started (training, a Ray cache build) stayed up until the process ended: through
    the evaluation that follows in the same process, and in a notebook after the run (its raylet, idle workers and
    object store)."""
    import json

    import hmscale.ray_cluster as rc
    import hmscale.recipe as recipe
    import hmscale.train.stage1 as stage1
    from hmscale.config import build_config, save_resolved
    from hmscale.run_identity import training_hash
    from ray_jobs import distill

    cfg = build_config({}, ["parallel.engine=ray", f"output_dir={tmp_path / 'run'}"]).with_absolute_paths()
    run = tmp_path / "run"
    run.mkdir()
    save_resolved(cfg, run)  # a run whose training is done, its evaluation not
    (run / "results.json").write_text(json.dumps({"config_hash": training_hash(cfg), "stages": {
        "prepare": {"seconds": 1.0}, "stage1": {"seconds": 2.0}, "stage2": {"seconds": 3.0}}}))
    events = []
    monkeypatch.setattr(rc, "connect", lambda *a, **k: events.append("connect") or True)
    monkeypatch.setattr(rc, "stop_embedded", lambda log=print: events.append("stop"))
    monkeypatch.setattr(distill, "prepare", lambda *a, **k: {"data": SimpleNamespace(), "teacher": None,
                                                              "cache_dir": None})
    monkeypatch.setattr(stage1, "load_stage1_student", lambda *a: None)
    monkeypatch.setattr(recipe, "load_final_model", lambda *a: None)

    def evaluate(*a, **k):
        events.append("eval")
        raise RuntimeError("the evaluation failed")

    monkeypatch.setattr(recipe, "evaluate_models", evaluate)
    with pytest.raises(RuntimeError, match="evaluation failed"):
        recipe.run_recipe(cfg, log=lambda *_: None)
    assert events == ["connect", "stop", "eval", "stop"]


def test_stop_embedded_stops_only_a_cluster_this_process_started(monkeypatch):
    import hmscale.ray_cluster as rc

    calls = []
    fake_ray = SimpleNamespace(is_initialized=lambda: True, shutdown=lambda: calls.append("shutdown"))
    monkeypatch.setitem(sys.modules, "ray", fake_ray)
    monkeypatch.setattr(rc, "_started_embedded", False)  # joined, in a task, or the caller's own ray.init
    rc.stop_embedded(log=calls.append)
    assert calls == []
    monkeypatch.setattr(rc, "_started_embedded", True)
    rc.stop_embedded(log=calls.append)
    rc.stop_embedded(log=calls.append)  # once
    assert calls == ["shutdown", "[ray] embedded local cluster stopped"] and rc._started_embedded is False
