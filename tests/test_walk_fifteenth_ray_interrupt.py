"""Ctrl-C while Ray Train trains: Ray's own SIGINT handler (installed by fit()) aborts the run's workers and ends
with ``sys.exit(0)`` from inside ``fit()``; the recipe, which says how to resume on ``KeyboardInterrupt``, said
nothing, and `hmscale run` exited as if the run had ended (the local engine says where the stage stands)."""

import os
import signal
import threading
import time

import pytest


@pytest.mark.ray
def test_ctrl_c_during_ray_training_is_an_interrupt(ray_cluster, tmp_path, monkeypatch):
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
