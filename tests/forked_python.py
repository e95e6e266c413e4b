"""`python ...` for the tests, in a process forked from the suite's preloaded fork server (`hmscale.worker_processes`)
instead of a fresh interpreter: the same isolation (a process of its own, no state of the test's process: no
process group, no compiled graphs, no Ray), without the seconds of CPU each fresh interpreter spends importing torch,
DeepSpeed and transformers. Not for what must see a fresh interpreter's imports (what `import hmscale` pulls in, a
module that must not be imported yet, the interpreter's import-time switches such as TRITON_INTERPRET): those keep
`subprocess`. On a machine with CUDA it is `subprocess` too (no GPU work in a process forked from the server).

    proc = run_python(["benchmarks/ssd.py", "--smoke"], cwd=..., env=...)   # as subprocess.run([sys.executable, ...],
    proc = run_python(["-c", "print(1)"])                                  #    capture_output=True, text=True)
    proc = run_python(["-m", "ray_jobs.run_recipe", "--config", "x.yaml"])
    p = start_python(["job.py", "spec.json"], out="rank0.log", env=...)    # a multiprocessing.Process, running
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path


def _main(argv: list, cwd: str | None, out: str, err: str, handed: dict) -> None:
    import atexit

    try:
        _run(argv, cwd, out, err, handed)
    finally:  # (a multiprocessing child ends in os._exit, which skips them; an interpreter runs them)
        atexit._run_exitfuncs()


def _run(argv: list, cwd: str | None, out: str, err: str, handed: dict) -> None:
    import runpy

    from hmscale.worker_processes import take_over

    take_over(handed)
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(f, fd)
        os.close(f)
    sys.stdin = open(os.devnull)
    if cwd is not None:
        os.chdir(cwd)
    sys.path[:0] = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        sys.path.insert(0, "")
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
    elif argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path.insert(0, os.getcwd())
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path.insert(0, str(Path(argv[0]).resolve().parent))
        runpy.run_path(argv[0], run_name="__main__")


def start_python(argv: list, *, out, err=None, cwd=None, env: dict | None = None):
    """`python ARGV` started, not waited for, its stdout appended to the file `out` and its stderr to `err` (default:
    `out`); returns the `multiprocessing.Process` (``exitcode``, ``kill()``, ``join()``). For CPU work only."""
    from hmscale.worker_processes import context, handover

    handed = handover()
    if env is not None:
        handed["env"] = {str(k): str(v) for k, v in env.items()}
    args = ([str(a) for a in argv], None if cwd is None else str(cwd), str(out), str(err or out), handed)
    p = context(use_gpu=False).Process(target=_main, args=args, daemon=False)  # (it may start processes of its own)
    p.start()
    return p


def run_python(argv: list, *, cwd=None, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """`subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)`,
    in a forked process (see the module's doc). A timeout kills it and raises `subprocess.TimeoutExpired`."""
    import torch

    cmd = [sys.executable, *map(str, argv)]
    if torch.cuda.is_available():
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    with tempfile.TemporaryDirectory(prefix="hmscale-forked-") as tmp:
        out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        p = start_python(argv, out=out, err=err, cwd=cwd, env=env)
        p.join(timeout)
        if p.exitcode is None:
            p.kill()
            p.join()
            raise subprocess.TimeoutExpired(cmd, timeout, output=_read(out), stderr=_read(err))
        return subprocess.CompletedProcess(cmd, p.exitcode, _read(out), _read(err))


def _read(path: str) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return ""
