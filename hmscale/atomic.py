"""Atomic file writes: a reader never sees a partial file."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import tempfile
from pathlib import Path


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write `data` to a temporary file beside `path`, fsync it, then rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as err:  # (no inode or no space for the temporary itself)
        raise OSError(err.errno, err.strerror or str(err), str(path)) from err
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(err, OSError) and err.errno is not None and err.filename != str(path):
            # a full disk fails the write of the hidden temporary (or names no file at all): name the file the
            # caller asked for, which is what the user knows (its previous version is untouched)
            raise OSError(err.errno, err.strerror or str(err), str(path)) from err
        raise
    return path


_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)


def os_error_line(err: OSError, what: str | None = None, after: str = "", where: str | os.PathLike | None = None) -> str:
    """One line for a file-system error while writing: what failed (``what``, else the file the error names), why,
    and what to do (free space for a full disk or quota, on the filesystem of ``where``, default the file's folder;
    permissions for a read-only place); ``after`` is appended (e.g. how the rerun resumes)."""
    name = what or (f"{err.filename}" if err.filename else "a file")
    why = err.strerror or str(err)
    if err.errno in _NO_SPACE:
        where = where or (Path(err.filename).parent if err.filename else None)
        todo = f"free space{f' on the filesystem of {where}' if where else ''}"
    elif err.errno in _NOT_WRITABLE:
        todo = "make it writable by this user (or point the setting elsewhere)"
    else:
        todo = "fix the cause"
    return f"writing {name} failed: {why}; {todo}{', then ' + after if after else ''}"


def storage_error_line(err: OSError, rerun: str) -> str | None:
    """``os_error_line`` for a full disk, a quota or an unwritable place met by a command, ending with how ``rerun``
    (e.g. "hmscale run") resumes; None for any other OS error (which the caller re-raises)."""
    if err.errno not in _NO_SPACE + _NOT_WRITABLE:
        return None
    return os_error_line(err, after=f"rerun `{rerun}` with the same config: what is done is kept and it resumes")


_TEMPORARY = re.compile(r"\..+\.[a-z0-9_]{8}\.tmp")  # what atomic_write_bytes' mkstemp names


def remove_temporaries(directory: str | os.PathLike) -> list[Path]:
    """Remove the temporaries that killed atomic writes left in ``directory`` (``.NAME.XXXXXXXX.tmp``: a SIGKILL between
    the write and the rename runs no cleanup); returns them. Only for a directory no other process is writing into
    now (a live write's temporary would go too)."""
    gone = []
    for p in Path(directory).glob(".*.tmp") if Path(directory).is_dir() else ():
        if _TEMPORARY.fullmatch(p.name) and p.is_file():
            p.unlink(missing_ok=True)
            gone.append(p)
    return gone


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode())


def atomic_write_json(path: str | os.PathLike, obj) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def writable_dir_problem(path: str | os.PathLike) -> str | None:
    """Create the directory ``path`` (and its parents): None when this user can then write into it, else why not, as
    one phrase for the caller's one-line error ("cannot create it (Not a directory)", "not writable by this user")."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as err:
        return f"cannot create it ({err.strerror or err})"
    return None if os.access(path, os.W_OK | os.X_OK) else "not writable by this user"


@contextlib.contextmanager
def exclusive_lock(lock_path: str | os.PathLike, on_wait=lambda: None):
    """One holder at a time of the lock file ``lock_path`` (``flock``; released when the file closes, also when the
    process dies): calls ``on_wait()`` and blocks when another process holds it. Yields whether it waited, or None
    where the filesystem has no file locks (some network mounts: the caller decides how to work without one). The
    lock file stays, as removing it would race."""
    lock_path = Path(lock_path)
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        lock = open(lock_path, "a")
    except PermissionError:  # another user's lock file on a shared cache: locking needs only read access
        lock = open(lock_path)
    with lock:
        yield flock_waiting(lock, on_wait)


def flock_waiting(f, on_wait=lambda: None) -> bool | None:
    """Take ``f``'s (an open file or descriptor) exclusive ``flock``, calling ``on_wait()`` and blocking when another
    holds it; held until ``f`` closes. Whether it waited, or None where the filesystem has no file locks."""
    import fcntl

    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        on_wait()
        fcntl.flock(f, fcntl.LOCK_EX)
        return True
    except OSError:
        return None
