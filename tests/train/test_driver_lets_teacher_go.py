"""With worker processes (engine=local with several workers, or Ray), each worker loads its own teacher: the driver's
copy, which prepared the data plan and the cache, stayed alive through the whole training, on the GPU with
parallel.use_gpu (beside worker 0's own on that device). The driver now lets it go before the workers start, and the
recipe reloads it for the evaluation."""
import gc
import json
import os
import weakref

import pytest

from hmscale.config import build_config

os.environ.setdefault("HMSCALE_NO_PROGRESS", "1")


class _Stop(Exception):
    pass


def _setup(tmp_path, monkeypatch):
    """(overrides, refs, alive): every teacher the driver prepared, and whether one was alive when workers spawned."""
    import ray_jobs.distill as distill
    import hmscale.train.launch as launch

    refs, alive = [], []
    prepare = distill.prepare

    def recording_prepare(*a, **k):
        prep = prepare(*a, **k)
        refs.append(weakref.ref(prep["teacher"]))
        return prep

    def checking_spawn(fn, nprocs, *args, use_gpu=False):
        gc.collect()
        alive.append(any(r() is not None for r in refs))
        raise _Stop  # (the training itself is another test's)

    monkeypatch.setattr(distill, "prepare", recording_prepare)
    monkeypatch.setattr(launch, "spawn_workers", checking_spawn)
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.jsonl").write_text("".join(json.dumps({"text": f"def f_{i}(x): return x + {i}"}) + "\n"
                                                         for i in range(400)))
    overrides = ["data.source=files", f"data.paths=[{tmp_path / 'corpus'}]", "teacher.flavor=pythia-nano",
                 "tokenizer.vocab_size=300", "teacher.pretrain_steps=2", "data.seq_len=32",
                 "data.sequences_per_shard=8", "budget.total_tokens=1024", "stage1.source=online",
                 "stage1.steps=1", "stage2.steps=1", "stage1.micro_batch_size=2", "stage2.micro_batch_size=2",
                 "parallel.engine=local", "parallel.num_workers=2", "stage2.kd_weight=0.5", "stage2.kd_source=online",
                 f"data.cache_dir={tmp_path / 'cache'}", f"cache.root={tmp_path / 'cache' / 't'}"]
    return overrides, refs, alive


def test_run_distill_lets_the_drivers_teacher_go_before_the_workers_start(tmp_path, monkeypatch):
    import ray_jobs.distill as distill

    overrides, refs, alive = _setup(tmp_path, monkeypatch)
    # (a stage 2 with a live teacher: the one-process engine keeps the driver's for it; workers load their own)
    cfg = build_config({}, [*overrides, f"output_dir={tmp_path / 'run'}"])
    with pytest.raises(_Stop):
        distill.run_distill(cfg, tmp_path / "run", log=lambda *a, **k: None)
    assert refs and alive == [False]


def test_the_recipe_hands_its_teacher_over_to_worker_processes(tmp_path, monkeypatch):
    from hmscale.recipe import run_recipe

    overrides, refs, alive = _setup(tmp_path, monkeypatch)
    cfg = build_config({}, [*overrides, f"output_dir={tmp_path / 'run'}"])
    with pytest.raises(_Stop):
        run_recipe(cfg, log=lambda *a, **k: None)
    assert refs and alive == [False]
