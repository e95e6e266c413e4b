"""How this machine's worker processes start: the local engine's training ranks (`hmscale.train.launch`) and the
local cache engine's workers (`hmscale.teacher.cache.multiproc`).

A fresh Python process spends seconds of CPU importing torch, DeepSpeed and transformers' GPT-NeoX (which pulls in
torch._dynamo, torch.distributed.tensor and sympy) before it does any work; on a small CPU machine that is most of a
short run's start, and every launch pays it again. So workers that train or cache on the CPU are forked from a
*fork server* (`multiprocessing`'s "forkserver" start method): one clean process, started on the first launch, that
imports those modules once (`PRELOAD`) and then forks a child per worker. A child is a fresh process in every other
respect: it is not a fork of the caller (no threads, locks or process groups of the caller's come along), it
imports the function it runs and its arguments by pickle as a spawned one does, and it runs in the caller's current
directory and with the caller's `sys.path`.

Three things differ from a spawned process, and are handled here (`handover()` in the caller, `take_over(...)` first
thing in the worker):
- the fork server keeps the environment it started with; a worker takes the caller's *current* environment;
- a worker's parent is the server, which outlives a killed caller while its children live: so a worker is tied to
  its caller itself, and is interrupted (SIGINT, as torch's spawn does with its death signal) when the caller dies;
- GPU workers are spawned, never forked from the server: CUDA must not be initialised in a process that forks, and
  nothing promises that every version of the preloaded libraries leaves the driver alone while it imports (on an H100
  host the forked CPU workers found CUDA untouched). A GPU worker's start-up is small next to its GPU work.
"""

from __future__ import annotations

import os

# what the fork server imports once for all its children (a module that fails to import is skipped: the child then
# imports what it needs itself, as a spawned process does)
PRELOAD = [
    "torch",
    "deepspeed",
    "transformers.models.gpt_neox.modeling_gpt_neox",
    "hmscale.models",
    "hmscale.train.stage1",
    "hmscale.train.stage2",
    "hmscale.teacher.cache.worker",
]


def start_method(use_gpu: bool) -> str:
    """"spawn" for workers that use GPUs, "forkserver" (preloaded with `PRELOAD`) for CPU workers."""
    if use_gpu:
        return "spawn"
    import multiprocessing

    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)  # (read when the server first starts)
    return "forkserver"


def context(use_gpu: bool):
    """The multiprocessing context to start workers with (see the module's doc)."""
    import torch.multiprocessing as mp

    return mp.get_context(start_method(use_gpu))


def handover() -> dict:
    """What a worker needs from its caller (this process), to pass in its arguments to `take_over`."""
    return {"env": dict(os.environ), "caller": os.getpid()}


def take_over(handed: dict | None) -> None:
    """In a worker, first thing: the caller's environment as it was when the worker was started, and a SIGINT to this
    process when the caller dies (at once if it already has)."""
    if handed is None:
        return
    env = handed["env"]
    for k in set(os.environ) - set(env):
        del os.environ[k]
    os.environ.update(env)
    _interrupt_when_gone(handed["caller"])


def _interrupt_when_gone(pid: int) -> None:
    import signal
    import threading

    if pid == os.getppid():  # spawned: torch's death signal (or the cache worker's own) already does it
        return
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:  # gone already
        os.kill(os.getpid(), signal.SIGINT)
        return
    except (AttributeError, OSError):  # no pidfd (not Linux >= 5.3): look every second
        fd = None

    def watch():
        import select
        import time

        if fd is not None:
            select.select([fd], [], [])
        else:
            while True:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                except PermissionError:
                    pass
                time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=watch, name="hmscale-caller-watch", daemon=True).start()
