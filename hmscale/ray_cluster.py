"""Connecting to Ray: one place that decides between a real cluster and the embedded one.

`connect(address)` joins the cluster at `address` (or $RAY_ADDRESS). With neither, it starts an
embedded single-node cluster with no dashboard (so no job API at all), asked for on 127.0.0.1, with
Ray's token authentication (on by default for local clusters since Ray 2.59): an open Ray job API runs
any code it is sent, so nothing we start is reachable without the token.
"""

from __future__ import annotations

import os


def connect(address: str | None = None, num_cpus: int | None = None, num_gpus: int | None = None, log=print):
    """Initialise Ray once per process; returns True when this call started the embedded cluster."""
    import ray

    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address:
        ray.init(address=address, log_to_driver=True)
        log(f"[ray] connected to {address}: {ray.cluster_resources()}")
        return False
    ray.init(
        num_cpus=num_cpus or os.cpu_count(),
        num_gpus=num_gpus,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=True,
        configure_logging=False,
    )
    log(f"[ray] embedded local cluster (127.0.0.1 only): {ray.cluster_resources()}")
    return True
