"""engine=local with several workers, a deterministic TrainingError (a NaN loss
stop) raised by every worker. torch's launcher SIGTERMs the other workers as soon as one of them exits with an error,
and only rank 0 wrote its error down for the driver: when another rank got there first, rank 0 died before recording
it, and the user read the failing worker's traceback's last line ("local worker 1 failed:
hmscale.train.engine.NonFiniteLoss: ...") as a plain TrainingError instead of the one-line NonFiniteLoss.

Here `train_func` is replaced in the spawned workers (rank 1 raises at once, rank 0 a moment later, as a slower rank
does); the rest is the real path: `_run_local_workers` -> `spawn_workers` -> `_local_worker`. An unexpected error (a
bug, not a TrainingError) keeps the worker's traceback."""

import os
import time
import traceback

import pytest

LINE = ("stage2: loss is nan at step 5 (micro batch 0, loss nan on 1 of 2 workers); the last checkpoint is "
        "/x/stage2/checkpoints/step_00000004: lower stage2.lr or raise stage2.grad_clip, then rerun to resume from it")


def _fake_train_func(kind: str):
    def train_func(config):
        from hmscale.train.engine import NonFiniteLoss

        rank = int(os.environ["RANK"])
        if rank != 1:
            time.sleep(4.0)  # rank 0 is slower to reach the error (its step, a slow disk)
        if kind == "nan":
            raise NonFiniteLoss(LINE)
        if rank == 1:
            raise ValueError("an unexpected bug in rank 1")
        time.sleep(60)
    return train_func


def _child(rank: int, fn, kind: str, config: dict) -> None:
    import ray_jobs.distill as D

    D.train_func = _fake_train_func(kind)
    fn(rank, config)


def _run(monkeypatch, tmp_path, kind: str):
    import hmscale.train.launch as launch
    from hmscale.config import build_config
    from ray_jobs.distill import _run_local_workers

    real = launch.spawn_workers
    monkeypatch.setattr(launch, "spawn_workers",
                        lambda fn, n, config, **kw: real(_child, n, fn, kind, config, **kw))
    cfg = build_config({}, ["parallel.engine=local", "parallel.num_workers=2", f"output_dir={tmp_path / 'run'}"])
    run = tmp_path / "run"
    run.mkdir()
    _run_local_workers(cfg, {"run_dir": str(run), "stages": ["stage2"]}, run, log=lambda *a, **k: None)


def test_a_nan_stop_is_the_one_line_error_whichever_rank_fails_first(monkeypatch, tmp_path):
    from hmscale.train.engine import NonFiniteLoss

    t0 = time.monotonic()
    with pytest.raises(NonFiniteLoss) as err:
        _run(monkeypatch, tmp_path, "nan")
    assert str(err.value) == LINE
    assert time.monotonic() - t0 < 40


def test_an_unexpected_worker_error_keeps_its_traceback(monkeypatch, tmp_path, capfd):
    from hmscale.train.engine import NonFiniteLoss, TrainingError

    with pytest.raises(TrainingError) as err:
        _run(monkeypatch, tmp_path, "bug")
    assert not isinstance(err.value, NonFiniteLoss)
    assert str(err.value) == "local worker 1 failed: ValueError: an unexpected bug in rank 1"  # the run's one line
    # the worker's own traceback: chained to that line, and shown on stderr before it
    chained = "".join(traceback.format_exception(err.value))
    shown = capfd.readouterr().err
    for text in (chained, shown):
        assert "Traceback (most recent call last)" in text and "in train_func" in text, text
        assert 'raise ValueError("an unexpected bug in rank 1")' in text, text
    assert not list((tmp_path / "run").glob("distill_error*.json"))
