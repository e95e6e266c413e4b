"""Running on a real, joined Ray cluster (`ray start --head`, `hmscale run -s parallel.ray_address=...`,
`hmscale submit`, `hmscale cache --engine ray`): the fixes it needed, each with a test that fails without it.

On a joined cluster every Ray worker starts in the directory its node's `ray start` ran in, not the driver's, and
with the environment of that `ray start`, not the driver's."""

import os

import pytest

from hmscale.config import build_config

TINY = [
    "teacher.flavor=pythia-nano", "tokenizer.vocab_size=300", "data.seq_len=32", "data.max_documents=12",
    "data.sequences_per_shard=8", "teacher.pretrain_steps=3", "budget.total_tokens=512", "eval.max_sequences=2",
    "stage1.micro_batch_size=2", "stage2.micro_batch_size=2", "stage2.warmup_steps=1",
]


def _cwd():
    return os.getcwd()


@pytest.mark.ray
def test_ray_cache_with_a_relative_data_cache_dir_from_another_folder(ray_cluster, tmp_path, monkeypatch):
    # `cd elsewhere && hmscale cache --engine ray -s parallel.ray_address=HEAD:6379 -s data.cache_dir=dc ...`: the
    # plan reached the actors as its stream's relative path, opened in the actors' own working directory (the
    # cluster's): every actor died in its constructor (FileNotFoundError) until cache.max_retries ran out
    from hmscale.teacher.cache import build_cache, verify_cache

    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)  # (the cluster was started elsewhere: its workers' directory is not this one)
    assert os.getcwd() != ray_cluster.get(ray_cluster.remote(num_cpus=0)(_cwd).remote())
    cfg = build_config({}, TINY + ["data.cache_dir=dc", "cache.root=tc", "cache.workers=1", "cache.max_retries=1"])
    path = build_cache(cfg, engine="ray", log=lambda *a, **k: None)
    assert (work / path).resolve().parent == (work / "tc").resolve()
    assert verify_cache(work / path).ok


@pytest.mark.ray
def test_actors_that_die_in_their_constructor_say_why_and_no_restart_past_the_limit(ray_cluster, tmp_path,
                                                                                    monkeypatch):
    # the last restart's line said "restarting the worker (2/1)" and the error only "see the worker logs"
    from hmscale.data import prepare_data
    from hmscale.teacher import get_teacher
    from hmscale.teacher.cache import CacheError, build_cache

    monkeypatch.chdir(tmp_path)
    cfg = build_config({}, TINY + ["data.cache_dir=dc", "cache.root=tc", "cache.workers=1", "cache.max_retries=1"])
    data = prepare_data(cfg, log=lambda *a, **k: None)
    teacher = get_teacher(cfg, data, log=lambda *a, **k: None)
    data.plan.stream_path = str(tmp_path / "gone" / "train")  # (what the actors open: missing there)
    logs = []
    with pytest.raises(CacheError) as err:
        build_cache(cfg, data, teacher, engine="ray", log=logs.append)
    msg = str(err.value)
    assert "died 2 times" in msg and "No such file or directory" in msg and "gone" in msg, msg
    assert "\n" not in msg
    restarts = [line for line in logs if "restarting the worker" in line]
    assert restarts and all(line.endswith("(1/1)") for line in restarts), logs


@pytest.mark.ray
def test_a_shard_that_keeps_failing_announces_no_retry_past_the_limit(ray_cluster, tmp_path, monkeypatch):
    # its last failure was logged "retry 2/1", and then the build stopped
    from hmscale.data import prepare_data
    from hmscale.teacher import get_teacher
    from hmscale.teacher.cache import CacheError, build_cache

    monkeypatch.chdir(tmp_path)
    cfg = build_config({}, TINY + ["data.cache_dir=dc", "cache.root=tc", "cache.workers=1", "cache.max_retries=1"])
    data = prepare_data(cfg, log=lambda *a, **k: None)
    teacher = get_teacher(cfg, data, log=lambda *a, **k: None)

    def capture(teacher, input_ids, layers=None):  # (nested: shipped to the actor by value)
        raise ValueError("capture refused")
    logs = []
    with pytest.raises(CacheError, match="shard-000000.tar failed 2 times; last error: .*capture refused"):
        build_cache(cfg, data, teacher, engine="ray", log=logs.append, capture_fn=capture)
    retries = [line for line in logs if "; retry " in line]
    assert retries and all(line.endswith("retry 1/1") for line in retries), logs


# HMSCALE_NO_PROGRESS=1 (README: batch logs) drew every worker's bars all the same on a joined cluster and in a submitted
# job: the workers have their `ray start`'s environment, the job the cluster's, and neither had this shell's switch

_QUIET = ("HMSCALE_NO_PROGRESS", "HF_HUB_DISABLE_PROGRESS_BARS", "HF_DATASETS_DISABLE_PROGRESS_BARS")


@pytest.fixture
def quiet_restored(monkeypatch):
    for k in _QUIET + ("RAY_JOB_CONFIG_JSON_ENV_VAR",):
        monkeypatch.delenv(k, raising=False)  # (monkeypatch puts back what was there, and removes what was not)
    yield
    for k in _QUIET:  # (what the test set; monkeypatch then puts back the values from before)
        os.environ.pop(k, None)
    import datasets
    from transformers.utils import logging as hf_logging

    hf_logging.enable_progress_bar()
    datasets.enable_progress_bars()


def test_a_joined_cluster_gets_the_progress_switches_in_the_jobs_runtime_env(monkeypatch, quiet_restored):
    import ray

    from hmscale import ray_cluster

    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    monkeypatch.setattr(ray_cluster, "_nothing_listens", lambda address: None)  # (no real TCP try of 10.0.0.1)
    ray_cluster.connect("10.0.0.1:6379", log=lambda *a, **k: None)
    assert "runtime_env" not in calls[-1]  # (nothing to forward: the cluster's own environment as before)
    monkeypatch.setenv("HMSCALE_NO_PROGRESS", "1")
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    ray_cluster.connect("10.0.0.1:6379", log=lambda *a, **k: None)
    assert calls[-1]["runtime_env"] == {"env_vars": {"HMSCALE_NO_PROGRESS": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}}
    # a submitted job's driver: the job's runtime env has them already, and Ray refuses a key set in both
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}")
    ray_cluster.connect("10.0.0.1:6379", log=lambda *a, **k: None)
    assert "runtime_env" not in calls[-1]


def test_submit_takes_the_progress_switch_into_the_jobs_environment(monkeypatch, quiet_restored):
    from hmscale.submit import job_runtime_env

    cfg = build_config({}, ["output_dir=/tmp/x", "data.cache_dir=/tmp/c", "cache.root=/tmp/t"])
    assert "HMSCALE_NO_PROGRESS" not in job_runtime_env(cfg)["env_vars"]
    monkeypatch.setenv("HMSCALE_NO_PROGRESS", "1")
    assert job_runtime_env(cfg)["env_vars"]["HMSCALE_NO_PROGRESS"] == "1"


def test_the_recipe_job_quiets_the_hubs_bars_as_hmscale_run_does(monkeypatch, quiet_restored):
    import hmscale.recipe
    from ray_jobs import run_recipe

    def refuse(cfg, **kw):
        raise hmscale.recipe.RecipeError("stop here")
    monkeypatch.setattr(hmscale.recipe, "run_recipe", refuse)
    monkeypatch.setenv("HMSCALE_NO_PROGRESS", "1")
    assert run_recipe.main(["-s", "output_dir=/tmp/x"]) == 2
    assert os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS") == "1"  # ("Loading weights", "Writing model shards")


def test_ray_train_workers_print_each_line_once(monkeypatch, tmp_path):
    # on Ray 2.60 every line a Ray Train worker printed reached the log twice (Ray Train's print patch writes it and
    # logs it again when sys.stdout is wrapped, as in every Ray worker): "[distill] resuming stage2 from ..." twice
    import ray.train.torch

    from ray_jobs import distill

    monkeypatch.delenv("RAY_TRAIN_ENABLE_PRINT_PATCH", raising=False)
    seen = {}

    class Trainer:
        def __init__(self, *a, **kw):
            seen["patch"] = os.environ.get("RAY_TRAIN_ENABLE_PRINT_PATCH")  # (what Ray Train hands its workers)
            raise RuntimeError("stop here")
    monkeypatch.setattr(ray.train.torch, "TorchTrainer", Trainer)
    monkeypatch.setattr("hmscale.ray_cluster.connect", lambda *a, **k: False)
    monkeypatch.setattr(distill, "_check_ray_workers", lambda *a, **k: None)
    cfg = build_config({}, TINY + ["parallel.engine=ray", "parallel.num_workers=1"])
    with pytest.raises(RuntimeError, match="stop here"):
        distill._run_ray(cfg, {}, tmp_path, log=lambda *a, **k: None)
    assert seen["patch"] == "0"
    # an operator's own setting wins
    monkeypatch.setenv("RAY_TRAIN_ENABLE_PRINT_PATCH", "1")
    with pytest.raises(RuntimeError, match="stop here"):
        distill._run_ray(cfg, {}, tmp_path, log=lambda *a, **k: None)
    assert seen["patch"] == "1"


def test_a_run_that_cannot_join_the_cluster_leaves_no_config_in_its_output_dir(tmp_path):
    # `hmscale run -s parallel.ray_address=http://HEAD:8265` (the dashboard's URL, a typo) stopped in one line but had
    # written config.yaml: the corrected rerun with another setting was then refused as "a run of a different config"
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = str(repo)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "hmscale.cli", "run"]
    for o in TINY + ["parallel.engine=ray", "parallel.ray_address=http://127.0.0.1:1", f"output_dir={out}",
                     f"data.cache_dir={tmp_path / 'dc'}", f"cache.root={tmp_path / 'tc'}"]:
        cmd += ["-s", o]
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "cannot join the Ray cluster there" in r.stderr, r.stderr[-2000:]
    assert not (out / "config.yaml").exists()


def test_submit_from_a_folder_that_is_not_the_checkouts_root_says_which_code_runs(monkeypatch, tmp_path):
    # `cd configs && hmscale submit ...` uploaded configs/ alone: the job quietly ran the hmscale installed on the nodes
    import ray.job_submission

    from hmscale.submit import submit

    class Client:
        def __init__(self, address, headers=None):
            pass

        def submit_job(self, **kw):
            return "raysubmit_TEST"
    monkeypatch.setattr(ray.job_submission, "JobSubmissionClient", Client)
    monkeypatch.setenv("RAY_AUTH_TOKEN", "secret")
    cfg = build_config({}, ["output_dir=/tmp/x", "data.cache_dir=/tmp/c", "cache.root=/tmp/t"])
    lines = []
    submit(cfg, "http://127.0.0.1:8265", working_dir=str(tmp_path), follow=False, log=lines.append)
    assert any("is not the root of an hmscale checkout" in line and str(tmp_path) in line for line in lines), lines
    lines.clear()
    checkout = tmp_path / "checkout"
    (checkout / "ray_jobs").mkdir(parents=True)
    (checkout / "ray_jobs" / "run_recipe.py").write_text("")
    submit(cfg, "http://127.0.0.1:8265", working_dir=str(checkout), follow=False, log=lines.append)
    assert not any("checkout" in line for line in lines), lines
