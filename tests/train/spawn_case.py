"""A driver for test_launch_interrupt: `python spawn_case.py DIR` starts two local workers (hmscale.train.launch)
that write their pid to DIR and then wait a long time; it prints what reached it."""

import os
import sys
import time
from pathlib import Path


def _worker(rank: int, out: str, seconds: float) -> None:
    Path(out, f"worker{rank}.pid").write_text(str(os.getpid()))
    try:
        time.sleep(seconds)
    except KeyboardInterrupt:
        Path(out, f"worker{rank}.interrupted").write_text("1")
        raise
    Path(out, f"worker{rank}.finished").write_text("1")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from hmscale.train.launch import spawn_workers

    try:
        spawn_workers(_worker, 2, sys.argv[1], float(sys.argv[2]))
    except KeyboardInterrupt:
        print("driver: interrupted", flush=True)
        sys.exit(130)
    print("driver: workers finished", flush=True)
