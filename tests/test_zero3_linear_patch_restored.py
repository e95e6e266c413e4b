"""A matrix of parallel and recipe settings on the local CPU engine (workers 1/2 x tp 1/2 x ZeRO 0-3 x
layer_parallel x transfer x stage-1 source x LoRA x trainable x KD source, a pairwise covering set of runs).

Every run finished with finite losses and perplexities, or was refused in one line by the config, but the teacher's
perplexity of one-worker ZeRO-3 runs was not the teacher's: 234.76573 where every other run (the same teacher, the
same rows) reported 234.76585. With one worker the training runs in the driver's process, and building a ZeRO-3
engine makes DeepSpeed replace ``torch.nn.functional.linear`` by its own ``zero3_linear_wrap`` for good ("This will
persist unless manually reset"): the evaluation after it ran every Linear of the teacher and both students through
DeepSpeed's function (another rounding), so the reported numbers depended on the ZeRO stage of the training, and an
evaluation redone later (``hmscale eval``, a rerun with other ``eval.*``) gave other ones."""

import torch


def test_in_process_training_leaves_torch_linear_as_it_found_it(tmp_path, monkeypatch):
    from hmscale.config import build_config
    from ray_jobs import distill

    original = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", original)  # restored after the test whatever happens

    def fake_train_func(config):
        # what deepspeed.initialize does for ZeRO-3 (Init(module=...) -> _enable_mem_efficient_linear)
        from deepspeed.runtime.zero.linear import zero3_linear_wrap

        torch.nn.functional.linear = zero3_linear_wrap
        return {}

    monkeypatch.setattr(distill, "train_func", fake_train_func)
    cfg = build_config({}, ["teacher.flavor=pythia-nano", "parallel.engine=local", "parallel.num_workers=1",
                            "parallel.zero_stage=3", f"output_dir={tmp_path}/run", f"data.cache_dir={tmp_path}/d"])
    distill.run_distill(cfg, prepared={"cache_dir": None}, log=lambda *a, **k: None)
    assert torch.nn.functional.linear is original


def test_a_rerun_of_a_trained_run_builds_no_teacher_cache(tmp_path, monkeypatch):
    """A rerun of a finished run (to print its results, or with other eval.* settings, which redo only the evaluation)
    rebuilt the teacher cache: every shard hashed again when the cache was there (hours for a multi-TB cache), the whole
    teacher forward again when it had been removed (`hmscale cache rm`), though nothing trains and the evaluation
    reads no cache."""
    import json

    import hmscale.recipe as recipe
    import hmscale.teacher.cache as cache_pkg
    from hmscale.config import build_config, save_resolved
    from hmscale.run_identity import eval_hash, training_hash

    monkeypatch.setenv("HMSCALE_NO_PROGRESS", "1")
    run = tmp_path / "run"
    cfg = build_config({}, ["teacher.flavor=pythia-nano", "teacher.pretrain_steps=2", "tokenizer.vocab_size=300",
                            "data.seq_len=32", "data.sequences_per_shard=4", "data.max_documents=8",
                            f"data.cache_dir={tmp_path}/d", f"cache.root={tmp_path}/c", "budget.total_tokens=512",
                            "cache.capture.topk=4", "stage2.kd_weight=0.5", "parallel.engine=local",
                            f"output_dir={run}"]).with_absolute_paths()
    run.mkdir()
    save_resolved(cfg, run)
    stages = {"prepare": {"seconds": 1.0}, "stage1": {"seconds": 1.0}, "stage2": {"seconds": 1.0},
              "distill": {"seconds": 2.0}}
    (run / "results.json").write_text(json.dumps({"config_hash": training_hash(cfg), "stages": {
        **stages, "eval": {"seconds": 0.5, "eval_hash": eval_hash(cfg)}}}))

    def no_cache(*a, **k):
        raise AssertionError("the teacher cache was built for a run whose training is finished")

    monkeypatch.setattr(cache_pkg, "build_cache", no_cache)
    monkeypatch.setattr(recipe, "write_report", lambda *a, **k: None)
    recipe.run_recipe(cfg, log=lambda *a, **k: None)
