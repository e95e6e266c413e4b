"""`hmscale submit`: send a recipe run to a Ray cluster through Ray's job submission API.

The job runs `python -m ray_jobs.run_recipe` in a copy of the working directory on the cluster, with
the resolved config passed in the job's environment. Authentication: Ray token auth (Ray >= 2.52).
The token comes from --token-file, $RAY_AUTH_TOKEN, $RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token, and is
sent as a bearer token. A remote address without a token is refused: an open job API executes any
code it is sent, so a cluster must never expose one.
"""

from __future__ import annotations

import base64
import os
import time
from pathlib import Path
from urllib.parse import urlparse

import yaml

from hmscale.config import RunConfig

EXCLUDES = [".venv", ".git", "runs", ".cache", ".whl", ".anchors", "__pycache__", "*.egg-info", ".pytest_cache"]
TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}


class SubmitError(RuntimeError):
    pass


def find_token(token_file: str | None = None) -> str | None:
    if token_file:
        p = Path(token_file).expanduser()
        if not p.exists():
            raise SubmitError(f"--token-file {token_file!r} does not exist; point it at the cluster's auth token")
        return p.read_text().strip()
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"].strip()
    for p in (os.environ.get("RAY_AUTH_TOKEN_PATH"), "~/.ray/auth_token"):
        if p and Path(p).expanduser().exists():
            return Path(p).expanduser().read_text().strip()
    return None


def _is_local(address: str) -> bool:
    host = urlparse(address if "://" in address else f"http://{address}").hostname or ""
    return host in {"localhost", "127.0.0.1", "::1"}


def encode_config(cfg: RunConfig) -> str:
    return base64.b64encode(yaml.safe_dump(cfg.model_dump(mode="json")).encode()).decode()


def decode_config(blob: str) -> dict:
    return yaml.safe_load(base64.b64decode(blob.encode()).decode())


# already on any Ray GPU cluster, and never to be replaced per job: torch and triton are the node's CUDA build, ray the
# cluster's own version
_CLUSTER_PROVIDES = {"torch", "triton", "ray"}


def job_dependencies(working_dir: str = ".") -> list[str]:
    """hmscale's runtime requirements from the working directory's pyproject.toml, less what the cluster provides:
    what ``--install`` asks Ray to pip-install into the job's environment on every node."""
    from hmscale.requirements import distribution_name, pyproject_dependencies

    deps = pyproject_dependencies(working_dir)
    if deps is None:
        raise SubmitError(f"--install: {Path(working_dir) / 'pyproject.toml'} not found or unreadable; run `hmscale "
                          "submit` from the hmscale checkout, with Python 3.11 or later")
    return [d for d in deps if distribution_name(d) not in _CLUSTER_PROVIDES]


def job_runtime_env(cfg: RunConfig, working_dir: str = ".", install: bool = False) -> dict:
    env = {"working_dir": working_dir, "excludes": EXCLUDES,
           "env_vars": {"HMSCALE_CONFIG_B64": encode_config(cfg), "PYTHONUNBUFFERED": "1"}}
    if install:
        env["pip"] = {"packages": job_dependencies(working_dir), "pip_check": False}
    return env


def submit(cfg: RunConfig, address: str, *, token_file: str | None = None, working_dir: str = ".",
           follow: bool = True, timeout_s: float | None = None, install: bool = False, log=print) -> str:
    """Submit; with follow, stream the job's logs until it ends. Returns the final status (or 'PENDING')."""
    from ray.job_submission import JobSubmissionClient

    token = find_token(token_file)
    if token is None and not _is_local(address):
        raise SubmitError(f"no Ray auth token for {address}; start the cluster with RAY_AUTH_MODE=token and pass "
                          "--token-file (or set RAY_AUTH_TOKEN): an open job API runs any code it is sent")
    headers = {"Authorization": f"Bearer {token}"} if token else None
    if "://" not in address:
        address = f"http://{address}"
    try:
        client = JobSubmissionClient(address, headers=headers)
    except (ConnectionError, RuntimeError, ValueError) as err:  # nothing listening, a refused or malformed address
        raise SubmitError(f"--address {address}: cannot reach a Ray cluster's job API there "
                          f"({str(err).splitlines()[0][:160]}); check the dashboard address (http://HEAD:8265) and "
                          "that the cluster is up (`ray status` on its head)") from None
    entrypoint = "python -m ray_jobs.run_recipe"
    runtime_env = job_runtime_env(cfg, working_dir, install)
    deadline = time.time() + 120
    while True:
        try:
            job_id = client.submit_job(entrypoint=entrypoint, runtime_env=runtime_env,
                                       metadata={"hmscale_run": cfg.output_dir})
            break
        except RuntimeError as err:  # a head node that just started has no job agent yet
            if "No available agent" not in str(err) or time.time() > deadline:
                raise SubmitError(f"the cluster at {address} refused the job: {str(err).splitlines()[0]}") from None
            time.sleep(3)
    log(f"[submit] job {job_id} submitted to {address}: {entrypoint} (output_dir={cfg.output_dir})")
    if not follow:
        return "PENDING"
    start, shown = time.time(), 0
    while True:
        status = str(client.get_job_status(job_id).value)
        logs = client.get_job_logs(job_id)
        if len(logs) > shown:
            log(logs[shown:].rstrip("\n"))
            shown = len(logs)
        if status in TERMINAL:
            log(f"[submit] job {job_id}: {status}")
            return status
        if timeout_s is not None and time.time() - start > timeout_s:
            log(f"[submit] job {job_id}: still {status} after {timeout_s:.0f} s; stopping it")
            client.stop_job(job_id)
            return "STOPPED"
        time.sleep(2)
