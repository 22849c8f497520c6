"""`muxd bench`'s launcher starts a server again on another port only when its port was taken before the bind
(tests/bench/test_bench_e2e.py's server is such a case); any other failure to start is reported at once."""
from __future__ import annotations

import pytest

from appliance.bench import launcher


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
