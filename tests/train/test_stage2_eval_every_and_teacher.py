"""Stage 2's eval_every in a run's key, and the teacher let go when stage 2 does not run it (CPU):

- stage2.eval_every (how often stage 2 validates: lines of metrics.jsonl, no weight) was part of a run's identity: a
  rerun with another eval_every refused the run as a different config; it is held at its default in the key, so every
  run keyed at the default keeps its key;
- the frozen teacher stayed resident (on the GPU with parallel.use_gpu) through stage 2 when stage 2 never runs it
  (KD from the cache's top-k, or no KD term): run_stage2 lets go of it (and of the stage-1 student around it) once the
  model is built, before the engine, and the recipe holds it only while a stage runs it (reloaded for the eval);
"""

import json
import os

import pytest

from hmscale.config import build_config, save_resolved

os.environ.setdefault("HMSCALE_NO_PROGRESS", "1")


# ---------------------------------------------------------------- stage2.eval_every is not the run


def _key_as_before(cfg):
    """A config's key as hmscale computed it before eval_every left the identity (every setting as given)."""
    from hmscale.data.cachedir import stable_hash
    from hmscale.run_identity import NOT_IDENTITY, PLACEMENT

    tree = cfg.model_dump(mode="json")
    old = {k: v for k, v in tree.items() if k not in NOT_IDENTITY}
    for dotted in PLACEMENT:
        old[dotted.split(".")[0]].pop(dotted.split(".")[1])
    return stable_hash(old)


@pytest.mark.parametrize("overrides", [[], ["stage2.steps=3", "stage1.lr=0.01"]])
def test_the_key_of_a_config_at_the_default_eval_every_is_the_one_runs_were_keyed_with(overrides):
    from hmscale.run_identity import training_hash

    cfg = build_config({}, overrides)
    assert training_hash(cfg) == _key_as_before(cfg)  # every run at the default keeps its key
    assert training_hash(build_config({}, [*overrides, "stage2.eval_every=7"])) == training_hash(cfg)
    assert training_hash(build_config({}, [*overrides, "stage2.steps=5"])) != training_hash(cfg)  # (training is)


def test_a_rerun_with_another_stage2_eval_every_resumes_the_run(tmp_path):
    from hmscale.recipe import _load_results
    from hmscale.run_identity import saved_config_mismatch, training_hash

    made = build_config({}, [f"output_dir={tmp_path}"]).with_absolute_paths()
    save_resolved(made, tmp_path)
    rerun = build_config({}, [f"output_dir={tmp_path}", "stage2.eval_every=5"]).with_absolute_paths()
    assert saved_config_mismatch(tmp_path, rerun) is None  # the stage commands' test (no results.json)
    (tmp_path / "results.json").write_text(json.dumps({"config_hash": training_hash(made),
                                                       "stages": {"stage1": {"seconds": 1.0}}}))
    assert "stage1" in _load_results(tmp_path, rerun)["stages"]  # the recipe's: resumed, not refused
    with pytest.raises(Exception, match=r"\(stage2.lr: 0.001 -> 0.0003\)"):  # a training setting still refuses
        _load_results(tmp_path, build_config({}, [f"output_dir={tmp_path}", "stage2.eval_every=5", "stage2.lr=3e-4"])
                      .with_absolute_paths())


def test_a_run_keyed_with_another_eval_every_before_is_adopted(tmp_path):
    """A run keyed before (eval_every other than the default, in its key) resumes and is re-keyed."""
    from hmscale.recipe import _load_results
    from hmscale.run_identity import training_hash

    made = build_config({}, [f"output_dir={tmp_path}", "stage2.eval_every=1000"]).with_absolute_paths()
    save_resolved(made, tmp_path)
    old_key = _key_as_before(made)  # (how it was keyed: eval_every as given)
    assert old_key != training_hash(made)
    (tmp_path / "results.json").write_text(json.dumps({"config_hash": old_key, "stages": {"stage1": {}}}))
    res = _load_results(tmp_path, build_config({}, [f"output_dir={tmp_path}", "stage2.eval_every=20"])
                        .with_absolute_paths())
    assert "stage1" in res["stages"] and res["config_hash"] == training_hash(made)


# ---------------------------------------------------------------- the teacher during stage 2


def _teacher(vocab=96):
    import torch
    from transformers import GPTNeoXForCausalLM

    from hmscale.teacher.flavors import neox_config

    torch.manual_seed(0)
    return GPTNeoXForCausalLM(neox_config("pythia-nano", vocab_size=vocab)).eval()


def _teacher_alive_at_each_step(tmp_path, *extra):
    """Stage 2 from a stage-1 student handed over (no other reference): whether the teacher is alive at each step."""
    import gc
    import weakref

    import numpy as np

    from hmscale.models.convert import to_hedgehog
    from hmscale.train.data import ArraySource
    from hmscale.train.stage2 import run_stage2

    teacher = _teacher()
    ref = weakref.ref(teacher)
    held = [to_hedgehog(teacher)]
    del teacher
    alive = []

    def at_step(step):
        gc.collect()
        alive.append(ref() is not None)

    cfg = build_config({}, ["stage2.steps=2", "stage2.micro_batch_size=2", "stage2.warmup_steps=0",
                            "parallel.checkpoint_every=100", *extra])
    rng = np.random.default_rng(1)
    rows = rng.integers(0, 96, size=(8, 16))
    topk_ids = rng.integers(0, 96, size=(8, 16, 4))  # (the cache's top-k, for cached KD)
    topk_lp = np.log(np.full((8, 16, 4), 0.25, dtype=np.float32))
    res = run_stage2(cfg, tmp_path, student=held.pop(), source=ArraySource(rows, topk_ids, topk_lp), export=False,
                     fault_hook=at_step)
    assert res["done"] and np.isfinite(res["final_loss"])
    return alive


@pytest.mark.parametrize("kd", [["stage2.kd_weight=0"], ["stage2.kd_weight=0.5", "stage2.kd_source=cache",
                                                           "cache.capture.topk=4"]])
def test_stage2_without_a_live_teacher_lets_it_go_before_training(tmp_path, kd):
    assert _teacher_alive_at_each_step(tmp_path, *kd) == [False, False]


@pytest.mark.parametrize("live", [["stage2.kd_weight=0.5", "stage2.kd_source=online"], ["stage2.hidden_weight=0.5"]])
def test_stage2_with_online_kd_or_hidden_alignment_keeps_the_teacher(tmp_path, live):
    assert _teacher_alive_at_each_step(tmp_path, *live) == [True, True]


class _Stop(Exception):
    pass


@pytest.mark.parametrize("live", [False, True])
def test_the_recipe_holds_no_teacher_while_stage2_runs_none(tmp_path, monkeypatch, live):
    """The recipe kept its own reference to the teacher (for the eval) through the distillation: the stages' runner
    could not let it go. It now hands it over when stage 2 runs no live teacher (the eval loads it again)."""
    import gc
    import types
    import weakref

    import numpy as np

    import ray_jobs.distill as distill
    from hmscale.recipe import run_recipe
    from hmscale.train.common import stage2_uses_teacher

    refs, alive = [], []

    def fake_prepare(cfg, log=print, stages=(), check_data=None):
        teacher = _teacher()
        refs.append(weakref.ref(teacher))
        data = types.SimpleNamespace(plan=types.SimpleNamespace(total_tokens=64), val_tokens=np.zeros((2, 8)),
                                     vocab_size=96)
        return {"data": data, "teacher": teacher, "cache_dir": None}

    def fake_run_distill(cfg, run_dir, log=print, prepared=None, **kw):
        # as the stages' runner does once stage 2's model is built: its own reference goes when no live teacher
        if not stage2_uses_teacher(cfg.stage2):
            prepared.pop("teacher")
        gc.collect()
        alive.append(refs[0]() is not None)
        raise _Stop

    monkeypatch.setattr(distill, "prepare", fake_prepare)
    monkeypatch.setattr(distill, "run_distill", fake_run_distill)
    kd = ["stage2.kd_weight=0.5", "stage2.kd_source=online"] if live else ["stage2.kd_weight=0"]
    cfg = build_config({}, [f"output_dir={tmp_path / 'run'}", "parallel.engine=local", *kd])
    with pytest.raises(_Stop):
        run_recipe(cfg, log=lambda *a, **k: None)
    assert alive == [live]


# ---------------------------------------------------------------- stage-command runs and relative inputs


def _corpus(folder, word):
    folder.mkdir(parents=True)
    lines = [json.dumps({"text": f"def {word}_{i}(x): return x + {i} * {word}_{i + 1}"}) for i in range(60)]
    (folder / "a.jsonl").write_text("\n".join(lines) + "\n")


def _stage_args(tmp_path, paths, *extra):
    sets = ["data.source=files", f"data.paths={paths}", "teacher.flavor=pythia-nano", "tokenizer.vocab_size=300",
            "teacher.pretrain_steps=2", "data.seq_len=32", "data.sequences_per_shard=8", "budget.total_tokens=1024",
            "stage1.source=online", "stage1.steps=1", "stage2.steps=1", "stage1.micro_batch_size=2", "stage2.micro_batch_size=2",
            "parallel.engine=local", f"data.cache_dir={tmp_path / 'cache'}", f"cache.root={tmp_path / 'cache' / 't'}",
            f"output_dir={tmp_path / 'proj' / 'runs' / 'r'}", *extra]
    return [a for s in sets for a in ("-s", s)]


def test_a_stage_command_run_is_continued_from_another_folder_on_the_files_it_read(tmp_path, monkeypatch, capsys):
    """`hmscale stage1` keeps no results.json (the recipe's inputs_dir): a later command from another folder read the
    run's relative data.paths from that folder, so `hmscale stage2` naming the run's own files (absolutely, or
    relative to where it is run) was refused as another run ("data.paths: ['corpus'] -> [...]")."""
    from hmscale.cli import main
    from hmscale.recipe import run_inputs_dir
    from hmscale.run_identity import saved_config_mismatch

    proj, elsewhere = tmp_path / "proj", tmp_path / "elsewhere"
    _corpus(proj / "corpus", "alpha")
    elsewhere.mkdir()
    run_dir = proj / "runs" / "r"
    monkeypatch.chdir(proj)
    assert main(["stage1", *_stage_args(tmp_path, "[corpus]")]) == 0, capsys.readouterr().err
    assert not (run_dir / "results.json").exists()
    capsys.readouterr()

    monkeypatch.chdir(elsewhere)
    assert run_inputs_dir(run_dir) == str(proj)  # where the run read `corpus`
    from hmscale.config import load_config

    for paths in ("[../proj/corpus]", f"[{proj / 'corpus'}]"):  # the run's own files, named from here
        same = load_config(None, _stage_args(tmp_path, paths)[1::2]).with_absolute_paths()
        assert saved_config_mismatch(run_dir, same) is None, paths
    _corpus(elsewhere / "corpus", "omega")
    other = load_config(None, _stage_args(tmp_path, f"[{elsewhere / 'corpus'}]")[1::2]).with_absolute_paths()
    assert "data.paths" in saved_config_mismatch(run_dir, other)  # (other files: still another run)
    assert main(["stage2", *_stage_args(tmp_path, f"[{proj / 'corpus'}]")]) == 0, \
        capsys.readouterr().err
    assert json.loads((run_dir / "stage2" / "summary.json").read_text())["done"]


def test_the_stages_runner_lets_the_teacher_go_in_stage2_of_a_real_run(tmp_path, monkeypatch):
    """ray_jobs.distill.train_func (one process, the driver's teacher) held the teacher and the stage-1 student in its
    own locals and in the prepared inputs through stage 2: run_stage2 letting go of its references freed nothing."""
    import gc
    import weakref

    import ray_jobs.distill as distill
    import hmscale.train.stage2 as stage2

    refs, alive = [], []
    prepare = distill.prepare

    def recording_prepare(*a, **k):
        prep = prepare(*a, **k)
        refs.append(weakref.ref(prep["teacher"]))
        return prep

    freeze = stage2.freeze_embeddings

    def checking_freeze(model):  # (run_stage2 calls it right after the teacher is let go, before the engine)
        gc.collect()
        alive.append(refs[0]() is not None)
        return freeze(model)

    monkeypatch.setattr(distill, "prepare", recording_prepare)
    monkeypatch.setattr(stage2, "freeze_embeddings", checking_freeze)
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.jsonl").write_text("".join(json.dumps({"text": f"def f_{i}(x): return x + {i}"}) + "\n"
                                                         for i in range(400)))
    for kd, want in ((["stage2.kd_weight=0"], [False]), (["stage2.kd_weight=0.5", "stage2.kd_source=online"], [True])):
        alive.clear()
        refs.clear()
        out = tmp_path / f"run{len(kd)}"
        cfg = build_config({}, ["data.source=files", f"data.paths=[{tmp_path / 'corpus'}]", "teacher.flavor=pythia-nano",
                                "tokenizer.vocab_size=300", "teacher.pretrain_steps=2", "data.seq_len=32",
                                "data.sequences_per_shard=8", "budget.total_tokens=1024", "stage1.source=online",
                                "stage1.steps=1", "stage2.steps=1", "stage1.micro_batch_size=2",
                                "stage2.micro_batch_size=2", "parallel.engine=local",
                                f"data.cache_dir={tmp_path / 'cache'}", f"cache.root={tmp_path / 'cache' / 't'}",
                                f"output_dir={out}", *kd])
        distill.run_distill(cfg, out, log=lambda *a, **k: None)
        assert alive == want, kd
