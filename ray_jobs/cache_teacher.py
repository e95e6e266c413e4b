"""Ray teacher-forward workers for the teacher cache.

    python -m ray_jobs.cache_teacher --config configs/x.yaml [-s cache.workers=8 ...]
    ray job submit --working-dir . -- python -m ray_jobs.cache_teacher --config configs/x.yaml

The driver (`hmscale.teacher.cache.build_cache`) plans the cache and owns the manifest; `run_ray`
starts `cache.workers` actors (`num_gpus=1` each when the cluster has GPUs, at most one per GPU),
and hands out pending shard ids from a dynamic queue (fast workers take more shards), up to
`actor_writers` shards in flight per actor: a GPU actor writes several shards concurrently while its
device runs one forward at a time (`ShardWorker`). An actor that dies has its shards put back at the
front of the queue and is replaced (up to
`cache.max_retries` restarts); a shard whose task raises is retried up to `cache.max_retries`
times. Shards are written atomically by the actors, so a dead actor leaves only a hidden
temporary file, which the driver removes at the end.

On a multi-node cluster `cache.root` must be a filesystem every node sees (NFS, Lustre, a mounted
bucket with POSIX rename): actors write the shards there directly, the driver writes the manifest.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
from collections import deque

import ray

from hmscale.teacher.cache.format import CacheError, failure_message, shard_name
from hmscale.teacher.cache.worker import FAULT_ENV, WRITERS_ENV, NonFiniteCapture, writers_from_env


@ray.remote
class CacheWorkerActor:
    """One teacher on one device; `run_shard` calls run concurrently (a threaded actor, `max_concurrency`),
    so several shards are written at once while the device runs one forward at a time."""

    def __init__(self, teacher, plan, spec, cache_dir, batch_size, capture_fn=None, threads=None, writers=None):
        import torch

        from hmscale.teacher.cache.worker import ShardWorker

        if threads:
            torch.set_num_threads(int(threads))
        device = "cuda" if torch.cuda.is_available() and ray.get_gpu_ids() else "cpu"
        self.worker = ShardWorker(teacher, plan, spec, cache_dir, batch_size=batch_size, device=device,
                                  capture_fn=capture_fn, writer_threads=writers)

    def run_shard(self, shard_id: int):
        return self.worker.run_shard(shard_id)

    def stats(self) -> dict:
        return {"pid": os.getpid(), "forwards": self.worker.forwards, "device": str(self.worker.device),
                "writers": self.worker.writer_threads}


def actor_writers(gpus: int, cpus: float) -> int:
    """Shards in flight per actor: $HMSCALE_CACHE_WRITERS, else 1 for CPU actors (the forward needs the
    cores) and the node's cores per GPU / 4, clamped to [2, 8], for GPU actors."""
    env = writers_from_env()
    if env is not None:
        return env
    if not gpus:
        return 1
    return max(2, min(8, int(cpus // max(gpus, 1)) // 4))


# file-system errors a retry elsewhere does not cure (every worker writes into the same cache directory)
_UNRETRYABLE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})


def unretryable(err: BaseException) -> OSError | None:
    """The OSError behind a failed shard task that retrying would only repeat (a full disk), else None."""
    cause = getattr(err, "cause", None)
    return cause if isinstance(cause, OSError) and cause.errno in _UNRETRYABLE else None


def _absolute_stream(plan):
    """The plan as the actors get it: one backed by a cached stream pickles as the stream's path, which an actor opens
    in its own working directory (where its node's Ray started, not this driver's): a relative `data.cache_dir` made
    every actor die in its constructor (FileNotFoundError), restarted until cache.max_retries ran out."""
    path = getattr(plan, "stream_path", None)
    if not path or os.path.isabs(path):
        return plan
    shipped = object.__new__(type(plan))
    shipped.__dict__.update(plan.__dict__)
    shipped.stream_path = os.path.abspath(path)
    return shipped


def _init_failure(err: BaseException) -> str | None:
    """The last line of the error an actor's constructor raised (it died before taking a shard), else None."""
    import re

    if not getattr(err, "actor_init_failed", False):
        return None
    found = [ln.strip() for ln in str(err).splitlines() if re.match(r"\s*[\w.]*(Error|Exception): ", ln)]
    return found[-1][:200] if found else None


def run_ray(cfg, plan, teacher, cp, pending, on_done, *, log=print, capture_fn=None) -> None:
    """Run the pending shards on Ray actors; `on_done(ShardInfo)` is called in the driver per finished shard."""
    from hmscale.ray_cluster import connect

    own = connect(cfg.parallel.ray_address, log=log)
    actors: dict = {}
    try:
        res = ray.cluster_resources()
        gpus = int(res.get("GPU", 0))
        # one CPU (and one GPU, where there are any) per actor: an actor the cluster cannot hold never starts, and the
        # shards dealt to it would wait for it without end
        cpus = max(1, int(res.get("CPU", 1)))
        n = min(cfg.cache.workers, len(pending), min(gpus, cpus) if gpus else cpus)
        if n < min(cfg.cache.workers, len(pending)):
            log(f"cache: cache.workers={cfg.cache.workers}, but the Ray cluster has {cpus} CPU{'s' * (cpus != 1)}"
                f"{f' and {gpus} GPU' + 's' * (gpus != 1) if gpus else ''} in all: {n} workers")
        writers = actor_writers(gpus, res.get("CPU", 1))
        env = {k: os.environ[k] for k in (FAULT_ENV, WRITERS_ENV) if os.environ.get(k)}
        opts = dict(num_gpus=1, num_cpus=1) if gpus else dict(num_cpus=1)
        opts["max_concurrency"] = writers + 1  # + stats()
        if env:
            opts["runtime_env"] = {"env_vars": env}
        teacher_ref, plan_ref = ray.put(teacher.to("cpu")), ray.put(_absolute_stream(plan))
        # CPU actors share the node's cores (the whole cluster's on one node; capped by this node's)
        threads = None if gpus else max(1, min(os.cpu_count() or 1, int(res.get("CPU", 1)) // max(n, 1)))

        # absolute: an actor's working directory is where its node's Ray started, not this driver's (a relative
        # cache.root put the shards under the cluster's directory, the manifest here: every rerun redid them)
        cache_dir = os.path.abspath(cp.cache_dir)

        def start():
            return CacheWorkerActor.options(**opts).remote(
                teacher_ref, plan_ref, cp.spec, cache_dir, cfg.cache.batch_size, capture_fn, threads, writers
            )

        actors.update((i, start()) for i in range(n))
        generation = {i: 0 for i in range(n)}  # bumped when the actor is replaced
        log(f"cache: {n} Ray teacher-forward workers ({'1 GPU' if gpus else '1 CPU'} each, up to {writers} "
            f"shard{'s' if writers > 1 else ''} in flight each), {len(pending)} shards to do")
        queue = deque(pending)
        free = {i: writers for i in range(n)}  # free shard slots per actor
        inflight: dict = {}
        failures: dict[int, int] = {}
        restarts = 0

        # restarted actors still loading (their teacher, their imports): they take work once they answer `stats`, or
        # when no other actor is left; until then the live ones do the queue (a shard dealt to a loading actor waited
        # for it, also where the live actors had the rest done long before)
        fresh: set[int] = set()
        pings: dict = {}  # a restarted actor's `stats` call -> (actor, generation)

        def next_actor():
            up = [i for i in free if i not in fresh] or list(free)
            best = max(up, key=lambda i: (free[i], -i))
            return best if free[best] > 0 else None

        while queue or inflight:
            while queue and (a := next_actor()) is not None:
                free[a] -= 1
                sid = queue.popleft()
                inflight[actors[a].run_shard.remote(sid)] = (a, generation[a], sid)
            ready, _ = ray.wait([*inflight, *pings], num_returns=1)
            ref = ready[0]
            if ref in pings:
                a, gen = pings.pop(ref)
                try:
                    ray.get(ref)
                except Exception:  # died loading: a shard dealt to it (once it is the only one left) says so
                    continue
                if gen == generation[a]:
                    fresh.discard(a)
                continue
            a, gen, sid = inflight.pop(ref)
            try:
                info = ray.get(ref)
            except ray.exceptions.RayActorError as err:
                queue.appendleft(sid)  # the lost shard is done first, by a live worker if there is one
                if gen != generation[a]:  # this actor was already replaced: its other shards come back too
                    free[a] += 1
                    log(f"cache: worker {a} died on {shard_name(sid)} too; the shard goes back to the queue")
                    continue
                restarts += 1
                if restarts > cfg.cache.max_retries:  # (before the line that announces a restart it will not make)
                    why = _init_failure(err)
                    raise CacheError(f"teacher-forward workers died {restarts} times (last on {shard_name(sid)}"
                                     f"{f': {why}' if why else ''}); see the worker logs, or raise "
                                     "cache.max_retries") from None
                log(f"cache: worker {a} died on {shard_name(sid)} ({type(err).__name__}); "
                    f"the shard goes back to the queue, restarting the worker ({restarts}/{cfg.cache.max_retries})")
                try:
                    ray.kill(actors[a])
                except Exception:
                    pass
                actors[a] = start()
                generation[a] += 1
                fresh.add(a)
                pings[actors[a].stats.remote()] = (a, generation[a])
                # the dead actor's other shards keep their slots until their failures come back (free[a] += 1 each)
                free[a] = writers - sum(1 for (b, _, _) in inflight.values() if b == a)
                continue
            except ray.exceptions.RayTaskError as err:
                if (fatal := unretryable(err)) is not None:  # a full disk, a read-only or forbidden directory
                    raise CacheError(failure_message(fatal, f"{shard_name(sid)} (worker {a})", cp.cache_dir)) from None
                if isinstance(getattr(err, "cause", None), NonFiniteCapture):  # the teacher's NaN / inf: any worker
                    raise CacheError(str(err.cause)) from None  # computes the same, so no retry
                failures[sid] = failures.get(sid, 0) + 1
                cause = str(err).strip().splitlines()[-1]
                if failures[sid] > cfg.cache.max_retries:  # (before the line that announces a retry it will not make)
                    raise CacheError(f"{shard_name(sid)} failed {failures[sid]} times; last error: {cause}") from None
                log(f"cache: {shard_name(sid)} failed on worker {a} ({cause}); retry {failures[sid]}/{cfg.cache.max_retries}")
                queue.append(sid)
                free[a] += 1
                continue
            free[a] += 1
            if gen == generation[a]:
                fresh.discard(a)
            on_done(info)
    finally:
        # also when a shard's error ends the build: on a joined cluster the actors would hold their CPUs (and GPUs)
        # for as long as the driver lives (the error's traceback keeps their handles)
        for actor in actors.values():
            try:
                ray.kill(actor)
            except Exception:
                pass
        if own:
            ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    from hmscale.config import ConfigError, load_config
    from hmscale.teacher.cache import build_cache

    ap = argparse.ArgumentParser(prog="python -m ray_jobs.cache_teacher", description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=None, help="YAML config (default: the embedded demo config)")
    ap.add_argument("-s", "--set", dest="overrides", action="append", default=[], help="dotted override, repeatable")
    ap.add_argument("--engine", default="ray", choices=["ray", "local"])
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        from hmscale.submit import job_copy_refusal

        if (refusal := job_copy_refusal(cfg)) is not None:
            raise ConfigError(refusal)
        path = build_cache(cfg, engine=args.engine)
    except ConfigError as err:
        print(f"cache_teacher: error: {err}", file=sys.stderr)
        return 2
    except CacheError as err:
        print(f"cache_teacher: error: {err}", file=sys.stderr)
        return 1
    except (ValueError, OSError, RuntimeError) as err:  # the data or the teacher (a non-UTF-8 file, a missing model)
        print(f"cache_teacher: error: {str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__}",
              file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
