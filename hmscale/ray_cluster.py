"""Connecting to Ray: one place that decides between a real cluster and the embedded one.

`connect(address)` joins the cluster at `address` (or $RAY_ADDRESS, which `ray job submit` sets for
the job's driver). With neither, it starts a fresh embedded single-node cluster (`address="local"`:
never whatever other Ray instance runs on the host) whose dashboard and job API listen on 127.0.0.1
only, behind Ray's token authentication (on by default for local clusters since Ray 2.59). An open Ray
job API runs any code it is sent; nothing we start exposes one to the network.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

from hmscale.config import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[1]
_started_embedded = False  # whether this process started the cluster it is on (`connect`): one that never grows


class RayConnectError(ConfigError):
    """`parallel.ray_address` (or $RAY_ADDRESS) names no cluster this process can join; one line, what to change."""


def _connect_failure(address: str, err: BaseException) -> str:
    chain, e = [], err
    while e is not None and len(chain) < 5:
        chain.append(f"{type(e).__name__}: {e}")
        e = e.__cause__ or e.__context__
    text = "\n".join(chain)
    head = f"parallel.ray_address={address}: cannot join the Ray cluster there"
    if "InvalidAuthToken" in text or "AuthenticationError" in text or "Unauthenticated" in text:
        mode = os.environ.get("RAY_AUTH_MODE") or "unset"
        return (f"{head}: it refused this process's auth token (RAY_AUTH_MODE is {mode}); for a cluster started with "
                "token authentication, export RAY_AUTH_MODE=token here too, with the cluster's token in "
                "~/.ray/auth_token or $RAY_AUTH_TOKEN")
    return (f"{head} ({str(err).strip().splitlines()[0][:160] if str(err).strip() else type(err).__name__}); give the "
            "head's GCS address (HEAD:6379, not the dashboard's http://HEAD:8265), or leave it unset for an embedded "
            "cluster, and check that the cluster is up (`ray status` on its head)")


# the progress-bar switches a joined cluster's workers get from this process (`connect`) and a submitted job from the
# submitting shell (`hmscale.submit.job_runtime_env`); an embedded cluster's processes inherit them
QUIET_ENV = ("HMSCALE_NO_PROGRESS", "HF_HUB_DISABLE_PROGRESS_BARS", "HF_DATASETS_DISABLE_PROGRESS_BARS")


# one try to reach a cluster's GCS takes ~41 s where something other than a GCS answers (Ray's GcsClient waits 5 s to
# connect and 30 s for the cluster id); Ray makes 20 such tries (~14 minutes of warnings) unless this says otherwise
_JOIN_TRIES = "1"


def _nothing_listens(address: str) -> str | None:
    """'nothing listens at HOST:PORT' where the address Ray would dial (localhost made the node's IP, as ray.init does)
    refuses a TCP connection: a closed port, which Ray itself reports only after its GCS client's timeouts (~41 s).
    Anything else (an open port, no answer, a name that does not resolve, a `ray://` or http address): None, and
    Ray's own connect decides."""
    if "://" in address:
        return None
    target = address
    try:
        from ray._private.services import canonicalize_bootstrap_address

        target = canonicalize_bootstrap_address(address) or address
        host, _, port = target.rpartition(":")
        with socket.create_connection((host.strip("[]"), int(port)), timeout=3):
            return None
    except ConnectionRefusedError:
        return f"nothing listens at {target}"
    except Exception:  # noqa: BLE001 (a timeout, an unknown host, an address Ray parses otherwise: Ray says)
        return None


def _private_token(log=print) -> None:
    """The embedded cluster's token lives in ~/.ray/auth_token, and whoever reads it can run code through the job API:
    Ray writes it (and `ray get-auth-token --generate` too) with the umask's mode, world-readable. Create it 0600
    here (in a 0700 ~/.ray) before Ray would, and make one of ours that is readable by others 0600. A token from the
    environment ($RAY_AUTH_TOKEN, $RAY_AUTH_TOKEN_PATH) or RAY_AUTH_MODE other than token: left as it is."""
    if (os.environ.get("RAY_AUTH_MODE") or "token").lower() != "token":
        return
    if os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return
    path = Path.home() / ".ray" / "auth_token"
    try:
        st = path.stat()
    except FileNotFoundError:
        import secrets

        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError:  # made meanwhile by another process (Ray reads that one), or ~ not writable (Ray says so)
            return
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))  # Ray's own format (authentication_token_generator)
        return
    except OSError:
        return  # unreadable: Ray reports it
    if st.st_mode & 0o077 and st.st_uid == os.getuid():
        try:
            path.chmod(0o600)
            log(f"[ray] {path} was readable by others (mode {oct(st.st_mode & 0o777)}): made it 0600")
        except OSError:
            pass


def connect(address: str | None = None, num_cpus: int | None = None, num_gpus: int | None = None, log=print) -> bool:
    """Initialise Ray once per process; returns True when this call started the embedded cluster."""
    import ray

    # Ray's driver replaces builtins.print the first time it relays a worker's log line (its tqdm_ray bar manager);
    # after that, cloudpickle refuses any function sent by value that holds the original print (a recipe with
    # `log=print`, defined in a script): "Can't pickle <built-in function print>: it's not the same object"
    os.environ.setdefault("RAY_TQDM_PATCH_PRINT", "0")
    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address and address.strip().lower() == "local":  # Ray's word for a new local cluster: the embedded one
        address = None
    if address:
        tries = os.environ.get("RAY_gcs_server_port_wait_time_s")
        # a closed port fails at once (an operator who set how long Ray waits for a GCS still starting: Ray waits)
        if tries is None and (refused := _nothing_listens(address)):
            raise RayConnectError(_connect_failure(address, ConnectionRefusedError(refused)))
        if tries is None:  # one bounded try (~41 s at most), not Ray's twenty; an operator's own setting wins
            os.environ["RAY_gcs_server_port_wait_time_s"] = _JOIN_TRIES
        # the cluster's workers have the environment of their node's `ray start`, not this shell's: what quiets the
        # progress bars (HMSCALE_NO_PROGRESS=1, and the hub's switches it sets) travels in the job's runtime env. In a
        # submitted job it is there already (`hmscale submit` puts it into the job's env), and Ray refuses a ray.init
        # env var that the job's runtime env also sets
        quiet = {k: os.environ[k] for k in QUIET_ENV if os.environ.get(k)}
        in_job = "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ
        extra = {"runtime_env": {"env_vars": quiet}} if quiet and not in_job else {}
        try:
            ray.init(address=address, log_to_driver=True, **extra)
        except (ConnectionError, RuntimeError, ValueError) as err:  # nothing there, the dashboard's URL, a bad token
            raise RayConnectError(_connect_failure(address, err)) from None
        finally:
            if tries is None:
                os.environ.pop("RAY_gcs_server_port_wait_time_s", None)
        log(f"[ray] connected to {address}: {ray.cluster_resources()}")
        return False
    # workers import hmscale, kernels and ray_jobs from this checkout even when it is not installed
    pypath = os.pathsep.join([str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    _private_token(log)
    ray.init(
        address="local",
        num_cpus=num_cpus or os.cpu_count(),
        num_gpus=num_gpus,
        include_dashboard=True,  # Ray Train's state queries need it; it listens on 127.0.0.1 only
        dashboard_host="127.0.0.1",
        _node_ip_address="127.0.0.1",
        log_to_driver=True,
        configure_logging=False,
        runtime_env={"env_vars": {"PYTHONPATH": pypath}},
    )
    log(f"[ray] embedded local cluster: {ray.cluster_resources()}")
    global _started_embedded
    _started_embedded = True
    return True


def stop_embedded(log=print) -> None:
    """Stop the embedded cluster this process started (``connect``), if it is still up; a no-op on a joined cluster,
    inside a Ray task or job, and where the caller's own ``ray.init`` came first. A run stops it once its Ray work is
    done, so the evaluation after the training (and a notebook's next cell) does not keep the cluster's processes,
    idle workers and object store."""
    global _started_embedded
    if not _started_embedded:
        return
    _started_embedded = False
    import ray

    if ray.is_initialized():
        ray.shutdown()
        log("[ray] embedded local cluster stopped")


def process_cpus() -> int:
    """CPU threads for this process's own compute: inside a Ray task or actor, the CPUs Ray granted it (a sweep
    size's task asks for `cpus_per_size`, and its neighbours on the node use the rest), else every core.
    Taking all the cores in each of several tasks on one node only makes their threads spin against each other."""
    cores = os.cpu_count() or 1
    ray = sys.modules.get("ray")  # a process that never imported Ray is not a Ray worker
    if ray is not None and ray.is_initialized():
        try:
            cpus = ray.get_runtime_context().get_assigned_resources().get("CPU")  # {} in a driver
        except Exception:
            cpus = None
        if cpus:
            return max(1, min(cores, int(cpus)))
    return cores


class ClusterTooSmall(ConfigError):
    """`parallel.num_workers` asks for more CPUs (GPUs with `parallel.use_gpu`) than the Ray cluster has in all."""


_warned: set = set()


def check_workers_fit(num_workers: int, use_gpu: bool, log=print) -> None:
    """Ray Train's worker group takes one CPU (one GPU with `use_gpu`) per worker and waits for them without end
    (its start times out every 60 s and is retried forever), so a group larger than the cluster hangs. The embedded
    cluster never grows: refuse in one line (`ClusterTooSmall`). A joined cluster may (autoscaling): say once that
    the run waits for nodes and what to change on a fixed cluster. Nothing to check before Ray is initialised."""
    import ray

    if not ray.is_initialized():
        return
    embedded = _started_embedded  # (a Ray task or a submitted job's driver is on a cluster someone else started)
    kind = "GPU" if use_gpu else "CPU"
    have = int(ray.cluster_resources().get(kind, 0))
    if num_workers <= have:
        return
    what = (f"parallel.num_workers={num_workers}: each Ray Train worker takes one {kind}"
            f"{' (parallel.use_gpu)' if use_gpu else ''} and the {'embedded ' if embedded else ''}Ray cluster has "
            f"{have} in all")
    lower = f"lower parallel.num_workers to {have}" if have else "drop parallel.use_gpu" if use_gpu else "add CPUs"
    if embedded:
        raise ClusterTooSmall(f"{what} (this machine's); {lower}, or join a larger cluster with "
                              "parallel.ray_address=HEAD:6379")
    if (num_workers, kind) not in _warned:
        _warned.add((num_workers, kind))
        log(f"[ray] warning: {what} now: training waits until nodes with the rest join (an autoscaling cluster; Ray "
            f"Train retries every 60 s without end); on a fixed cluster stop it and {lower}, or add nodes")
