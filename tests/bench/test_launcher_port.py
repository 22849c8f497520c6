"""A server that `muxd bench` (or a test) launches on a free port that another process takes before the server binds
it starts again on another port instead of failing the run."""
from __future__ import annotations

import socket

import httpx
import pytest

from appliance.bench import launcher


def test_a_taken_port_is_replaced(monkeypatch, tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        ports = iter([taken])
        real = launcher.free_port
        monkeypatch.setattr(launcher, "free_port", lambda: next(ports, None) or real())
        with launcher.ServerProcess("embedded", extra=["--kv-cache-memory", "32MiB"], log_dir=tmp_path) as server:
            assert server.port != taken and str(server.port) in server.args
            assert httpx.get(server.url + "/ready", timeout=10).status_code == 200


def test_other_start_failures_are_not_retried(monkeypatch, tmp_path):
    starts = []
    real_start = launcher.ServerProcess.start
    monkeypatch.setattr(launcher.ServerProcess, "start", lambda self: (starts.append(1), real_start(self)))
    server = launcher.ServerProcess("no-such-model-dir", log_dir=tmp_path, ready_timeout=120)
    try:
        server.start()
        with pytest.raises(launcher.ApplianceError, match="exited with"):
            server.wait_ready()
    finally:
        server.stop()
    assert len(starts) == 1
