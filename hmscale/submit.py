"""`hmscale submit`: send a recipe run to a Ray cluster through Ray's job submission API.

The job runs `python -m ray_jobs.run_recipe` in a copy of the working directory on the cluster, with
the resolved config passed in the job's environment. Authentication: Ray token auth (Ray >= 2.52).
The token comes from --token-file, $RAY_AUTH_TOKEN, $RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token, and is
sent as a bearer token. A remote address without a token is refused: an open job API executes any
code it is sent, so a cluster must never expose one.

Directories: the job runs in Ray's temporary copy of the working directory (the cluster's
/tmp/ray/session_*/runtime_resources/working_dir_files/_ray_pkg_<hash>/: a new one with every code change or cluster
restart, garbage-collected by Ray once unused), so a relative `output_dir`, `data.cache_dir` or `cache.root` would put
the run and its caches there, where a second submit does not find them and Ray may delete them. For a cluster
on this machine (a local address) they are made absolute against this directory (the run lands where `hmscale run`
would put it, and a second submit resumes it); for a remote cluster a relative one is refused.
"""

from __future__ import annotations

import asyncio
import base64
import os
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import yaml

from hmscale.config import RunConfig, looks_like_path

# in a submitted job's environment: the directory `hmscale submit` uploaded, which the run records as where its relative
# inputs come from (results.json's inputs_dir, for `hmscale eval RUN_DIR`) instead of Ray's temporary copy of it
SUBMITTED_FROM = "HMSCALE_SUBMITTED_FROM"
EXCLUDES = [".venv", ".git", "runs", ".cache", ".whl", ".anchors", "__pycache__", "*.egg-info", ".pytest_cache"]
TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}


class SubmitError(RuntimeError):
    pass


class _LogStream:
    """The job's log as it is written, through the job API's websocket (``tail_job_logs``), on a thread of its own:
    each line is fetched once (re-reading the whole log every poll costs the log's size per poll on a long job), and
    the caller's thread stays free to poll the status, stop on a timeout and take Ctrl-C."""

    def __init__(self, client, job_id: str, log):
        self.error: BaseException | None = None
        self._done = threading.Event()

        async def tail():
            async for chunk in client.tail_job_logs(job_id):
                log(chunk.rstrip("\n"))

        def run():
            try:
                asyncio.run(tail())
            except Exception as err:  # the connection dropped; the caller reports it
                self.error = err
            finally:
                self._done.set()

        threading.Thread(target=run, name=f"logs-{job_id}", daemon=True).start()

    def wait(self, seconds: float) -> bool:
        """Whether the stream has closed (the job ended) within ``seconds``."""
        return self._done.wait(seconds)


def find_token(token_file: str | None = None) -> str | None:
    if token_file:
        p = Path(token_file).expanduser()
        if not p.exists():
            raise SubmitError(f"--token-file {token_file!r} does not exist; point it at the cluster's auth token")
        try:
            token = p.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as err:  # a folder, a file this user may not read, a binary file
            why = err.strerror if isinstance(err, OSError) and err.strerror else type(err).__name__
            raise SubmitError(f"--token-file {token_file!r} cannot be read ({why}); point it at the cluster's auth "
                              "token (a text file: `ray get-auth-token` on its head prints it)") from None
        if not token:  # (sent as no token at all, the refusal then said that none was found)
            raise SubmitError(f"--token-file {token_file!r} is empty; write the cluster's auth token into it "
                              "(`ray get-auth-token` on its head prints it)")
        return token
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"].strip()
    for p in (os.environ.get("RAY_AUTH_TOKEN_PATH"), "~/.ray/auth_token"):
        if p and Path(p).expanduser().exists():
            return Path(p).expanduser().read_text().strip()
    return None


def _is_local(address: str) -> bool:
    host = urlparse(address if "://" in address else f"http://{address}").hostname or ""
    return host in {"localhost", "127.0.0.1", "::1"}


# the directories a run writes, which must outlive the job (the config's relative paths resolve in the job's copy)
RUN_DIRS = ("output_dir", "data.cache_dir", "cache.root")


def _get(cfg: RunConfig, dotted: str) -> str:
    obj = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def place_directories(cfg: RunConfig, address: str, cwd: str | os.PathLike | None = None) -> RunConfig:
    """The config the job gets: on a local cluster, the run's directories (and its inputs: `data.paths`, a local teacher
    or tokenizer folder) made absolute against
    `cwd` (the directory uploaded as the job's working directory: this one by default), where `hmscale run` would
    put them; for a remote cluster, a relative one is refused (`SubmitError`): it would resolve inside the job's
    temporary working directory."""
    relative = [k for k in RUN_DIRS if not _is_stable(_get(cfg, k))]
    rel_data = [p for p in cfg.data.paths if not _is_stable(p)]
    # a local teacher / tokenizer folder given relative (a hub id is not a path)
    rel_dirs = {k: _get(cfg, k) for k in ("teacher.name_or_path", "tokenizer.name_or_path")
                if _get(cfg, k) and looks_like_path(_get(cfg, k), cwd) and not _is_stable(_get(cfg, k))}
    if not relative and not rel_data and not rel_dirs:
        return cfg
    if not _is_local(address):
        if relative:
            raise SubmitError(
                ", ".join(f"{k}={_get(cfg, k)!r}" for k in relative) + " relative: on the cluster "
                f"{'it' if len(relative) == 1 else 'they'} would resolve inside the job's temporary copy of the "
                "working directory (new with every code change, deleted by Ray once unused); set "
                + " ".join(f"-s {k}=/shared/..." for k in relative) + " (a path every node sees)")
        left_out = [p for p in rel_data if not _travels(p)]
        if left_out:  # (the job would stop on the cluster, after the upload: "data.paths: ... does not exist")
            raise SubmitError(
                f"data.paths: {', '.join(map(repr, left_out))} relative, outside the uploaded working directory or "
                f"in a folder not uploaded ({', '.join(EXCLUDES)}): on the cluster it would not exist; give a path "
                "every node sees (-s 'data.paths=[/shared/...]'), or keep the data inside the checkout")
        for k, p in rel_dirs.items():
            if not _travels(p):  # (the workers would look for it as a hub id, or not find it)
                raise SubmitError(f"{k}: {p!r} relative, outside the uploaded working directory or in a folder not "
                                  f"uploaded ({', '.join(EXCLUDES)}): on the cluster it would not exist; give a path "
                                  f"every node sees (-s {k}=/shared/...)")
        return cfg  # relative data.paths and folders inside the checkout travel with it
    return cfg.with_absolute_inputs(cwd)


def job_copy_refusal(cfg: RunConfig, cwd: str | os.PathLike | None = None) -> str | None:
    """For a job's entry point (`ray job submit --working-dir . -- python -m ray_jobs.run_recipe --config X`): the
    one-line refusal when it runs in Ray's temporary copy of a working directory and the config's run directories
    are relative to it (they would land there, where the next job does not find them and Ray deletes them)."""
    if "working_dir_files" not in Path(os.path.abspath(cwd or ".")).parts:
        return None
    relative = [k for k in RUN_DIRS if not _is_stable(_get(cfg, k))]
    if not relative:
        return None
    return (", ".join(f"{k}={_get(cfg, k)!r}" for k in relative) + " relative: this job runs in Ray's temporary copy "
            f"of the working directory ({os.path.abspath(cwd or '.')}), deleted once unused; give absolute paths "
            "(" + " ".join(f"-s {k}=/shared/..." for k in relative) + "), or submit with `hmscale submit`")


def _travels(path: str) -> bool:
    """Whether a relative data path stays inside the uploaded working directory and out of the folders its upload
    leaves out (``EXCLUDES``, matched at any depth as Ray matches them)."""
    import fnmatch

    parts = os.path.normpath(path).split(os.sep)
    if parts[0] == "..":
        return False
    return not any(fnmatch.fnmatch(part, pattern) for part in parts for pattern in EXCLUDES)


def _is_stable(path: str) -> bool:
    """Absolute, or under the home directory (`~/...` names the cluster user's home on the cluster)."""
    return Path(path).is_absolute() or path.startswith("~")


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
    from hmscale.ray_cluster import QUIET_ENV

    quiet = {k: os.environ[k] for k in QUIET_ENV if os.environ.get(k)}  # (`HMSCALE_NO_PROGRESS=1 hmscale submit ...`)
    env = {"working_dir": working_dir, "excludes": EXCLUDES,
           "env_vars": {"HMSCALE_CONFIG_B64": encode_config(cfg), "PYTHONUNBUFFERED": "1",
                        SUBMITTED_FROM: os.path.abspath(working_dir), **quiet}}
    if install:
        env["pip"] = {"packages": job_dependencies(working_dir), "pip_check": False}
    return env


def _describe_token(token_file: str | None) -> str:
    if token_file:
        return f"--token-file {token_file}"
    if os.environ.get("RAY_AUTH_TOKEN"):
        return "$RAY_AUTH_TOKEN"
    for p in (os.environ.get("RAY_AUTH_TOKEN_PATH"), "~/.ray/auth_token"):
        if p and Path(p).expanduser().exists():
            return p if p == "~/.ray/auth_token" else f"$RAY_AUTH_TOKEN_PATH ({p})"
    return "no token"


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:200]


def _auth_refused(err: BaseException) -> bool:
    from ray.exceptions import AuthenticationError

    return isinstance(err, AuthenticationError) or "Authentication failed" in str(err)


def _job_commands(job_id: str, address: str) -> str:
    where = f"--address {address}"
    return (f"follow it with `RAY_AUTH_MODE=token ray job logs -f {job_id} {where}`, stop it with "
            f"`RAY_AUTH_MODE=token ray job stop {job_id} {where}`")


def submit(cfg: RunConfig, address: str, *, token_file: str | None = None, working_dir: str = ".",
           follow: bool = True, timeout_s: float | None = None, install: bool = False, log=print) -> str:
    """Submit; with follow, stream the job's logs until it ends. Returns the final status (or 'PENDING')."""
    from ray.job_submission import JobSubmissionClient

    token = find_token(token_file)
    if token is None and not _is_local(address):
        raise SubmitError(f"no Ray auth token for {address}; start the cluster with RAY_AUTH_MODE=token and pass "
                          "--token-file (or set RAY_AUTH_TOKEN): an open job API runs any code it is sent")
    cfg = place_directories(cfg, address, working_dir)
    headers = {"Authorization": f"Bearer {token}"} if token else None
    if "://" not in address:
        address = f"http://{address}"

    def refused(err: Exception) -> SubmitError:
        what = (f"refused {_describe_token(token_file)} as its auth token" if token else
                "needs an auth token and none was found (--token-file, $RAY_AUTH_TOKEN, ~/.ray/auth_token)")
        return SubmitError(f"the cluster at {address} {what}; `ray get-auth-token` on its head prints the right one: "
                           "pass it with --token-file or $RAY_AUTH_TOKEN")
    try:
        client = JobSubmissionClient(address, headers=headers)
    except Exception as err:  # nothing listening, a refused or malformed address, a wrong token
        if _auth_refused(err):
            raise refused(err) from None
        raise SubmitError(f"--address {address}: cannot reach a Ray cluster's job API there "
                          f"({_first_line(err)[:160]}); check the dashboard address (http://HEAD:8265) and "
                          "that the cluster is up (`ray status` on its head)") from None
    entrypoint = "python -m ray_jobs.run_recipe"
    runtime_env = job_runtime_env(cfg, working_dir, install)
    deadline = time.time() + 120
    while True:
        try:
            job_id = client.submit_job(entrypoint=entrypoint, runtime_env=runtime_env,
                                       metadata={"hmscale_run": cfg.output_dir})
            break
        except Exception as err:  # a head node that just started has no job agent yet
            if _auth_refused(err):
                raise refused(err) from None
            if "No available agent" not in str(err) or time.time() > deadline:
                raise SubmitError(f"the cluster at {address} refused the job: {_first_line(err)}") from None
            time.sleep(3)
    log(f"[submit] job {job_id} submitted to {address}: {entrypoint} (output_dir={cfg.output_dir})")
    if not (Path(working_dir) / "ray_jobs" / "run_recipe.py").is_file():
        # (from a folder of the checkout, e.g. configs/: that folder alone is uploaded, and the job imports whatever
        # hmscale the nodes have installed, or fails with "No module named ray_jobs")
        log(f"[submit] note: {os.path.abspath(working_dir)} is not the root of an hmscale checkout (no "
            "ray_jobs/run_recipe.py): it is uploaded as the job's working directory all the same, and the job runs the "
            "hmscale installed on the cluster's nodes, not this checkout's code; submit from the checkout's root")
    if not follow:
        log(f"[submit] {_job_commands(job_id, address)}")
        return "PENDING"
    start = time.time()
    try:
        stream = _LogStream(client, job_id, log)
        while True:
            status = str(client.get_job_status(job_id).value)
            if status in TERMINAL:
                stream.wait(10)  # the last lines: the stream closes once the job has ended
                log(f"[submit] job {job_id}: {status}")
                return status
            if stream.error is not None:
                raise stream.error
            if timeout_s is not None and time.time() - start > timeout_s:
                log(f"[submit] job {job_id}: still {status} after {timeout_s:.0f} s; stopping it")
                client.stop_job(job_id)
                return "STOPPED"
            if stream.wait(2):  # closed without an error: the job has ended and its status follows
                time.sleep(0.5)
    except KeyboardInterrupt:
        log(f"[submit] stopped following; job {job_id} keeps running on the cluster: {_job_commands(job_id, address)}")
        raise
    except Exception as err:  # the head went away or the connection dropped while following
        raise SubmitError(f"lost the job's logs ({_first_line(err)}); job {job_id} may still be running: "
                          f"{_job_commands(job_id, address)}") from None
