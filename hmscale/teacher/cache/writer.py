"""Writing one shard: a streaming, hashing tar writer that appears atomically."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
import tempfile
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from hmscale.teacher.cache.format import ShardInfo


class _HashingFile:
    """A write-only file wrapper that hashes and counts what passes through.

    sha256 runs on its own thread (hashlib releases the GIL on large buffers), in write order,
    overlapping the file writes; at most `depth` buffers wait to be hashed.
    """

    def __init__(self, f, depth: int = 16):
        self.f = f
        self.sha = hashlib.sha256()
        self.n = 0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-sha256")
        self._pending: deque = deque()
        self._depth = depth

    def write(self, b) -> int:
        mv = memoryview(b).cast("B")
        done = 0
        while done < len(mv):  # raw (unbuffered) writes may be partial
            done += self.f.write(mv[done:])
        if len(mv) >= 1 << 16:
            self._pending.append(self._pool.submit(self.sha.update, mv))
            while len(self._pending) > self._depth:
                self._pending.popleft().result()
        else:
            self.drain()
            self.sha.update(mv)
        self.n += len(mv)
        return len(mv)

    def drain(self) -> None:
        while self._pending:
            self._pending.popleft().result()

    def hexdigest(self) -> str:
        self.drain()
        return self.sha.hexdigest()

    def close(self) -> None:
        self.drain()
        self._pool.shutdown(wait=True)


class ShardWriter:
    """Stream samples into `.{name}.<random>.tmp` beside the final path; `commit()` fsyncs and renames.

    The tar is emitted directly (POSIX/pax headers from `tarfile.TarInfo`, then the .npy header and
    the array's bytes in one write, zero-copy), with fixed metadata (mtime 0, uid 0, mode 0644) so
    the same samples always give the same bytes: a shard redone on another worker has the same
    sha256. Until `commit()` nothing is visible under the final name; `abort()` removes the
    temporary file.
    """

    def __init__(self, path, shard_id: int):
        self.path = Path(path)
        self.shard_id = shard_id
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
        self.tmp = Path(tmp)
        self._raw = os.fdopen(fd, "wb", buffering=0)
        self._hf = _HashingFile(self._raw)
        self.keys: list[str] = []
        self.tokens = 0

    def _member(self, name: str, arr: np.ndarray) -> None:
        arr = np.ascontiguousarray(arr)
        head = io.BytesIO()
        np.lib.format.write_array_header_1_0(head, np.lib.format.header_data_from_array_1_0(arr))
        head = head.getvalue()
        info = tarfile.TarInfo(name)
        info.size = len(head) + arr.nbytes
        info.mtime = 0
        info.mode = 0o644
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        self._hf.write(info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape") + head)
        if arr.nbytes:
            self._hf.write(memoryview(arr).cast("B"))
        pad = -info.size % tarfile.BLOCKSIZE
        if pad:
            self._hf.write(b"\0" * pad)

    def add_sample(self, key: str, arrays: dict[str, np.ndarray]) -> None:
        """Write one sample: `{key}.{field}.npy` for each array, in the given order."""
        for field, arr in arrays.items():
            if arr.dtype.hasobject:
                raise TypeError(f"{key}.{field}: object arrays are never written (they would need pickle)")
            self._member(f"{key}.{field}.npy", arr)
        self.keys.append(key)
        self.tokens += int(arrays["tokens"].size) if "tokens" in arrays else 0

    def commit(self) -> ShardInfo:
        # end of archive: two zero blocks, then zero padding to a whole record (as tarfile does)
        end = 2 * tarfile.BLOCKSIZE
        end += -(self._hf.n + end) % tarfile.RECORDSIZE
        self._hf.write(b"\0" * end)
        os.fsync(self._raw.fileno())
        self._raw.close()
        digest = self._hf.hexdigest()
        self._hf.close()
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
            bytes=self._hf.n,
            samples=len(self.keys),
            tokens=self.tokens,
            keys=list(self.keys),
        )

    def abort(self) -> None:
        try:
            self._hf.close()
        except Exception:
            pass
        try:
            self._raw.close()
        except Exception:
            pass
        self.tmp.unlink(missing_ok=True)


def sha256_file(path, chunk: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()
