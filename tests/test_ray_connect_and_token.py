"""Joining / starting Ray (hmscale/ray_cluster.py): a wrong `parallel.ray_address` fails in bounded time,
`RAY_ADDRESS=local` means the embedded cluster, and the token the embedded cluster writes is private (0600).

Each case runs `connect` in a fresh subprocess (its own Ray driver, never the tests' shared cluster)."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _run(code: str, env_extra: dict, timeout: float, home: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
    env.update(HOME=str(home), PYTHONPATH=str(REPO), RAY_USAGE_STATS_ENABLED="0", **env_extra)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


_JOIN = """
    import time
    from hmscale.ray_cluster import connect, RayConnectError
    t = time.time()
    try:
        connect({addr!r}, log=lambda m: None)
        print("JOINED")
    except RayConnectError as e:
        print("ERR", str(e).splitlines()[0])
    print("T %.1f" % (time.time() - t))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.ray
def test_closed_port_fails_in_bounded_time(tmp_path):
    """Nothing listens there: Ray retried for ~14 minutes (20 tries of ~41 s, GCS warnings all along)."""
    port = _free_port()
    try:
        p = _run(_JOIN.format(addr=f"127.0.0.1:{port}"), {}, 80, tmp_path)
    except subprocess.TimeoutExpired:
        pytest.fail(f"connect(127.0.0.1:{port}) with nothing listening still waited after 80 s")
    assert "ERR parallel.ray_address=127.0.0.1:" in p.stdout, p.stdout + p.stderr[-2000:]
    assert float(p.stdout.split("T ")[-1]) < 60


@pytest.mark.ray
def test_port_of_something_else_fails_in_bounded_time(tmp_path):
    """A port where something else listens (the dashboard's 8265 given as HEAD:8265, any TCP server)."""
    from ray._private.services import resolve_ip_for_localhost

    srv = socket.socket()
    # where Ray dials 127.0.0.1:PORT (it makes a localhost address the node's IP): a server on 127.0.0.1 alone is a
    # closed port there, and this was the closed-port case again
    srv.bind((resolve_ip_for_localhost("127.0.0.1"), 0))
    srv.listen(16)
    port = srv.getsockname()[1]
    conns = []
    stop = threading.Event()

    def accept():
        srv.settimeout(0.5)
        while not stop.is_set():
            try:
                conns.append(srv.accept()[0])
            except OSError:
                pass

    th = threading.Thread(target=accept, daemon=True)
    th.start()
    try:
        # Ray's own GCS connect timeouts shortened (an operator's settings, passed through): this test is about the
        # one-line error, reached through ray.init's own failure (~5 s instead of ~46 with Ray's defaults)
        p = _run(_JOIN.format(addr=f"127.0.0.1:{port}"),
                 {"RAY_py_gcs_connect_timeout_s": "1", "RAY_gcs_rpc_server_connect_timeout_s": "1"}, 80, tmp_path)
    except subprocess.TimeoutExpired:
        pytest.fail(f"connect(127.0.0.1:{port}) at a non-Ray TCP server still waited after 80 s")
    finally:
        stop.set()
        th.join()
        for c in conns:
            c.close()
        srv.close()
    assert "ERR parallel.ray_address=127.0.0.1:" in p.stdout, p.stdout + p.stderr[-2000:]
    assert "nothing listens" not in p.stdout, p.stdout  # (Ray's connect failed, not the closed-port check)


def test_a_closed_port_is_told_from_an_open_one_without_ray():
    """`connect`'s check before ray.init: a refused TCP connection at the address Ray dials is a closed port, said at
    once (Ray took ~41 s); a port where something listens is left to Ray's own connect."""
    from ray._private.services import resolve_ip_for_localhost

    from hmscale.ray_cluster import _nothing_listens

    with socket.socket() as srv:
        srv.bind((resolve_ip_for_localhost("127.0.0.1"), 0))
        srv.listen(1)
        port = srv.getsockname()[1]
        assert _nothing_listens(f"127.0.0.1:{port}") is None
    said = _nothing_listens(f"127.0.0.1:{port}")
    assert said is not None and said.startswith("nothing listens at ") and said.endswith(f":{port}"), said
    assert _nothing_listens(f"http://127.0.0.1:{port}") is None  # (not a GCS address: Ray's own error says so)


@pytest.mark.ray
def test_ray_address_local_is_the_embedded_cluster_and_its_token_is_private(tmp_path):
    """RAY_ADDRESS=local (Ray's own word for 'start a new local cluster') started a cluster with every core, no
    PYTHONPATH for workers, and one `check_workers_fit` took for a joined, growable cluster (a warning and Ray Train
    waiting forever instead of ClusterTooSmall); and the token Ray generated for it was world-readable (0644)."""
    code = """
        import os, stat, ray
        import hmscale.ray_cluster as rc
        own = rc.connect(num_cpus=1, log=lambda m: None)
        mode = oct(stat.S_IMODE(os.stat(os.path.expanduser("~/.ray/auth_token")).st_mode))
        try:
            rc.check_workers_fit(4, False, log=lambda m: print("WARN", m))
            fit = "no error"
        except rc.ClusterTooSmall:
            fit = "ClusterTooSmall"
        print("RESULT", own, rc._started_embedded, int(ray.cluster_resources()["CPU"]), mode, fit)
        ray.shutdown()
    """
    p = _run(code, {"RAY_ADDRESS": "local"}, 85, tmp_path)
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT")]
    assert line, p.stdout + p.stderr[-3000:]
    assert line[0].split()[1:] == ["True", "True", "1", "0o600", "ClusterTooSmall"], line[0]


def test_existing_default_token_is_tightened(tmp_path, monkeypatch):
    """A token left world-readable by Ray (`ray get-auth-token --generate`, an earlier embedded start) is made 0600
    before the embedded cluster trusts it: anyone on the host who reads it can run code through the job API."""
    from hmscale import ray_cluster as rc

    for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    tok = tmp_path / ".ray" / "auth_token"
    tok.parent.mkdir()
    tok.write_text("a" * 64)
    tok.chmod(0o644)
    logs = []
    rc._private_token(log=logs.append)
    assert stat.S_IMODE(tok.stat().st_mode) == 0o600
    assert tok.read_text() == "a" * 64
    assert logs and "0600" in logs[0]
    # a fresh one is created 0600 from the start; RAY_AUTH_MODE=disabled or a token in the environment: untouched
    tok.unlink()
    rc._private_token(log=logs.append)
    assert stat.S_IMODE(tok.stat().st_mode) == 0o600 and len(tok.read_text().strip()) == 64
    tok.unlink()
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    rc._private_token(log=logs.append)
    assert not tok.exists()
