"""Writing one shard: a streaming, hashing tar writer that appears atomically.

One `ShardWriter` is fed by one thread, in order; the shard's bytes are a function of the samples
alone (fixed tar metadata, fixed member order), never of thread timing. Several writers can run
at once on different shards (file writes, sha256 and fsync all release the GIL): that is how the
worker reaches several GB/s of host writes (`ShardWorker.run_shards`).
"""

from __future__ import annotations

import ctypes
import hashlib
import io
import os
import sys
import tarfile
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from hmscale.teacher.cache.format import ShardInfo

try:
    import fcntl
except ImportError:  # not POSIX: no locks, temporaries are told apart by nothing
    fcntl = None

_SMALL = 1 << 16  # writes below this are coalesced (tar/npy headers, padding)
_WRITEBACK_MIN = 64 << 20  # start the disk writing of what is written once this much is pending


def _sync_file_range():
    """libc's sync_file_range (Linux), or None: lets the disk write a shard while the rest is produced."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SFR = _sync_file_range()
_SFR_WRITE = 2  # SYNC_FILE_RANGE_WRITE: start writeback of dirty pages in the range, do not wait


class _HashingSink:
    """Writes to an fd and feeds the same bytes, in the same order, to sha256 on a helper thread.

    The file write happens in the caller's thread, the hash on one helper thread (hashlib releases
    the GIL on large buffers), so the two overlap. Large buffers are passed by reference (no copy):
    the caller must keep them unchanged until `after()` callbacks queued behind them have run.
    Small writes are coalesced into one buffer, written and hashed as one piece.
    """

    def __init__(self, fd: int):
        self.fd = fd
        self.sha = hashlib.sha256()
        self.n = 0
        self._small = bytearray()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-sha256")
        self._last = None
        self.write_s = 0.0
        self.on_disk = 0  # bytes handed to the file
        self._wb = 0  # bytes whose writeback was started

    def _out(self, mv) -> None:
        t = time.perf_counter()
        done, n = 0, len(mv)
        while done < n:  # os.write may be partial
            done += os.write(self.fd, mv[done:])
        self.on_disk += n
        if _SFR is not None and self.on_disk - self._wb >= _WRITEBACK_MIN:
            # the final fsync then waits for the tail only, not for the whole shard (a ctypes call
            # releases the GIL); errors (a filesystem without it) only mean no early start
            _SFR(self.fd, self._wb, self.on_disk - self._wb, _SFR_WRITE)
            self._wb = self.on_disk
        self.write_s += time.perf_counter() - t
        self._last = self._pool.submit(self.sha.update, mv)  # FIFO: one worker, hashes in write order

    def _flush_small(self) -> None:
        if self._small:
            buf, self._small = bytes(self._small), bytearray()
            self._out(memoryview(buf))

    def write(self, b) -> None:
        mv = memoryview(b).cast("B")
        if not len(mv):
            return
        self.n += len(mv)
        if len(mv) < _SMALL:
            self._small += mv
            if len(self._small) >= _SMALL:
                self._flush_small()
        else:
            self._flush_small()
            self._out(mv)

    def after(self, fn) -> None:
        """Run `fn()` on the hash thread once every byte written so far has been hashed (e.g. free a buffer)."""
        self._flush_small()
        self._last = self._pool.submit(fn)

    def finish(self) -> str:
        self._flush_small()
        if self._last is not None:
            self._last.result()
        return self.sha.hexdigest()

    def close(self) -> None:
        self._pool.shutdown(wait=True)  # runs every queued hash / callback (buffers get released)


def _npy_header(arr: np.ndarray) -> bytes:
    head = io.BytesIO()
    np.lib.format.write_array_header_1_0(head, np.lib.format.header_data_from_array_1_0(arr))
    return head.getvalue()


class ShardWriter:
    """Stream samples into `.{name}.<random>.tmp` beside the final path; `commit()` fsyncs and renames.

    The tar is emitted directly (POSIX/pax headers from `tarfile.TarInfo`, then the .npy header, then
    the array's own bytes, zero-copy), with fixed metadata (mtime 0, uid 0, mode 0644) so the same
    samples always give the same bytes: a shard redone on another worker, or written while other
    shards are written concurrently, has the same sha256. sha256 is computed from the bytes as they
    are written (no re-read). Until `commit()` nothing is visible under the final name; `abort()`
    removes the temporary file.
    """

    def __init__(self, path, shard_id: int):
        self.path = Path(path)
        self.shard_id = shard_id
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = _locked_temporary(self.path)
        self.tmp = Path(tmp)
        self._fd = fd
        self._sink = _HashingSink(fd)
        self.keys: list[str] = []
        self.tokens = 0
        self.stats = {"write_s": 0.0, "hash_wait_s": 0.0, "fsync_s": 0.0}
        self._closed = False

    def _member(self, name: str, arr: np.ndarray) -> None:
        if not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(arr)
        head = _npy_header(arr)
        info = tarfile.TarInfo(name)
        info.size = len(head) + arr.nbytes
        info.mtime = 0
        info.mode = 0o644
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        self._sink.write(info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape") + head)
        if arr.nbytes:
            self._sink.write(memoryview(arr.reshape(-1).view(np.uint8)))
        pad = -info.size % tarfile.BLOCKSIZE
        if pad:
            self._sink.write(b"\0" * pad)

    def add_sample(self, key: str, arrays: dict[str, np.ndarray]) -> None:
        """Write one sample: `{key}.{field}.npy` for each array, in the given order.

        Large arrays are written by reference: keep them unchanged until a later `after()` callback
        runs (or the shard is committed / aborted).
        """
        for field, arr in arrays.items():
            if arr.dtype.hasobject:
                raise TypeError(f"{key}.{field}: object arrays are never written (they would need pickle)")
            self._member(f"{key}.{field}.npy", arr)
        self.keys.append(key)
        self.tokens += int(arrays["tokens"].size) if "tokens" in arrays else 0

    def after(self, fn) -> None:
        """Call `fn()` (on the hash thread) once everything written so far is hashed: buffers can be reused then."""
        self._sink.after(fn)

    def commit(self) -> ShardInfo:
        # end of archive: two zero blocks, then zero padding to a whole record (as tarfile does)
        end = 2 * tarfile.BLOCKSIZE
        end += -(self._sink.n + end) % tarfile.RECORDSIZE
        self._sink.write(b"\0" * end)
        t = time.perf_counter()
        digest = self._sink.finish()
        self.stats["hash_wait_s"] = time.perf_counter() - t
        self._sink.close()
        t = time.perf_counter()
        os.fsync(self._fd)
        self.stats["fsync_s"] = time.perf_counter() - t
        os.close(self._fd)
        self._closed = True
        self.stats["write_s"] = self._sink.write_s
        os.chmod(self.tmp, 0o644)  # mkstemp makes 0600; a cache is shared
        os.replace(self.tmp, self.path)
        try:  # make the rename durable
            dfd = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError:
            pass
        return ShardInfo(
            shard=self.shard_id,
            file=self.path.name,
            sha256=digest,
            bytes=self._sink.n,
            samples=len(self.keys),
            tokens=self.tokens,
            keys=list(self.keys),
            stats=dict(self.stats),
        )

    def abort(self) -> None:
        try:
            self._sink.close()
        except Exception:
            pass
        if not self._closed:
            self._closed = True
            try:
                os.close(self._fd)
            except OSError:
                pass
        self.tmp.unlink(missing_ok=True)


def _locked_temporary(path: Path) -> tuple[int, str]:
    """A new `.{name}.<random>.tmp` beside ``path``, open and flock-ed for as long as this process writes it, so
    that another build's cleanup (``remove_stale_temporary``) leaves it alone; the lock dies with the process."""
    while True:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        if fcntl is None:
            return fd, tmp
        fcntl.flock(fd, fcntl.LOCK_EX)  # waits out a cleanup that took the fresh file for a leftover...
        if os.fstat(fd).st_nlink:
            return fd, tmp
        os.close(fd)  # ...and removed it before the lock: take another name


def remove_stale_temporary(path) -> bool:
    """Remove a shard temporary left by a dead writer; True when removed. One that a live writer (of any process on
    any host sharing the filesystem) holds locked is kept, and so is one whose lock cannot be tested."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # held by a live writer (or locks unsupported): not ours to remove
                return False
        Path(path).unlink(missing_ok=True)
        return True
    finally:
        os.close(fd)


def sha256_file(path, chunk: int = 8 << 20) -> str:
    h = hashlib.sha256()
    buf = bytearray(chunk)
    mv = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(mv[:n])
    return h.hexdigest()
