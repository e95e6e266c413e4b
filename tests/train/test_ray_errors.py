"""A deterministic training error on Ray workers (here: stage 2 without a stage-1 student) is not retried
by Ray Train: every rank reports it and the driver raises it as the same one-line TrainingError."""

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_training_error_on_workers_reaches_the_driver(ray_cluster, tmp_path, monkeypatch):
    from hmscale.config import build_config
    from hmscale.train.engine import TrainingError
    from ray_jobs.distill import run_distill

    monkeypatch.setenv("HMSCALE_NO_PROGRESS", "1")
    cfg = build_config({}, [
        "teacher.flavor=pythia-nano", "teacher.pretrain_steps=2", "teacher.pretrain_batch_size=4",
        "tokenizer.vocab_size=512", "data.seq_len=64", "data.max_documents=30", f"data.cache_dir={tmp_path / 'data'}",
        "parallel.engine=ray", "parallel.num_workers=2", "parallel.max_failures=3",
    ])
    with pytest.raises(TrainingError, match="no stage-1 student") as err:
        run_distill(cfg, tmp_path / "run", stages=("stage2",), log=lambda *a, **k: None)
    assert "\n" not in str(err.value)
