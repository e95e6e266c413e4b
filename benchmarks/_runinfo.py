"""What every benchmark prints before its numbers, and how its GPU modes refuse a machine without a GPU.

``need_cuda``: a GPU mode on a machine without CUDA stops at once with one line on stderr (exit code 2) naming what
it needs and the CPU mode to use instead, rather than a traceback from deep inside torch or a CPU run whose numbers
read like GPU results.

``header``: one line with what BENCHMARKS.md's entries record beside each result: the UTC date and time, the commit
(``+local changes`` when the tree differs from it), the device and the exact command.
"""

from __future__ import annotations

import glob
import os
import shlex
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def need_cuda(script: str, instead: str = "") -> None:
    """Exit (code 2) with one line unless torch sees a CUDA device."""
    import torch

    if not torch.cuda.is_available():
        print(f"{script}: needs a CUDA GPU and torch sees none here (torch {torch.__version__})"
              + (f"; {instead}" if instead else ""), file=sys.stderr)
        sys.exit(2)


def commit() -> str:
    try:
        head = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head or "unknown") + (" +local changes" if dirty else "")


def command(argv: list[str] | None = None) -> str:
    """The command line as typed from the repository root: the script's path relative to it, then its arguments."""
    argv = list(sys.argv if argv is None else argv)
    script = os.path.relpath(os.path.abspath(argv[0]), REPO) if argv else "?"
    # (the settings: not the progress switch, nor the port a process's own one-process group recorded for its children)
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(os.environ.items())
                   if k.startswith("HMSCALE_") and k not in ("HMSCALE_NO_PROGRESS", "HMSCALE_SINGLE_PROCESS_GROUP_PORT"))
    return (env + " " if env else "") + " ".join(["python", script] + [shlex.quote(a) for a in argv[1:]])


def device_name(device: str = "") -> str:
    import torch

    if device.startswith("cuda") or (not device and torch.cuda.is_available()):
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}"
    return f"CPU ({os.cpu_count()} cores)"


def header(device: str = "", extra: str = "") -> str:
    """``run: 2026-12-05 07:40 UTC, commit abc1234, NVIDIA H200, torch 2.11.0, `python benchmarks/ssd.py` ``"""
    import torch

    return (f"run: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit {commit()}, {device_name(device)}, "
            f"torch {torch.__version__}{', ' + extra if extra else ''}; `{command()}`")


def mamba_ssm_version() -> str:
    """The baseline's version: the package's own when it has one, else the name of the source archive that
    .whl/preamble.sh unpacked into /tmp/anchors (`make gpu-wheels` puts it in .anchors/)."""
    try:
        import mamba_ssm

        v = getattr(mamba_ssm, "__version__", None)
        if v:
            return str(v)
    except Exception:  # noqa: BLE001 - only for the printed version
        pass
    tars = sorted(glob.glob(os.path.join(REPO, ".anchors", "mamba_ssm-*.tar.gz")))
    return os.path.basename(tars[-1])[len("mamba_ssm-"):-len(".tar.gz")] if tars else "unknown version"
