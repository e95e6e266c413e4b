"""Training stages (CPU, gloo, one process): checkpoint retention, the teacher, DeepSpeed JSON, validation:

- a save with a damaged newer checkpoint beside it (the resume passed it over for the one before) counted that one
  among parallel.keep_checkpoints: with keep=1 every new checkpoint was removed as soon as it was written, the
  `on_checkpoint` hook (Ray's report) was handed a deleted directory, and a kill then left nothing to resume from;
- stage 2 with online KD (the live teacher) had the driver build a teacher cache it never reads (every layer's
  attention tensors: a teacher pass and its disk), even with cache.enabled=false;
- a stage-1 student loaded onto another teacher than the one it was trained against (a time-capped miniature
  pretrained again, a replaced teacher folder) was taken silently: stage 2 started from another model than stage 1's;
- engine=local with one worker held three copies of the teacher during stage 2 with a live teacher (online KD) after a
  mixer transfer: the driver's, the worker's (loaded again in the same process) and one more stage 2 loaded itself;
- a DeepSpeed JSON with a nested "auto" (an HF Trainer config: optimizer.params.eps, zero_optimization.*) ended in
  torch's TypeError traceback ("'<=' not supported between instances of 'float' and 'str'"): now one line naming them;
- a DeepSpeed JSON whose optimizer is not Adam (SGD) crashed on CPU with parallel.adam=auto (`SGD.__init__() got an
  unexpected keyword argument 'torch_adam'`): auto keeps the JSON's own optimizer, adam=foreach refuses in one line;
- stage 2 on data without validation rows wrote an empty eval line to metrics.jsonl (and an empty "stage2 step N:" to
  the progress) at every stage2.eval_every;
- stage 2 validated its final weights twice (the loop's last eval, then again for summary.json).
"""

import os
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from hmscale.config import build_config
from hmscale.train.data import ArraySource

os.environ.setdefault("HMSCALE_NO_PROGRESS", "1")


def _student(seed=0, vocab=96):
    from transformers import GPTNeoXForCausalLM

    from hmscale.models.convert import to_hedgehog
    from hmscale.teacher.flavors import neox_config

    torch.manual_seed(seed)
    return to_hedgehog(GPTNeoXForCausalLM(neox_config("pythia-nano", vocab_size=vocab)).eval())


def _toks(n=48, L=32, vocab=96, seed=1):
    return np.random.default_rng(seed).integers(0, vocab, size=(n, L))


def _cfg(*extra):
    return build_config({}, ["stage2.steps=6", "stage2.micro_batch_size=4", "stage2.warmup_steps=2", "stage2.lr=3e-3",
                             "parallel.checkpoint_every=3", "parallel.zero_stage=2", *extra])


def _stage2(cfg, run_dir, **kw):
    from hmscale.train.stage2 import run_stage2

    return run_stage2(cfg, run_dir, student=_student(), source=kw.pop("source", None) or ArraySource(_toks()),
                      export=kw.pop("export", False), **kw)


# ---------------------------------------------------------------- checkpoint keep count


def test_a_damaged_newer_checkpoint_does_not_push_out_the_ones_written_after_the_resume(tmp_path):
    ck = tmp_path / "stage2" / "checkpoints"
    _stage2(_cfg(), tmp_path)  # checkpoints of steps 3 and 6
    optim = sorted((ck / "step_00000006" / "state").glob("*optim*"))[0]
    optim.write_bytes(optim.read_bytes()[:100])  # step 6 damaged: the rerun resumes from step 3
    (tmp_path / "stage2" / "summary.json").unlink()
    seen = []
    res = _stage2(_cfg("parallel.checkpoint_every=1", "parallel.keep_checkpoints=1"), tmp_path, stop_at_step=5,
                  on_checkpoint=lambda step, path, metrics: seen.append((step, Path(path).is_dir())))
    assert res["start_step"] == 3 and res["end_step"] == 5
    assert seen == [(4, True), (5, True)], seen  # each reported checkpoint is there when reported
    names = sorted(p.name for p in ck.iterdir())
    assert names == ["step_00000005", "step_00000006"], names  # keep=1 of the steps trained; the damaged one left
    from hmscale.train.engine import Checkpointer

    assert Checkpointer(ck).latest(log=lambda _: None) == ck / "step_00000005"  # a kill now resumes from step 5


# ---------------------------------------------------------------- what the driver prepares


def _prepare_calls(monkeypatch, *overrides):
    """The driver's preparation for stage 2, its data, teacher and cache builds stubbed: whether it built a cache."""
    import hmscale.data
    import hmscale.teacher
    import hmscale.teacher.cache
    from ray_jobs.distill import prepare

    built = []
    monkeypatch.setattr(hmscale.data, "prepare_data", lambda cfg, log=None: types.SimpleNamespace())
    monkeypatch.setattr(hmscale.teacher, "get_teacher", lambda cfg, data, log=None: types.SimpleNamespace())
    monkeypatch.setattr(hmscale.teacher.cache, "build_cache", lambda cfg, data, teacher: built.append(1) or "/cache")
    cfg = build_config({}, ["parallel.engine=local", *overrides])
    return prepare(cfg, log=lambda *a, **k: None, stages=("stage2",))["cache_dir"], built


def test_stage2_with_online_kd_builds_no_teacher_cache(monkeypatch):
    online = ["stage2.kd_weight=1", "stage2.kd_source=online"]
    assert _prepare_calls(monkeypatch, *online) == (None, [])
    assert _prepare_calls(monkeypatch, *online, "cache.enabled=false") == (None, [])
    # cached KD reads the cache's top-k: built
    assert _prepare_calls(monkeypatch, "stage2.kd_weight=1", "cache.capture.topk=4") == ("/cache", [1])


# ---------------------------------------------------------------- the stage 1 -> stage 2 hand-off


def _teacher(seed):
    from transformers import GPTNeoXForCausalLM

    from hmscale.teacher.flavors import neox_config

    torch.manual_seed(seed)
    return GPTNeoXForCausalLM(neox_config("pythia-nano", vocab_size=96)).eval()


def test_stage2_refuses_a_stage1_student_trained_against_another_teacher(tmp_path):
    from hmscale.train.engine import TrainingError
    from hmscale.train.stage1 import load_stage1_student, run_stage1
    from hmscale.train.stage2 import run_stage2

    cfg = _cfg("stage1.steps=2", "stage1.micro_batch_size=4", "stage1.warmup_steps=0")
    run_stage1(cfg, tmp_path, teacher=_teacher(0), source=ArraySource(_toks()))
    assert load_stage1_student(tmp_path, teacher=_teacher(0)) is not None  # the same teacher (another copy): taken
    with pytest.raises(TrainingError) as err:
        # `hmscale stage2` into stage 1's run directory, with a teacher pretrained again (other weights)
        run_stage2(cfg, tmp_path, teacher=_teacher(1), source=ArraySource(_toks()), export=False)
    msg = str(err.value)
    assert "\n" not in msg and "trained against teacher" in msg and "stage 1" in msg, msg
    assert isinstance(err.value, ValueError)  # (`hmscale eval`, which loads the student too, reports those in one line)
    assert not (tmp_path / "stage2" / "checkpoints").exists()  # refused before any training


# ---------------------------------------------------------------- DeepSpeed JSON


def test_a_nested_auto_in_the_deepspeed_json_is_one_line_naming_it(tmp_path):
    import json

    from hmscale.config import DS_CONFIG_DIR
    from hmscale.train.engine import OptimSpec, TrainingError, ds_config_for

    conf = json.loads((DS_CONFIG_DIR / "zero3.json").read_text())
    conf["optimizer"]["params"]["eps"] = "auto"
    conf["zero_optimization"]["stage3_prefetch_bucket_size"] = "auto"
    conf["train_batch_size"] = conf["gradient_accumulation_steps"] = "auto"  # (the engine fills these in)
    path = tmp_path / "hf_trainer_zero3.json"
    path.write_text(json.dumps(conf))
    spec = OptimSpec(lr=1e-3, micro_batch_size=2, zero_stage=3, ds_config=str(path))
    with pytest.raises(TrainingError) as err:
        ds_config_for(spec, dp_world=1)
    msg = str(err.value)
    assert "\n" not in msg and "hf_trainer_zero3.json" in msg, msg
    assert "optimizer.params.eps" in msg and "zero_optimization.stage3_prefetch_bucket_size" in msg, msg
    assert "train_batch_size" not in msg and "gradient_accumulation_steps" not in msg, msg


# ---------------------------------------------------------------- copies of the teacher


def test_one_process_run_loads_the_teacher_once(monkeypatch, tmp_path):
    import hmscale.teacher
    from ray_jobs.distill import run_distill

    loaded = []
    real = hmscale.teacher.get_teacher
    monkeypatch.setattr(hmscale.teacher, "get_teacher", lambda *a, **k: loaded.append(1) or real(*a, **k))
    cfg = build_config({}, [
        "teacher.flavor=pythia-nano", "tokenizer.vocab_size=300", "data.seq_len=32", "data.max_documents=12",
        "data.sequences_per_shard=8", "teacher.pretrain_steps=3", "budget.total_tokens=1024", "eval.max_sequences=2",
        "stage1.micro_batch_size=2", "stage2.micro_batch_size=2", "parallel.engine=local", "stage1.source=online",
        f"data.cache_dir={tmp_path / 'cache'}", f"cache.root={tmp_path / 'cache' / 'teacher'}",
        "stage1.transfer=mixer", "stage2.kd_source=online", "stage2.kd_weight=1", f"output_dir={tmp_path / 'run'}"])
    res = run_distill(cfg, log=lambda *a, **k: None)
    assert res["stage2"]["done"] and np.isfinite(res["stage2"]["final_loss"])
    assert len(loaded) == 1, f"the teacher was loaded {len(loaded)} times"


def _sgd_json(tmp_path):
    import json

    from hmscale.config import DS_CONFIG_DIR

    conf = json.loads((DS_CONFIG_DIR / "zero2.json").read_text())
    conf["optimizer"] = {"type": "SGD", "params": {"lr": 0.01, "momentum": 0.9}}
    conf["zero_allow_untested_optimizer"] = True  # (DeepSpeed's own condition for a ZeRO optimizer it has not tested)
    path = tmp_path / "zero2_sgd.json"
    path.write_text(json.dumps(conf))
    return str(path)


def test_a_non_adam_optimizer_in_the_json_trains_on_cpu_with_adam_auto(tmp_path, monkeypatch):
    from hmscale.train.engine import OptimSpec, TrainingError, ds_config_for, read_metrics

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    path = _sgd_json(tmp_path)
    conf = ds_config_for(OptimSpec(lr=1e-3, micro_batch_size=2, ds_config=path), dp_world=1)
    assert "torch_adam" not in conf["optimizer"]["params"], conf["optimizer"]
    with pytest.raises(TrainingError, match=r"parallel.adam=foreach: .*'sgd', not Adam/AdamW"):
        ds_config_for(OptimSpec(lr=1e-3, micro_batch_size=2, ds_config=path, adam="foreach"), dp_world=1)
    res = _stage2(_cfg(f"parallel.ds_config={path}", "stage2.steps=2"), tmp_path / "run")
    assert res["done"] and all(np.isfinite(res["losses"]))
    assert len(read_metrics(tmp_path / "run" / "stage2" / "metrics.jsonl")) == 2


# ---------------------------------------------------------------- validation


def test_no_validation_rows_means_no_eval_lines(tmp_path):
    from hmscale.train.engine import read_metrics
    from hmscale.train.stage2 import run_stage2

    data = types.SimpleNamespace(val_tokens=np.zeros((0, 32), dtype=np.int64))
    res = run_stage2(_cfg("stage2.eval_every=2"), tmp_path, data=data, student=_student(), source=ArraySource(_toks()),
                     export=False)
    assert res["done"] and "val_loss" not in res
    path = tmp_path / "stage2" / "metrics.jsonl"
    assert read_metrics(path, "eval") == [] and len(read_metrics(path)) == 6


def test_the_final_weights_are_validated_once(tmp_path, monkeypatch):
    import hmscale.train.stage2 as s2
    from hmscale.train.engine import read_metrics

    calls = []
    real = s2.validation_loss
    monkeypatch.setattr(s2, "validation_loss", lambda *a, **k: calls.append(1) or real(*a, **k))
    data = types.SimpleNamespace(val_tokens=_toks(n=5, seed=3))
    res = s2.run_stage2(_cfg("stage2.eval_every=2"), tmp_path, data=data, student=_student(),
                        source=ArraySource(_toks()), export=False)
    evals = read_metrics(tmp_path / "stage2" / "metrics.jsonl", "eval")
    assert [e["step"] for e in evals] == [1, 3, 5] and len(calls) == 3, (evals, len(calls))
    assert res["val_loss"] == evals[-1]["val_loss"]  # summary.json's figure is the last eval's
    # a stage resumed when finished (no step trained in this call) validates its weights for the summary
    calls.clear()
    again = s2.run_stage2(_cfg("stage2.eval_every=2"), tmp_path, data=data, student=_student(),
                          source=ArraySource(_toks()), export=False)
    assert len(calls) == 1 and again["val_loss"] == res["val_loss"]
