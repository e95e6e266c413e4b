"""`hmscale submit` against a real local head node (the suite's embedded Ray cluster, with the dashboard and its job API)."""

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hmscale.config import build_config
from hmscale.submit import SubmitError, decode_config, encode_config, submit

REPO = Path(__file__).resolve().parents[2]
TINY = [
    "teacher.flavor=pythia-nano", "tokenizer.vocab_size=300", "data.seq_len=32", "data.max_documents=12",
    "data.sequences_per_shard=8", "teacher.pretrain_steps=3", "budget.total_tokens=1024", "eval.max_sequences=2",
    "stage1.micro_batch_size=2", "stage2.micro_batch_size=2", "stage2.warmup_steps=1", "parallel.engine=local",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_config_travels_through_the_job_environment():
    cfg = build_config(overrides=["seed=5", "stage2.lr=3e-4"])
    assert build_config(decode_config(encode_config(cfg))) == cfg


def test_remote_address_without_token_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    with pytest.raises(SubmitError, match="token"):
        submit(build_config(), "http://10.1.2.3:8265", follow=False)


def test_an_address_where_no_cluster_listens_is_one_line():
    cfg = build_config({}, TINY)
    with pytest.raises(SubmitError, match=r"cannot reach a Ray cluster's job API there .*; check the dashboard address"):
        submit(cfg, f"http://127.0.0.1:{_free_port()}", follow=False, log=lambda m: None)


def test_install_asks_ray_for_the_dependencies_the_cluster_lacks():
    from hmscale.submit import job_runtime_env

    cfg = build_config()
    plain = job_runtime_env(cfg, str(REPO))
    assert "pip" not in plain and plain["env_vars"]["HMSCALE_CONFIG_B64"] == encode_config(cfg)
    pip = job_runtime_env(cfg, str(REPO), install=True)["pip"]["packages"]
    names = {p.split(">")[0].split("<")[0].split("=")[0].split("[")[0] for p in pip}
    assert {"deepspeed", "transformers", "webdataset", "pydantic"} <= names
    assert not names & {"torch", "triton", "ray"}  # the node's CUDA torch and the cluster's own Ray stay
    with pytest.raises(SubmitError, match="pyproject.toml not found"):
        job_runtime_env(cfg, "/nonexistent", install=True)


@pytest.mark.parametrize("absent,advice", [(("deepspeed", "pyyaml"), "hmscale submit --install"),
                                           (("torch",), "every node's image")])
def test_a_node_without_the_dependencies_fails_in_one_line(monkeypatch, capsys, absent, advice):
    from importlib import metadata

    from ray_jobs import run_recipe

    real = metadata.distribution

    def distribution(name):
        if name in absent:
            raise metadata.PackageNotFoundError(name)
        return real(name)
    monkeypatch.setattr(metadata, "distribution", distribution)
    assert run_recipe.main([]) == 2
    err = capsys.readouterr().err
    assert f"lacks {', '.join(absent)}" in err and advice in err and len(err.splitlines()) == 1


class _FakeClient:
    """ray.job_submission.JobSubmissionClient's surface that `submit` uses, recording the job it is sent."""

    jobs: list = []
    fail_init = fail_submit = fail_status = None

    def __init__(self, address, headers=None):
        if _FakeClient.fail_init is not None:
            raise _FakeClient.fail_init
        self.address, self.headers = address, headers

    def submit_job(self, **kw):
        if _FakeClient.fail_submit is not None:
            raise _FakeClient.fail_submit
        _FakeClient.jobs.append(kw)
        return "raysubmit_TEST"

    log_chunks = ["done\n"]
    statuses: list = []  # the statuses get_job_status returns in turn, SUCCEEDED once they run out

    def get_job_status(self, job_id):
        if _FakeClient.fail_status is not None:
            raise _FakeClient.fail_status
        from ray.job_submission import JobStatus

        return JobStatus(_FakeClient.statuses.pop(0)) if _FakeClient.statuses else JobStatus.SUCCEEDED

    async def tail_job_logs(self, job_id):
        for chunk in _FakeClient.log_chunks:
            if isinstance(chunk, BaseException):
                raise chunk
            yield chunk


@pytest.fixture
def fake_client(monkeypatch, tmp_path):
    import ray.job_submission

    monkeypatch.setattr(ray.job_submission, "JobSubmissionClient", _FakeClient)
    monkeypatch.setattr(_FakeClient, "jobs", [])
    monkeypatch.setattr(_FakeClient, "log_chunks", ["done\n"])
    monkeypatch.setattr(_FakeClient, "statuses", [])
    for name in ("fail_init", "fail_submit", "fail_status"):
        monkeypatch.setattr(_FakeClient, name, None)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    monkeypatch.setenv("RAY_AUTH_TOKEN", "secret")
    return _FakeClient


def _sent_config(job) -> dict:
    return decode_config(job["runtime_env"]["env_vars"]["HMSCALE_CONFIG_B64"])


def test_relative_directories_land_in_the_submitting_checkout_on_a_local_cluster(fake_client, tmp_path, monkeypatch):
    # the job runs in Ray's temporary copy of the working directory: a relative output_dir would put the run (and a
    # relative cache root its caches) there, where Ray garbage-collects it and a second submit never finds it
    monkeypatch.chdir(tmp_path)  # `hmscale submit` run in the checkout it uploads
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("text")
    lines = []
    cfg = build_config({}, ["data.source=files", "data.paths=[corpus/*.txt]"])
    submit(cfg, "http://127.0.0.1:8265", follow=False, log=lines.append)
    sent = _sent_config(fake_client.jobs[0])
    assert sent["output_dir"] == str(tmp_path / "runs" / "demo")
    assert sent["data"]["cache_dir"] == str(tmp_path / ".cache" / "hmscale")
    assert sent["cache"]["root"] == str(tmp_path / ".cache" / "hmscale" / "teacher")
    assert sent["data"]["paths"] == [str(tmp_path / "corpus" / "*.txt")]
    assert fake_client.jobs[0]["metadata"]["hmscale_run"] == str(tmp_path / "runs" / "demo")
    assert f"output_dir={tmp_path / 'runs' / 'demo'}" in lines[0]
    # the run's identity is unchanged: a later `hmscale run` of the same config in that checkout resumes it
    assert build_config(sent).hash("stage2", "stage1", "teacher") == cfg.hash("stage2", "stage1", "teacher")


def test_relative_directories_are_refused_for_a_remote_cluster(fake_client):
    with pytest.raises(SubmitError, match=r"output_dir='runs/demo', data.cache_dir='.cache/hmscale', "
                                          r"cache.root='.cache/hmscale/teacher' relative: .*temporary copy") as err:
        submit(build_config(), "http://10.1.2.3:8265", follow=False, log=lambda m: None)
    assert "\n" not in str(err.value) and "-s output_dir=/shared/" in str(err.value)
    assert fake_client.jobs == []
    shared = ["output_dir=/mnt/shared/runs/x", "data.cache_dir=~/hmscale-data", "cache.root=/mnt/shared/teacher"]
    submit(build_config({}, shared), "http://10.1.2.3:8265", follow=False, log=lambda m: None)
    sent = _sent_config(fake_client.jobs[0])  # absolute (and ~, the cluster user's home) paths travel as given
    assert (sent["output_dir"], sent["data"]["cache_dir"]) == ("/mnt/shared/runs/x", "~/hmscale-data")


@pytest.mark.parametrize("where", ["fail_init", "fail_submit"])
def test_a_wrong_token_is_one_line(fake_client, tmp_path, where):
    from ray.exceptions import AuthenticationError

    setattr(fake_client, where, AuthenticationError(
        "Authentication failed: Forbidden: Invalid authentication token\n\nToken authentication is enabled but ..."))
    token = tmp_path / "tok"
    token.write_text("wrong\n")
    with pytest.raises(SubmitError, match=rf"refused --token-file {token} as its auth token; `ray get-auth-token` "
                                          "on its head prints the right one") as err:
        submit(build_config({}, ["output_dir=/tmp/x", "data.cache_dir=/tmp/c", "cache.root=/tmp/t"]),
               "http://10.1.2.3:8265", token_file=str(token), follow=False, log=lambda m: None)
    assert "\n" not in str(err.value)


def test_no_follow_and_an_interrupted_follow_say_how_to_reach_the_job(fake_client):
    lines = []
    cfg = build_config({}, ["output_dir=/tmp/x", "data.cache_dir=/tmp/c", "cache.root=/tmp/t"])
    assert submit(cfg, "10.1.2.3:8265", follow=False, log=lines.append) == "PENDING"
    assert "ray job logs -f raysubmit_TEST --address http://10.1.2.3:8265" in lines[-1]
    assert "ray job stop raysubmit_TEST --address http://10.1.2.3:8265" in lines[-1]
    fake_client.fail_status = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt):
        submit(cfg, "10.1.2.3:8265", log=lines.append)
    assert "job raysubmit_TEST keeps running on the cluster" in lines[-1] and "ray job stop raysubmit_TEST" in lines[-1]
    fake_client.fail_status = ConnectionError("Failed to connect to Ray at address: http://10.1.2.3:8265.\nmore")
    with pytest.raises(SubmitError, match=r"lost the job's logs \(Failed to connect.*\); job raysubmit_TEST may still "
                                          r"be running: follow it with") as err:
        submit(cfg, "10.1.2.3:8265", log=lines.append)
    assert "\n" not in str(err.value)


def test_follow_streams_each_line_once_and_a_dropped_stream_is_one_line(fake_client):
    # the log is streamed (tail_job_logs), not re-read whole every poll
    cfg = build_config({}, ["output_dir=/tmp/x", "data.cache_dir=/tmp/c", "cache.root=/tmp/t"])
    fake_client.log_chunks = ["step 1\n", "step 2\n", "step 3\n"]
    fake_client.statuses = ["RUNNING", "RUNNING"]
    lines = []
    assert submit(cfg, "10.1.2.3:8265", log=lines.append) == "SUCCEEDED"
    assert lines[1:] == ["step 1", "step 2", "step 3", "[submit] job raysubmit_TEST: SUCCEEDED"]
    fake_client.log_chunks = ["step 1\n", RuntimeError("Connection closed unexpectedly.\nmore")]
    fake_client.statuses = ["RUNNING"] * 5
    with pytest.raises(SubmitError, match=r"lost the job's logs \(Connection closed unexpectedly.\); job raysubmit_TEST "
                                          r"may still be running") as err:
        submit(cfg, "10.1.2.3:8265", log=lines.append)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("error,code", [("RecipeError", 2), ("TrainingError", 1)])
def test_a_failing_recipe_job_ends_in_one_line(monkeypatch, capsys, error, code):
    # e.g. a second submit with other training settings into the same output_dir: as `hmscale run`, no traceback
    import hmscale.recipe
    from hmscale.train import engine
    from ray_jobs import run_recipe

    cls = getattr(hmscale.recipe, error, None) or getattr(engine, error)

    def refuse(cfg, **kw):
        raise cls("output_dir: runs/demo holds a run of a different config (stage2.lr: 0.001 -> 0.0003)")
    monkeypatch.setattr(hmscale.recipe, "run_recipe", refuse)
    assert run_recipe.main(["-s", "stage2.lr=3e-4"]) == code
    err = capsys.readouterr().err
    assert err == "hmscale: error: output_dir: runs/demo holds a run of a different config (stage2.lr: 0.001 -> 0.0003)\n"


@pytest.mark.ray
def test_submit_runs_the_recipe_on_a_local_head(ray_cluster, tmp_path):
    # the suite's embedded cluster (tests/conftest.py): a head node with the dashboard and its job API on 127.0.0.1,
    # started as `hmscale run` starts one (a `ray start --head` of its own here was one more cluster start, ~10 s of
    # both cores); the job's `python` is this environment's (PATH, as on a real cluster with hmscale's dependencies)
    from ray._private.worker import get_dashboard_url
    from ray.job_submission import JobSubmissionClient

    from hmscale.submit import find_token

    dash = f"http://{get_dashboard_url()}"
    out = tmp_path / "run"
    deadline = time.time() + 60
    while True:  # (the job API comes up with the dashboard's agent, shortly after the cluster)
        try:
            token = find_token()  # the cluster writes it (token auth) when it starts
            headers = {"Authorization": f"Bearer {token}"} if token else None
            JobSubmissionClient(dash, headers=headers).list_jobs()
            break
        except Exception:
            if time.time() > deadline:
                raise
            time.sleep(0.5)
    # (the smallest budget that trains both stages, and no greedy samples: the job's run, not the model, is tested)
    overrides = TINY + ["budget.total_tokens=512", "eval.generate_tokens=0", f"output_dir={out}",
                        f"data.cache_dir={tmp_path / 'cache'}", f"cache.root={tmp_path / 'tc'}"]
    cmd = [sys.executable, "-m", "hmscale.cli", "submit", "--address", dash, "--timeout", "400"]
    for o in overrides:
        cmd += ["-s", o]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=500)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "SUCCEEDED" in r.stdout
    assert "[data] plan " in r.stdout  # the job's own log, streamed from the cluster
    results = json.loads((out / "results.json").read_text())
    assert results["hedgemamba_ppl"] > 1 and results["teacher_ppl"] > 1
    # where `hmscale eval RUN_DIR` reads the run's relative inputs: the submitted checkout, not Ray's temporary copy
    assert results["inputs_dir"] == str(REPO), results["inputs_dir"]


@pytest.mark.parametrize("module", ["run_recipe", "distill", "cache_teacher"])
def test_a_job_in_rays_working_dir_copy_refuses_relative_directories(monkeypatch, tmp_path, capsys, module):
    # `ray job submit --working-dir . -- python -m ray_jobs.run_recipe --config X`: X's relative output_dir would be
    # the job's temporary copy's, lost after the job; the entry points say so in one line before any work
    import importlib

    job_copy = tmp_path / "runtime_resources" / "working_dir_files" / "_ray_pkg_0123"
    job_copy.mkdir(parents=True)
    monkeypatch.chdir(job_copy)
    mod = importlib.import_module(f"ray_jobs.{module}")

    def work(*a, **kw):
        raise AssertionError("the job started its work in the temporary copy")
    import hmscale.recipe
    import hmscale.teacher.cache

    monkeypatch.setattr(hmscale.recipe, "run_recipe", work)
    monkeypatch.setattr(hmscale.teacher.cache, "build_cache", work)
    if module == "distill":
        monkeypatch.setattr(mod, "run_distill", work)
    main = mod.main
    assert main(["-s", "data.cache_dir=/tmp/x", "-s", "cache.root=/tmp/y"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "output_dir='runs/demo' relative: this job runs in Ray's temporary copy" in err
    assert "-s output_dir=/shared/..." in err
