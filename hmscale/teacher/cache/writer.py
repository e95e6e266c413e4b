"""Writing one shard: a streaming, hashing tar writer that appears atomically."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
import tempfile
from pathlib import Path

import numpy as np

from hmscale.teacher.cache.format import ShardInfo, npy_bytes


class _HashingFile:
    """A write-only file wrapper that hashes and counts what passes through."""

    def __init__(self, f):
        self.f = f
        self.sha = hashlib.sha256()
        self.n = 0

    def write(self, b) -> int:
        self.f.write(b)
        self.sha.update(b)
        self.n += len(b)
        return len(b)

    def tell(self) -> int:
        return self.n


class ShardWriter:
    """Stream samples into `.{name}.<random>.tmp` beside the final path; `commit()` fsyncs and renames.

    Members are written with fixed metadata (mtime 0, uid 0, mode 0644) so the same samples
    always give the same bytes: a shard redone on another worker has the same sha256.
    Until `commit()` nothing is visible under the final name; `abort()` removes the temporary file.
    """

    def __init__(self, path, shard_id: int):
        self.path = Path(path)
        self.shard_id = shard_id
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
        self.tmp = Path(tmp)
        self._raw = os.fdopen(fd, "wb", buffering=1 << 20)
        self._hf = _HashingFile(self._raw)
        self._tar = tarfile.open(fileobj=self._hf, mode="w|", format=tarfile.PAX_FORMAT)
        self.keys: list[str] = []
        self.tokens = 0

    def _member(self, name: str, data: bytes) -> None:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        info.mtime = 0
        info.mode = 0o644
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        self._tar.addfile(info, io.BytesIO(data))

    def add_sample(self, key: str, arrays: dict[str, np.ndarray]) -> None:
        """Write one sample: `{key}.{field}.npy` for each array, in the given order."""
        for field, arr in arrays.items():
            self._member(f"{key}.{field}.npy", npy_bytes(arr))
        self.keys.append(key)
        self.tokens += int(arrays["tokens"].size) if "tokens" in arrays else 0

    def commit(self) -> ShardInfo:
        self._tar.close()
        self._raw.flush()
        os.fsync(self._raw.fileno())
        self._raw.close()
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
            sha256=self._hf.sha.hexdigest(),
            bytes=self._hf.n,
            samples=len(self.keys),
            tokens=self.tokens,
            keys=list(self.keys),
        )

    def abort(self) -> None:
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
