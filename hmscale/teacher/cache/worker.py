"""The teacher-forward worker: one shard id in, one verified shard file out.

Used as-is by the local engine and wrapped in a Ray actor by `ray_jobs.cache_teacher`.

Where the time goes and how it overlaps (on a GPU):

* the frozen teacher runs under `torch.no_grad`, and the stored form of every field (bf16 bits,
  fp8 + scales, the kept positions, top-k) is computed on the device, so only the stored bytes
  cross to the host;
* those bytes go device -> host with non-blocking copies on a side stream into pinned buffers
  (a bounded pool, reused), overlapping the next teacher forward;
* the tar bytes are written straight from the pinned buffers (no intermediate copy) on the
  shard's writer thread, sha256 runs on its own thread over the same buffers as they are written;
* several shards are in flight at once (`run_shards`, `writer_threads`): one forward at a time on
  the device (all on the worker's one launcher thread), several writers on the host. Each shard is
  still written by one thread in a fixed order, so its bytes (and sha256) never depend on thread timing.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from hmscale.teacher.cache.format import (
    BUILDERS,
    STORAGE_TORCH,
    CacheError,
    CaptureSpec,
    ShardInfo,
    TeacherShape,
    check_sample_key,
    encode_tensor,
    layer_field,
    layout,
    positions_for,
    shard_name,
)
from hmscale.teacher.cache.writer import ShardWriter
from hmscale.teacher.whole_sequences import whole_sequences

class NonFiniteCapture(CacheError):
    """The teacher computed NaN or inf values for a shard: the same on any worker, so not worth a retry."""


_NONFINITE = "__nonfinite__"  # the pinned buffer of a batch's NaN / inf flags (not a stored field)
FAULT_ENV = "HMSCALE_CACHE_FAULT"  # "SHARD:MARKER": die (os._exit) mid-way through SHARD once (tests)
WRITERS_ENV = "HMSCALE_CACHE_WRITERS"  # shards in flight per worker (default: default_writer_threads)


def writers_from_env() -> int | None:
    """$HMSCALE_CACHE_WRITERS as a number of shards in flight (at least 1), or None when unset; anything but an integer
    is refused in one line naming the variable (int() said only "invalid literal ... 'four'")."""
    env = os.environ.get(WRITERS_ENV, "").strip()
    if not env:
        return None
    try:
        return max(1, int(env))
    except ValueError:
        raise CacheError(f"{WRITERS_ENV}={env!r} is not a number of shards written at once per worker; set it to a "
                         "positive integer (e.g. 4), or unset it for the default") from None


def default_writer_threads(device) -> int:
    """Shards written concurrently by one worker: $HMSCALE_CACHE_WRITERS, else 1 on CPU (the forward
    itself needs the cores) and cores/2 clamped to [2, 8] on a GPU (a shard's thread writes and hashes; on a 16-core
    H100 host one layer a pass to tmpfs ran +13.6 % over the forward alone with 4 writers against +6.5 / +1.2 % with 8,
    and an H200 host +29.1 % with 12: BENCHMARKS.md, "Teacher cache")."""
    env = writers_from_env()
    if env is not None:
        return env
    if torch.device(device).type != "cuda":
        return 1
    return max(2, min(8, (os.cpu_count() or 16) // 2))


def default_capture_fn():
    """`hmscale.teacher.capture.capture_layers` (the teacher owner's hooks)."""
    from hmscale.teacher.capture import capture_layers

    return capture_layers


def _default_capture(teacher, input_ids, layers=None):
    return default_capture_fn()(teacher, input_ids, layers=layers, qkv=False)


def _fault_point(shard_id: int) -> None:
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    sid, marker = spec.split(":", 1)
    if int(sid) == shard_id and not os.path.exists(marker):
        Path(marker).write_text(f"killed pid {os.getpid()} mid-way through shard {shard_id}\n")
        os._exit(17)


# ---------------------------------------------------------------------------------- pinned buffers


class _BufferPool:
    """At most `limit` sets of pinned host buffers (one tensor per device field, batch-sized), reused.

    `acquire` blocks while all are in use; a set goes back with `release` (called from the hash
    thread once its bytes are written and hashed).
    """

    def __init__(self, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]], limit: int, pin: bool = True):
        self.shapes = shapes
        self.pin = pin
        self.limit = max(1, int(limit))
        self._free: list[dict] = []
        self._made = 0
        self._cv = threading.Condition()
        self.alloc_s = 0.0
        self.wait_s = 0.0

    def _make(self) -> dict:
        t = time.perf_counter()
        bufs = {k: torch.empty(shp, dtype=dt, pin_memory=self.pin) for k, (shp, dt) in self.shapes.items()}
        self.alloc_s += time.perf_counter() - t
        return bufs

    def acquire(self) -> dict:
        with self._cv:
            if self._free:
                return self._free.pop()
            if self._made < self.limit:
                self._made += 1  # (made below, outside the lock)
            else:
                t = time.perf_counter()
                while not self._free:
                    self._cv.wait()
                self.wait_s += time.perf_counter() - t
                return self._free.pop()
        try:
            return self._make()  # outside the lock: pinning hundreds of MB takes a while
        except BaseException:
            with self._cv:
                self._made -= 1
                self._cv.notify()
            raise

    def release(self, bufs: dict) -> None:
        with self._cv:
            self._free.append(bufs)
            self._cv.notify()

    def reserve(self, n: int) -> None:
        """Allocate up to n sets now (so the first shards do not pay for pinning)."""
        got = [self.acquire() for _ in range(min(n, self.limit))]
        for b in got:
            self.release(b)

    @property
    def bytes(self) -> int:
        return self._made * sum(int(np.prod(s)) * torch.empty((), dtype=d).element_size() for s, d in self.shapes.values())


def sorted_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of fp32 ``x`` along its last dim, largest first and ties by the lower index: the first k of a
    stable descending sort. So a top-k is the prefix of every larger top-K, which a view reading the first k of its
    source's top-K relies on (``reuse``), and the same on every device. ``torch.topk`` alone picks and orders tied
    values as it likes, differently for another k (a bfloat16 teacher's log-probs tie often). One more pass over
    ``x``, no sort of it; ``x`` is overwritten."""
    vals, idx = x.topk(k, dim=-1)  # largest first
    t = vals[..., -1:]  # the k-th largest: those above it are in every top-k, the rest are ties at it
    above = (vals > t).sum(-1, keepdim=True)
    ties = x == t
    key = torch.where(ties, -torch.arange(x.shape[-1], device=x.device, dtype=x.dtype),
                      torch.tensor(float("-inf"), device=x.device, dtype=x.dtype), out=x)
    lowest = key.topk(k, dim=-1).indices  # the ties, lowest index first (distinct keys: a fixed order)
    j = torch.arange(k, device=x.device)
    idx = torch.where(j < above, idx, lowest.gather(-1, (j - above).clamp(min=0)))
    order = idx.sort(dim=-1).indices  # then: by index, and stably by value, largest first
    idx, vals = idx.gather(-1, order), vals.gather(-1, order)
    order = vals.sort(dim=-1, descending=True, stable=True).indices
    return vals.gather(-1, order), idx.gather(-1, order)


@dataclass
class _Batch:
    """One teacher batch in flight: the stored arrays (host views), and what must finish before they are read."""

    keys: list
    tokens: np.ndarray
    seq_idx: np.ndarray
    positions: list
    arrays: dict  # field -> (b, ...) numpy array in the stored dtype, in layout order
    ready: object = None  # torch.cuda.Event: the device->host copies are done
    hold: list = field(default_factory=list)  # device tensors kept alive until `ready`
    bufs: dict | None = None  # the pinned buffer set (goes back to the pool after writing + hashing)
    nonfinite: tuple = ()  # (field names, (b, fields) bool host tensor): which rows of which field hold NaN / inf


class ShardWorker:
    def __init__(self, teacher, plan, spec: CaptureSpec, cache_dir, *, batch_size: int = 8, device=None, capture_fn=None,
                 writer_threads: int | None = None, max_buffers: int | None = None, staged: bool | None = None):
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.teacher = teacher.to(self.device).eval().requires_grad_(False)
        self.plan = plan
        self.spec = spec
        self.shape = TeacherShape.of(self.teacher)
        self.cache_dir = Path(cache_dir)
        self.batch_size = int(batch_size)
        self.capture_fn = capture_fn or _default_capture
        self.forwards = 0  # teacher forwards run (tests assert a cached rerun runs none)
        self.writer_threads = int(writer_threads or default_writer_threads(self.device))
        # every forward (and its copies) runs on one launcher thread, made on first use and kept for the worker's
        # life: one at a time on the device, and what the libraries set up per thread is paid once, not by each
        # writer thread of every `run_shards` call (torch's SDPA took 80-190 ms in a thread's first calls on an H100)
        self._lock = threading.Lock()
        self._launcher = None
        self._launcher_pid = None
        self.cuda = self.device.type == "cuda"
        fields = layout(spec, self.shape, plan.seq_len)
        self.host_fields = ("tokens", "seq_idx", "positions")
        # the fields computed on the device, in layout order -> FieldSpec (npy dtype, shape per sample)
        self.dev_fields = {k: f for k, f in fields.items() if k not in self.host_fields}
        self._pool = None
        self._copy_stream = None
        # staged: the stored bytes are copied into a pool of (pinned) host buffers; always on a GPU, on
        # request on the CPU (tests exercise the buffer path there)
        self.staged = self.cuda if staged is None else bool(staged)
        # the float fields checked for NaN / inf before anything is stored (`_check_finite`), in layout order
        self.checked = tuple(k for k in self.dev_fields if k != "topk_indices" and not k.endswith("_scale"))
        if self.staged:
            shapes = {k: ((self.batch_size, *f.shape), self._torch_dtype(k)) for k, f in self.dev_fields.items()}
            shapes[_NONFINITE] = ((self.batch_size, len(self.checked)), torch.bool)
            # one set per shard being written, +2 so the device can run ahead (the host is the slower side)
            self._pool = _BufferPool(shapes, max_buffers or self.writer_threads + 2, pin=self.cuda)
        if self.cuda:
            self._copy_stream = torch.cuda.Stream(self.device)

    def _storage(self, name: str) -> str | None:
        if name == "topk_logprobs":
            return self.spec.topk_dtype
        if name == "topk_indices" or name.endswith("_scale"):
            return None
        return self.spec.dtype

    def _host(self, t: torch.Tensor, name: str) -> np.ndarray:
        """A host tensor of stored bits -> the numpy array written (a view, the layout's npy dtype)."""
        return t.numpy().view(np.dtype(self.dev_fields[name].npy_dtype))

    def _torch_dtype(self, name: str) -> torch.dtype:
        if name == "topk_indices":
            return torch.int16 if self.shape.vocab_size <= 65536 else torch.int32
        if name.endswith("_scale"):
            return torch.float32
        return STORAGE_TORCH[self._storage(name)]

    def reserve_buffers(self, n: int | None = None) -> float:
        """Pin the host buffers now (default: as many as the writers can use); returns the seconds it took."""
        if self._pool is None:
            return 0.0
        t = time.perf_counter()
        self._pool.reserve(n or self._pool.limit)
        return time.perf_counter() - t

    # ------------------------------------------------------------------ one batch on the device

    def _on_launcher(self, fn, *args):
        """Run ``fn(*args)`` on the launcher thread and return its result (raise its error)."""
        with self._lock:
            # a forked child holds a copy of the executor but not its thread: it makes its own
            if self._launcher is None or self._launcher_pid != os.getpid():
                self._launcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cache-launch")
                self._launcher_pid = os.getpid()
        return self._launcher.submit(fn, *args).result()

    def warm_up(self) -> None:
        """One forward of the plan's first batch on the launcher thread (its first-call costs, before any timing)."""
        self._on_launcher(self.forward_batch, self.plan.sequences(0, self.batch_size)[0])

    @torch.no_grad()
    def forward_batch(self, tokens: np.ndarray) -> dict:
        """Device tensors per field for a batch (b, L): per-layer captures (as computed) and top-k."""
        ids = torch.from_numpy(np.ascontiguousarray(tokens)).long()
        if self.device.type == "cuda":  # pinned, so the copy does not wait for the batch before
            ids = ids.pin_memory().to(self.device, non_blocking=True)
        else:
            ids = ids.to(self.device)
        layers = list(self.spec.layers) if self.spec.tensors else []
        logits = None
        if self.spec.topk and self.capture_fn is _default_capture:
            # one full forward with the hooks on: the layer captures and the logits together
            from hmscale.teacher.capture import capture_hooks

            with capture_hooks(self.teacher, layers, qkv=False) as cap, whole_sequences(self.teacher):
                logits = self.teacher(input_ids=ids, use_cache=False).logits
            caps = cap.results
        else:
            caps = self.capture_fn(self.teacher, ids, layers=layers) if layers else {}
            if self.spec.topk:
                with whole_sequences(self.teacher):
                    logits = self.teacher(input_ids=ids, use_cache=False).logits
        self.forwards += 1
        out = {}
        for i in layers:
            cap = caps[i]
            for t in self.spec.tensors:
                x = getattr(cap, t)
                if t == "attn_output" and x.dim() == 3:  # (b, l, h*p) -> (b, l, h, p)
                    x = x.reshape(*x.shape[:2], self.shape.n_heads, self.shape.head_dim)
                out[layer_field(i, t)] = x
        if self.spec.topk:
            logp = torch.log_softmax(logits.float(), dim=-1)
            out["topk_logprobs"], out["topk_indices"] = sorted_topk(logp, self.spec.topk)
        return out

    @torch.no_grad()
    def encode_device(self, dev: dict, positions: list, nonfinite: dict | None = None) -> dict[str, torch.Tensor]:
        """Captures -> the stored bits of every device field (layout order), computed where they are.

        ``nonfinite``, when given, receives per checked field a (b,) bool tensor on the device: the rows whose stored
        values would be NaN or inf (the kept positions only; a top-k log-prob of -inf, a zero probability, is kept)."""
        enc = {}
        idx = None
        if positions[0] is not None:
            rows = torch.arange(len(positions), device=self.device)[:, None]
            idx = (rows, torch.from_numpy(np.stack(positions)).long().to(self.device))
        for name, x in dev.items():
            if name == "topk_logprobs":
                if nonfinite is not None:
                    nonfinite[name] = (torch.isnan(x) | torch.isposinf(x)).flatten(1).any(1)
                enc[name] = encode_tensor(x, self.spec.topk_dtype)[0]
            elif name == "topk_indices":
                if self.shape.vocab_size <= 65536:  # uint16 bits in an int16 tensor
                    enc[name] = torch.where(x >= 32768, x - 65536, x).to(torch.int16)
                else:
                    enc[name] = x.to(torch.int32)
            else:
                if name.endswith("attn_output") and idx is not None:
                    x = x[idx]  # (b, m, h, p): the kept positions of each row
                if nonfinite is not None:
                    nonfinite[name] = ~torch.isfinite(x).flatten(1).all(1)
                q, scale = encode_tensor(x, self.spec.dtype)
                enc[name] = q
                if scale is not None:
                    enc[name + "_scale"] = scale
        return {k: enc[k].contiguous() for k in self.dev_fields}

    def launch(self, keys, tokens, seq_idx) -> _Batch:
        """Teacher forward + device-side encode for one batch, and (on a GPU) the non-blocking copies
        into a pinned buffer set, run on the worker's launcher thread; returns at once on a GPU (the batch is `ready`
        later). The caller takes a buffer set first: with all in use it waits here, not the launcher."""
        L = tokens.shape[1]
        pos = [positions_for(self.spec, k, L) for k in keys]
        bufs = self._pool.acquire() if self._pool is not None else None
        try:
            return self._on_launcher(self._launch, keys, tokens, seq_idx, pos, bufs)
        except BaseException:
            if bufs is not None:
                self._pool.release(bufs)
            raise

    def _launch(self, keys, tokens, seq_idx, pos, bufs) -> _Batch:
        """`launch`'s device work, on the launcher thread (``bufs`` go back to the pool in `launch` on an error)."""
        b = len(keys)
        bad: dict = {}
        if not self.cuda:
            enc = self.encode_device(self.forward_batch(tokens), pos, bad)
            flags = self._flags(bad, b)
            if not self.staged:
                arrays = {k: self._host(t, k) for k, t in enc.items()}
                return _Batch(keys, tokens, seq_idx, pos, arrays, nonfinite=(self.checked, flags))
            for k, t in enc.items():
                bufs[k][:b].copy_(t)
            bufs[_NONFINITE][:b].copy_(flags)
            ready = None
        else:
            with torch.cuda.device(self.device):
                enc = self.encode_device(self.forward_batch(tokens), pos, bad)
                flags = self._flags(bad, b)
                compute = torch.cuda.current_stream(self.device)
                self._copy_stream.wait_stream(compute)
                with torch.cuda.stream(self._copy_stream):
                    for k, t in enc.items():
                        bufs[k][:b].copy_(t, non_blocking=True)
                    bufs[_NONFINITE][:b].copy_(flags, non_blocking=True)
                    ready = torch.cuda.Event(blocking=True)  # the waiting writer sleeps, not spins
                    ready.record(self._copy_stream)
        arrays = {k: self._host(bufs[k][:b], k) for k in enc}
        return _Batch(keys, tokens, seq_idx, pos, arrays, ready=ready, hold=[*enc.values(), flags], bufs=bufs,
                      nonfinite=(self.checked, bufs[_NONFINITE][:b]))

    def _flags(self, bad: dict, b: int) -> torch.Tensor:
        """(b, checked fields) bool on the device: which rows of which field hold NaN / inf."""
        if not self.checked:
            return torch.zeros((b, 0), dtype=torch.bool, device=self.device)
        return torch.stack([bad[k] for k in self.checked], dim=1)

    @staticmethod
    def _check_finite(batch: _Batch, shard_id: int) -> None:
        """Refuse a batch whose stored values would hold NaN or inf (a damaged teacher, an overflow): every run reusing
        the cache would train on them (in fp8 an inf turns its whole row into NaN)."""
        names, flags = batch.nonfinite or ((), None)
        if flags is None or not names or not bool(flags.any()):
            return
        row, col = (int(i) for i in flags.nonzero()[0])
        raise NonFiniteCapture(
            f"the teacher computed NaN or inf values in {names[col]} of sample {batch.keys[row]} ({shard_name(shard_id)}); "
            "the cache stores no shard holding them: check the teacher (its weights; teacher.dtype=float32 if bfloat16 "
            f"overflows), then rerun {BUILDERS} (the shards written so far are kept)")

    def _release(self, batch: _Batch) -> None:
        if batch is not None and batch.bufs is not None:
            bufs, batch.bufs = batch.bufs, None
            self._pool.release(bufs)

    def write_batch(self, writer: ShardWriter, batch: _Batch, stats: dict) -> None:
        """Append the batch's samples to the shard (in row order); its buffers go back once hashed."""
        if batch.ready is not None:
            t = time.perf_counter()
            batch.ready.synchronize()
            stats["d2h_wait_s"] = stats.get("d2h_wait_s", 0.0) + time.perf_counter() - t
        batch.hold = []
        self._check_finite(batch, writer.shard_id)
        for j, key in enumerate(batch.keys):
            arrays = {"tokens": np.ascontiguousarray(batch.tokens[j], dtype=np.int32),
                      "seq_idx": np.ascontiguousarray(batch.seq_idx[j], dtype=np.int32)}
            if batch.positions[j] is not None:
                arrays["positions"] = batch.positions[j]
            for name, arr in batch.arrays.items():
                arrays[name] = arr[j]
            writer.add_sample(key, arrays)
        if batch.bufs is not None:
            bufs, batch.bufs = batch.bufs, None
            writer.after(lambda: self._pool.release(bufs))

    # ------------------------------------------------------------------ one shard

    def run_shard(self, shard_id: int) -> ShardInfo:
        """Write one shard (thread-safe: several shards may run at once, see `run_shards`).

        Batch i+1 is launched (forward + copies) before batch i is written, and the writing runs on a
        helper thread, so the device and the host overlap within a shard too.
        """
        t0 = time.perf_counter()
        shard = self.plan.shard(shard_id)
        keys = [check_sample_key(k) for k in shard["keys"]]
        tokens, seq_idx = shard["tokens"], shard["seq_idx"]
        writer = ShardWriter(self.cache_dir / shard_name(shard_id), shard_id)
        stats: dict = {}
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"shard-{shard_id}-write")
        pending = None  # (future, batch) being written
        nxt = None
        try:
            for b0 in range(0, len(keys), self.batch_size):
                sl = slice(b0, b0 + self.batch_size)
                nxt = self.launch(keys[sl], tokens[sl], seq_idx[sl])
                if pending is not None:
                    pending[0].result()
                    pending = None
                    if b0 >= len(keys) // 2:
                        _fault_point(shard_id)
                pending = (pool.submit(self.write_batch, writer, nxt, stats), nxt)
                nxt = None
            if pending is not None:
                pending[0].result()
                pending = None
            _fault_point(shard_id)
            info = writer.commit()
        except BaseException:
            if pending is not None:
                try:
                    pending[0].result()
                except BaseException:
                    pass
                self._release(pending[1])
            self._release(nxt)
            writer.abort()
            raise
        finally:
            pool.shutdown(wait=True)
        info.seconds = time.perf_counter() - t0
        info.stats.update(stats)
        return info

    def run_shards(self, shard_ids, on_done=None, *, threads: int | None = None) -> list[ShardInfo]:
        """Write several shards, up to `threads` (default `writer_threads`) at once; `on_done(info)` runs in
        the calling thread as each finishes. On an error the shards not started are skipped, those in
        flight finish (and are reported), then the first error is raised with `.shard_id` set."""
        threads = max(1, int(threads or self.writer_threads))
        ids = list(shard_ids)
        if threads == 1 or len(ids) <= 1:
            out = []
            for sid in ids:
                try:
                    info = self.run_shard(sid)
                except BaseException as err:
                    err.shard_id = sid
                    raise
                out.append(info)
                if on_done is not None:
                    on_done(info)
            return out
        out, error = [], None
        ex = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="cache-shard")
        try:
            futs = {ex.submit(self.run_shard, sid): sid for sid in ids}
            todo = set(futs)
            while todo:
                done, todo = wait(todo, return_when=FIRST_COMPLETED)
                for fut in sorted(done, key=lambda f: futs[f]):
                    if fut.cancelled():
                        continue
                    err = fut.exception()
                    if err is None:
                        info = fut.result()
                        out.append(info)
                        if on_done is None:
                            continue
                        try:
                            on_done(info)
                            continue
                        except BaseException as cb_err:
                            err = cb_err
                    if error is None:
                        error = err
                        if getattr(error, "shard_id", None) is None:
                            error.shard_id = futs[fut]
                        for other in todo:
                            other.cancel()
        finally:
            ex.shutdown(wait=True, cancel_futures=True)
        if error is not None:
            raise error
        return out
