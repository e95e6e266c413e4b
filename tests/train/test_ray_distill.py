"""Ray Train: 2 DeepSpeed workers (ZeRO-2, gloo) run stage 1 from the teacher cache and stage 2 with KD;
a worker is SIGKILLed mid stage 2 and the run finishes through Ray Train's restart from the last
reported checkpoint. Stage-1 and stage-2 losses fall."""

import json

import pytest


def _mean(xs):
    return sum(xs) / len(xs)


def test_one_cluster_serves_the_cache_and_the_trainer(monkeypatch, tmp_path):
    # `python -m ray_jobs.distill` with engine=ray: the cache's actors used to start an embedded cluster of their own
    # (their connect found none) and shut it down, then the trainer started a second one: two start-ups, two
    # "[ray] embedded local cluster" lines. The cluster is now joined (or started) before the data, teacher and cache.
    import hmscale.ray_cluster
    from hmscale.config import build_config
    from ray_jobs import distill

    calls = []
    monkeypatch.setattr(hmscale.ray_cluster, "connect", lambda address=None, **kw: calls.append(("connect", address)))

    def prepare(cfg, log=print, stages=distill.STAGES, check_data=None):
        calls.append(("prepare", None))
        return {"data": None, "teacher": None, "cache_dir": None}
    monkeypatch.setattr(distill, "prepare", prepare)
    monkeypatch.setattr(distill, "_run_ray", lambda cfg, config, run_dir, **kw: calls.append(("train", None)) or {})
    cfg = build_config({}, ["parallel.engine=ray", "parallel.ray_address=10.0.0.1:6379"])
    distill.run_distill(cfg, tmp_path / "run", log=lambda *a, **k: None)
    assert calls == [("connect", "10.0.0.1:6379"), ("prepare", None), ("train", None)]
    calls.clear()  # the local engine never touches Ray
    monkeypatch.setattr(distill, "_run_local_workers", lambda cfg, config, run_dir, **kw: calls.append(("train", None)) or {})
    distill.run_distill(build_config({}, ["parallel.engine=local", "parallel.num_workers=2"]), tmp_path / "run2",
                        log=lambda *a, **k: None)
    assert calls == [("prepare", None), ("train", None)]


@pytest.mark.ray
@pytest.mark.slow
def test_two_workers_zero2_cache_kill_and_resume(ray_cluster, tmp_path, monkeypatch):
    from hmscale.config import build_config
    from ray_jobs.distill import FAULT_ENV, run_distill

    cfg = build_config({}, [
        "teacher.flavor=pythia-nano", "teacher.pretrain_steps=4", "teacher.pretrain_batch_size=8",
        "tokenizer.vocab_size=512", "data.seq_len=64", "data.sequences_per_shard=16", "data.max_documents=40",
        f"data.cache_dir={tmp_path / 'data'}", f"cache.root={tmp_path / 'cache'}", "cache.max_tokens=4096",
        "cache.capture.dtype=float32", "cache.capture.topk=8", "cache.workers=1", "cache.engine=local",
        "stage1.steps=10", "stage1.micro_batch_size=4", "stage1.lr=0.05", "stage1.warmup_steps=1",
        "stage2.steps=10", "stage2.micro_batch_size=4", "stage2.lr=3e-3", "stage2.warmup_steps=1",
        "stage2.kd_weight=0.5", "stage2.eval_every=5", "eval.max_sequences=8",
        "parallel.engine=ray", "parallel.num_workers=2", "parallel.zero_stage=2", "parallel.checkpoint_every=3",
        "parallel.max_failures=2",
    ])
    monkeypatch.setenv(FAULT_ENV, "stage2:5:1")  # rank 1 dies at the start of stage-2 step 5 (after the step-3 checkpoint)
    monkeypatch.setenv("HMSCALE_NO_PROGRESS", "1")
    # the suite's embedded cluster (tests/conftest.py), started as run_distill starts its own
    run_distill(cfg, tmp_path / "run", log=lambda *a, **k: None)
    run = tmp_path / "run"
    assert (run / ".fault_stage2_5_1").exists(), "the fault was not injected"
    s1 = json.loads((run / "stage1" / "summary.json").read_text())
    s2 = json.loads((run / "stage2" / "summary.json").read_text())
    assert s1["done"] and s1["mode"] == "cache" and s2["done"]
    assert s2["start_step"] == 3, s2  # the restarted group resumed from the step-3 checkpoint
    assert (run / "stage2" / "hf" / "config.json").exists()

    def train(stage):
        return [json.loads(l) for l in (run / stage / "metrics.jsonl").read_text().splitlines()
                if json.loads(l)["kind"] == "train"]

    l1 = [r["loss"] for r in train("stage1")]
    l2 = [r["loss"] for r in train("stage2")]
    assert [r["step"] for r in train("stage2")] == list(range(10))  # one coherent history across the restart
    assert _mean(l1[-3:]) < _mean(l1[:3]), l1
    assert _mean(l2[-3:]) < _mean(l2[:3]), l2
    assert "kd" in train("stage2")[0] and "layer_loss/1" in train("stage1")[0]
