"""Connecting to Ray: one place that decides between a real cluster and the embedded one.

`connect(address)` joins the cluster at `address` (or $RAY_ADDRESS, which `ray job submit` sets for
the job's driver). With neither, it starts a fresh embedded single-node cluster (`address="local"`:
never whatever other Ray instance runs on the host) whose dashboard and job API listen on 127.0.0.1
only, behind Ray's token authentication (on by default for local clusters since Ray 2.59). An open Ray
job API runs any code it is sent; nothing we start exposes one to the network.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


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
    if address:
        ray.init(address=address, log_to_driver=True)
        log(f"[ray] connected to {address}: {ray.cluster_resources()}")
        return False
    # workers import hmscale, kernels and ray_jobs from this checkout even when it is not installed
    pypath = os.pathsep.join([str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
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
    return True


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
