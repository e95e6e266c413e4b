"""Several training processes on this machine without Ray (`parallel.engine=local`, `num_workers > 1`).

`spawn_workers(fn, n, *args)` starts n processes (one per GPU when training on GPUs; CPU workers come from a preloaded
fork server, `hmscale.worker_processes`) that
form one torch.distributed group the way torchrun does it: RANK / LOCAL_RANK / WORLD_SIZE /
MASTER_ADDR / MASTER_PORT in the environment, so `engine.init_distributed` joins it (NCCL on GPUs,
gloo on CPU). Each process calls ``fn(rank, *args)``. A worker that raises or dies stops the others;
the error comes back as a `WorkerFailed` with the worker's last line (``.rank``: which worker; one that raised keeps
its traceback, as ``.worker_traceback`` and as the exception's cause, so an unexpected error shows where it happened). A SIGINT to this process (`kill -INT`;
a terminal's Ctrl-C reaches the workers themselves) interrupts the workers too, then goes on up.
"""

from __future__ import annotations

import os
import signal

import torch

from hmscale.train.engine import free_port, remove_shm_buffers
from hmscale.worker_processes import handover, start_method, take_over


class WorkerFailed(RuntimeError):
    """A local worker process raised or died (``rank``: which one, when known; ``worker_traceback``: the traceback
    of the exception it raised, None when it died or never started)."""

    def __init__(self, msg: str, rank: int | None = None, worker_traceback: str | None = None):
        super().__init__(msg)
        self.rank, self.worker_traceback = rank, worker_traceback


class WorkerTraceback(Exception):
    """A local worker's own traceback (text), chained as the cause of its `WorkerFailed`."""

    def __str__(self) -> str:
        return "\n" + str(self.args[0]).rstrip()


def _entry(rank: int, fn, world: int, port: int, handed: dict, args: tuple) -> None:
    # torch's spawn ties each worker to the driver's life with SIGINT (its death signal); a driver started with SIGINT
    # ignored (a script's background job) passed that on, and its workers outlived it
    signal.signal(signal.SIGINT, signal.default_int_handler)
    take_over(handed)  # (a worker forked from the fork server: its parent is the server, so tied to the driver there)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      LOCAL_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    fn(rank, *args)


def spawn_workers(fn, nprocs: int, *args, use_gpu: bool = False) -> None:
    """Run ``fn(rank, *args)`` in `nprocs` spawned processes of one process group; returns when all finish."""
    if nprocs < 1:
        raise ValueError(f"parallel.num_workers: {nprocs} must be >= 1")
    if use_gpu:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if nprocs > gpus:
            raise WorkerFailed(f"parallel.num_workers={nprocs} with use_gpu needs {nprocs} GPUs on this machine, "
                               f"which has {gpus}; lower num_workers or use parallel.engine=ray on a cluster")
    port = free_port()
    try:
        ctx = torch.multiprocessing.start_processes(_entry, args=(fn, nprocs, port, handover(), args),
                                                    nprocs=nprocs, join=False, start_method=start_method(use_gpu))
        try:
            while not ctx.join():
                pass
        except KeyboardInterrupt:
            # SIGINT to this process alone (`kill -INT`, a scheduler; a terminal's Ctrl-C reaches the workers too):
            # the workers would train on, and Python's exit would wait for them to finish the stage
            stop_workers(ctx.processes)
            raise
    except torch.multiprocessing.ProcessRaisedException as err:
        trace = str(err).split("terminated with the following error:", 1)[-1].strip("\n")
        lines = [line for line in trace.splitlines() if line.strip()]
        raise WorkerFailed(f"local worker {err.error_index} failed: {lines[-1] if lines else err}",
                           rank=err.error_index, worker_traceback=trace) from WorkerTraceback(trace)
    except torch.multiprocessing.ProcessExitedException as err:
        raise WorkerFailed(f"local worker {err.error_index} died (exit code {err.exit_code}); "
                           "rerun into the same output_dir to resume from the last checkpoint",
                           rank=err.error_index) from None
    finally:  # what killed workers left behind (the others remove theirs at exit)
        remove_shm_buffers("127.0.0.1", port)


def stop_workers(processes, grace: float = 20.0) -> None:
    """Interrupt the live workers (SIGINT: each stops as after Ctrl-C, rank 0 saying where the stage stands), wait up
    to `grace` seconds for them, then kill what is left (a worker blocked in a collective its peer left)."""
    import signal
    import time

    live = [p for p in processes if p.is_alive()]
    for p in live:
        try:
            os.kill(p.pid, signal.SIGINT)
        except (ProcessLookupError, TypeError):
            pass
    deadline = time.monotonic() + grace
    for p in live:
        p.join(max(deadline - time.monotonic(), 0.0))
    for p in live:
        if p.is_alive():
            p.kill()
            p.join(5.0)
