"""A tensor-parallel server whose second rank dies, idle or in the middle of a stream: the server ends on its own with
exit code 1 and one clear error line naming the rank, instead of hanging or serving errors forever; a stream it was
serving ends too."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import threading

import httpx
import pytest
from live_server import ServerProcess
from tiny_models import build_tiny_checkpoint


@pytest.mark.parametrize("streaming", [False, True], ids=["idle", "streaming"])
def test_a_dead_rank_ends_the_server_with_a_clear_error(tmp_path, streaming):
    build_tiny_checkpoint("llama", tmp_path / "model", num_layers=2)
    log = tmp_path / "server.log"
    server = ServerProcess(["--model", str(tmp_path / "model"), "-tp", "2", "--max-model-len", "512",
                            "--dist-timeout", "60"], log)
    first_chunk, stream_ended = threading.Event(), threading.Event()

    def stream() -> None:
        body = {"prompt": [5, 6, 7], "max_tokens": 500, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as response:
                for _ in response.iter_lines():
                    first_chunk.set()
        except httpx.HTTPError:
            pass  # the server went away mid-stream: also an end
        stream_ended.set()

    try:
        server.wait_ready()
        started = re.search(r"tensor parallelism: 2 ranks \(gloo\), pids (\d+)", log.read_text())
        assert started, "the server did not log its ranks:\n" + log.read_text()
        pid = int(started.group(1))
        if streaming:
            threading.Thread(target=stream, daemon=True).start()
            assert first_chunk.wait(120), "no token streamed:\n" + log.read_text()
        os.kill(pid, signal.SIGKILL)
        assert server.proc.wait(timeout=120) == 1  # generous: the machine may be busy; a hang never ends
        assert not streaming or stream_ended.wait(60)
    except subprocess.TimeoutExpired:
        raise AssertionError("the server did not end after its rank died:\n" + log.read_text()) from None
    finally:
        server.stop()
    assert f"error: tensor-parallel rank 1 (pid {pid}) was killed by SIGKILL" in log.read_text()
