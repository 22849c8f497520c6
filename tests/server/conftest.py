"""A real `muxd serve` process on a free port, shared by the server tests of a module."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, args: list[str], log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "appliance", "serve", "--port", str(self.port), *args],
                                     stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log.read_text()}")
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server not ready after {timeout}s:\n{self.log.read_text()}")

    def metrics(self) -> dict[str, float]:
        """Samples by name; labels other than model_name stay in the key as name{label="value"}."""
        out = {}
        for family in text_string_to_metric_families(httpx.get(self.url + "/metrics").text):
            for sample in family.samples:
                labels = sorted((k, v) for k, v in sample.labels.items() if k != "model_name")
                suffix = "{" + ",".join(f'{k}="{v}"' for k, v in labels) + "}" if labels else ""
                out[sample.name + suffix] = sample.value
        return out

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="module")
def serve(request, tmp_path_factory):
    """Factory: serve(*extra_args) starts a server (stopped at module end) and waits for /ready."""
    started = []

    def start(*args: str) -> ServerProcess:
        model = request.config.getoption("--serve-model")
        log = tmp_path_factory.mktemp("server") / "server.log"
        server = ServerProcess(["--model", model, *args], log)
        started.append(server)
        server.wait_ready()
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def served_dir(request) -> Path:
    from appliance.config import EMBEDDED_MODEL_DIR

    model = request.config.getoption("--serve-model")
    return EMBEDDED_MODEL_DIR if model == "embedded" else Path(model)
