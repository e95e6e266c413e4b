"""The local cache engine on several devices of one machine: one process per device (no Ray needed).

`run_processes(..., devices=["cuda:0", "cuda:1"])` starts one worker process per device (spawned for GPUs, forked
from a preloaded server for the CPU: `hmscale.worker_processes`). Each
holds its own copy of the teacher and a `ShardWorker` (several shards in flight, as in one process)
and takes the pending shards round-robin (shards are equal in size, so the split is even). Finished
shards come back to the driver as `ShardInfo`s through a queue; only the driver touches the
manifest. A worker that raises reports the shard and the error; one that dies (killed, out of
memory) is noticed by its exit code. Either way the run stops with a `CacheError` and the shards
already written stay recorded, so rerunning finishes the rest. A stopped run (Ctrl-C, a failure)
still records the shards the other workers report finished before they are stopped (`_drain`); one
finished on disk but never reported is checked and recorded by the next build (`build._adopt_unrecorded`).
"""

from __future__ import annotations

import copy
import os
import pickle
import queue as queue_mod
import signal
import time
import traceback

import torch

from hmscale.teacher.cache.format import CacheError, failure_message, shard_name
from hmscale.worker_processes import context, handover, take_over


def _worker_main(index, device, teacher, plan, spec, cache_dir, batch_size, shard_ids, results, capture_fn, threads,
                 handed=None):
    """Runs in the worker process (`hmscale.worker_processes`; ``handed``: what it takes from the driver): ("ready",
    index, None) once its teacher is on the device, ("done", index, ShardInfo) per shard, then ("exit", index, n);
    ("error", index, (shard, message, traceback, os_error)) on a failure, ``os_error`` (errno, strerror) when it was a
    file-system error (a full disk), else None."""
    # a driver killed (SIGKILL, or SIGTERM: no cleanup runs) interrupts its workers, as torch's spawn does the training
    # engine's: they worked on, orphaned, through every shard dealt to them, holding their devices
    # (a driver started with SIGINT ignored, as a background job of a script is, passes that on to its workers: the
    # death signal would then be ignored too and the workers outlive a killed driver)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    take_over(handed)  # (a worker forked from the fork server: its parent is the server, so tied to the driver there)
    try:
        from torch.multiprocessing import _prctl_pr_set_pdeathsig  # (torch's own spawn uses it; Linux only, else no-op)

        _prctl_pr_set_pdeathsig(signal.SIGINT)
    except (ImportError, AttributeError):  # a torch without it: the workers are not tied to the driver's life
        pass
    try:
        if threads:
            torch.set_num_threads(int(threads))
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        from hmscale.teacher.cache.worker import ShardWorker

        worker = ShardWorker(teacher, plan, spec, cache_dir, batch_size=batch_size, device=device, capture_fn=capture_fn)
        worker.reserve_buffers()
        results.put(("ready", index, None))
        worker.run_shards(shard_ids, lambda info: results.put(("done", index, info)))
        results.put(("exit", index, len(shard_ids)))
    except BaseException as err:  # noqa: BLE001 - everything goes back to the driver
        sid = getattr(err, "shard_id", None)
        os_error = (err.errno, err.strerror) if isinstance(err, OSError) else None
        results.put(("error", index, (sid, f"{type(err).__name__}: {err}", traceback.format_exc(limit=6), os_error)))


def split_round_robin(shard_ids, n: int) -> list[list[int]]:
    """Shard ids dealt to n workers in turn (worker i gets ids[i::n])."""
    ids = list(shard_ids)
    return [ids[i::n] for i in range(n)]


def run_processes(cfg, plan, teacher, cp, pending, on_done, *, devices, log=print, capture_fn=None) -> float:
    """The pending shards on one worker process per entry of `devices`; `on_done(ShardInfo)` runs here.
    Returns the seconds from the start until every worker was ready (process start, imports, teacher load)."""
    devices = [str(d) for d in devices][: max(1, len(pending))]
    n = len(devices)
    if capture_fn is not None:
        try:
            pickle.dumps(capture_fn)
        except Exception as err:  # noqa: BLE001 - any pickling failure means the same thing here
            raise CacheError(f"capture_fn {capture_fn!r} cannot be sent to the worker processes ({type(err).__name__}); "
                             "pass a module-level function, or one device") from None
    ctx = context(use_gpu=any(str(d).startswith("cuda") for d in devices))
    results = ctx.Queue()
    # each process gets a CPU copy of the teacher (the caller's stays where it is)
    on_cpu = all(p.device.type == "cpu" for p in teacher.parameters())
    teacher_cpu = teacher if on_cpu else copy.deepcopy(teacher).to("cpu")
    threads = max(1, (os.cpu_count() or 1) // n)
    parts = split_round_robin(pending, n)
    log(f"cache: {n} worker processes ({', '.join(devices)}), {len(pending)} shards to do")
    procs = []
    for i, (dev, ids) in enumerate(zip(devices, parts)):
        p = ctx.Process(target=_worker_main, name=f"hmscale-cache-{i}",
                        args=(i, dev, teacher_cpu, plan, cp.spec, str(cp.cache_dir), cfg.cache.batch_size, ids,
                              results, capture_fn, threads, handover()),
                        daemon=True)
        p.start()
        procs.append(p)
    running, waiting = set(range(n)), set(range(n))
    t0 = time.perf_counter()
    startup = 0.0
    try:
        try:
            startup = _collect(procs, devices, results, running, waiting, on_done, t0, cp, log)
        except BaseException:
            # stopped (Ctrl-C, a failed worker): the shards the workers finished meanwhile are on disk, their "done"
            # on its way; recorded before the workers are stopped, so the rerun and `cache verify` see them
            _drain(results, running, on_done)
            raise
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=10)
        results.close()
    return startup


def _drain(results, running, on_done, quiet_s: float = 1.0, limit_s: float = 5.0) -> int:
    """Record (``on_done``) the finished shards the workers report after the run stopped: until every worker still
    running has said it stopped (a Ctrl-C reaches them too) or nothing came for ``quiet_s`` (at most ``limit_s``).
    A second Ctrl-C ends it at once. Returns how many were recorded."""
    n, deadline = 0, time.monotonic() + limit_s
    try:
        while running and time.monotonic() < deadline:
            try:
                kind, i, payload = results.get(timeout=quiet_s)
            except queue_mod.Empty:
                break
            if kind == "done":
                try:
                    on_done(payload)
                    n += 1
                except Exception:  # noqa: BLE001 - the run's own error is the one on its way up
                    pass
            elif kind in ("exit", "error"):
                running.discard(i)
    except (KeyboardInterrupt, OSError, EOFError):
        pass
    return n


def _collect(procs, devices, results, running, waiting, on_done, t0, cp, log) -> float:
    """The driver's loop: the workers' messages until each has exited; returns the start-up seconds."""
    n = len(procs)
    startup = 0.0
    while running:
        try:
            kind, i, payload = results.get(timeout=1.0)
        except queue_mod.Empty:
            gone = [j for j in running if procs[j].exitcode is not None]
            if not gone:
                continue
            try:  # gone without saying goodbye: its last messages may still be on their way
                kind, i, payload = results.get(timeout=2.0)
            except queue_mod.Empty:
                j = gone[0]
                running.difference_update(gone)  # (nothing more to wait for from them)
                raise CacheError(f"cache worker {j} on {devices[j]} died (exit code {procs[j].exitcode}); the "
                                 "shards written so far are kept: rerun to finish the others") from None
        if kind == "ready":
            waiting.discard(i)
            if not waiting:
                startup = time.perf_counter() - t0
                log(f"cache: {n} workers ready after {startup:.1f} s")
        elif kind == "done":
            on_done(payload)
        elif kind == "exit":
            running.discard(i)
        else:
            sid, message, tb, os_error = payload
            running.discard(i)
            where = shard_name(sid) if sid is not None else "its start"
            log(f"cache: worker {i} on {devices[i]} failed on {where}:\n{tb}")
            if os_error is not None:  # named as writing the shard (a full disk), as the one-process engine does
                raise CacheError(failure_message(OSError(*os_error), f"{where} (worker {i}, {devices[i]})",
                                                 cp.cache_dir))
            raise CacheError(f"teacher forward failed on {where} (worker {i}, {devices[i]}): {message}")
    return startup
