"""`hmscale submit` against a real local head node (`ray start --head` with the dashboard)."""

import json
import os
import signal
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


@pytest.mark.ray
def test_submit_runs_the_recipe_on_a_local_head(tmp_path):
    ray_bin = Path(sys.executable).with_name("ray")
    gcs, dash = _free_port(), _free_port()
    # the cluster's `python` is this environment's (as on a real cluster with hmscale's dependencies installed)
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", PATH=f"{ray_bin.parent}{os.pathsep}{os.environ.get('PATH', '')}")
    # every port of our own: a Ray instance left by another test must not take the job agent's port
    ports = [f"--{name}={_free_port()}" for name in ("dashboard-agent-listen-port", "dashboard-agent-grpc-port",
                                                     "metrics-export-port", "runtime-env-agent-port",
                                                     "ray-client-server-port")]
    # --block: the head runs in this child and takes its cluster down when the child is terminated (`ray stop`
    # would end every Ray instance on the host, other tests' and other users' included)
    head_log = tmp_path / "head.log"
    with open(head_log, "w") as fh:
        head = subprocess.Popen(
            [str(ray_bin), "start", "--head", f"--port={gcs}", f"--dashboard-port={dash}", "--dashboard-host=127.0.0.1",
             "--node-ip-address=127.0.0.1", "--num-cpus=2", "--include-dashboard=true", "--disable-usage-stats",
             "--block", *ports],
            env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
        )
    out = tmp_path / "run"
    try:
        from ray.job_submission import JobSubmissionClient

        from hmscale.submit import find_token

        deadline = time.time() + 180
        while True:
            assert head.poll() is None, f"ray start --head exited {head.returncode}: {head_log.read_text()[-3000:]}"
            try:
                token = find_token()  # the head writes it (token auth) when it starts
                headers = {"Authorization": f"Bearer {token}"} if token else None
                JobSubmissionClient(f"http://127.0.0.1:{dash}", headers=headers).list_jobs()
                break
            except Exception:
                if time.time() > deadline:
                    raise
                time.sleep(1)
        overrides = TINY + [f"output_dir={out}", f"data.cache_dir={tmp_path / 'cache'}", f"cache.root={tmp_path / 'tc'}"]
        cmd = [sys.executable, "-m", "hmscale.cli", "submit", "--address", f"http://127.0.0.1:{dash}", "--timeout", "400"]
        for o in overrides:
            cmd += ["-s", o]
        r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=500)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert "SUCCEEDED" in r.stdout
        results = json.loads((out / "results.json").read_text())
        assert results["hedgemamba_ppl"] > 1 and results["teacher_ppl"] > 1
    finally:
        head.terminate()
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()
        # what `ray stop` also clears: the head's address, where a bare ray.init() would look for a cluster
        from ray._common.utils import get_ray_address_file

        current = Path(get_ray_address_file(None))
        if current.exists() and current.read_text().strip().endswith(f":{gcs}"):
            current.unlink()
