"""engine=local with several workers: a SIGINT to the driver process stops the workers (it used to leave them
training the whole stage while the driver waited for them at exit)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

CASE = Path(__file__).with_name("spawn_case.py")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its parent) is gone too
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_sigint_to_the_driver_stops_the_local_workers(tmp_path):
    worker_seconds = 90.0
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(CASE.parents[2]), os.environ.get("PYTHONPATH", "")]))
    # a fresh session: SIGINT not ignored (as a background job of a non-interactive shell has it) and kept to it
    proc = subprocess.Popen([sys.executable, str(CASE), str(tmp_path), str(worker_seconds)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(list(tmp_path.glob("worker*.pid"))) < 2:
            assert proc.poll() is None, proc.communicate()[0]
            time.sleep(0.2)
        pids = [int(p.read_text()) for p in sorted(tmp_path.glob("worker*.pid"))]
        assert len(pids) == 2
        time.sleep(0.5)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)  # the driver alone, as `kill -INT <pid>` does
        out = proc.communicate(timeout=40)[0]
        waited = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and "driver: interrupted" in out, out[-2000:]
    assert waited < 30, waited  # not the workers' 90 s
    assert not any(_alive(p) for p in pids)
    assert sorted(p.name for p in tmp_path.glob("worker*.interrupted")) == ["worker0.interrupted", "worker1.interrupted"]
    assert not list(tmp_path.glob("worker*.finished"))
