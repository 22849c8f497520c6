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


@pytest.mark.parametrize("lost_each_time, succeeds_after, relaunches, raises", [
    (True, 2, 2, False),                                            # a lost port twice, then ready
    (False, 2, 0, True),                                            # another failure: at once, no relaunch
    (True, launcher.BIND_RETRIES + 1, launcher.BIND_RETRIES, True),  # lost every time: gives up
])
def test_a_server_is_relaunched_only_for_a_lost_port_and_only_so_often(lost_each_time, succeeds_after, relaunches,
                                                                       raises):
    attempts, relaunched = [], []

    def attempt():
        attempts.append(1)
        if len(attempts) <= succeeds_after:
            raise launcher.ApplianceError("exited")
        return "ready"

    def run():
        return launcher.relaunch_on_lost_port(attempt, lambda: lost_each_time, lambda: relaunched.append(1))

    if raises:
        with pytest.raises(launcher.ApplianceError, match="exited"):
            run()
    else:
        assert run() == "ready"
    assert len(relaunched) == relaunches
