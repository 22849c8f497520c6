"""A tensor-parallel server whose second rank dies: the server ends on its own with exit code 1 and one clear error
line naming the rank, instead of hanging or serving errors forever."""
from __future__ import annotations

import os
import re
import signal
import subprocess

from live_server import ServerProcess
from tiny_models import build_tiny_checkpoint


def test_a_dead_rank_ends_the_server_with_a_clear_error(tmp_path):
    build_tiny_checkpoint("llama", tmp_path / "model", num_layers=2)
    log = tmp_path / "server.log"
    server = ServerProcess(["--model", str(tmp_path / "model"), "-tp", "2", "--max-model-len", "64",
                            "--dist-timeout", "60"], log)
    try:
        server.wait_ready()
        started = re.search(r"tensor parallelism: 2 ranks \(gloo\), pids (\d+)", log.read_text())
        assert started, "the server did not log its ranks:\n" + log.read_text()
        pid = int(started.group(1))
        os.kill(pid, signal.SIGKILL)
        assert server.proc.wait(timeout=120) == 1  # generous: the machine may be busy; a hang never ends
    except subprocess.TimeoutExpired:
        raise AssertionError("the server did not end after its rank died:\n" + log.read_text()) from None
    finally:
        server.stop()
    assert f"error: tensor-parallel rank 1 (pid {pid}) was killed by SIGKILL" in log.read_text()
