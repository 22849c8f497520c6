"""A real `muxd serve` subprocess on a free port and what a test needs to watch it: readiness, Prometheus samples,
idle KV pool, resident memory. Used by the server tests and by scripts/reliability.py."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, TypeVar

import httpx
from prometheus_client.parser import text_string_to_metric_families

from appliance.bench.launcher import free_port, port_lost, relaunch_on_lost_port, wait_until_ready
from appliance.errors import ApplianceError

T = TypeVar("T")


class ServerProcess:
    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.args, self.log = args, log
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        self._launch()

    def _launch(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "appliance", "serve", "--port", str(self.port), *self.args],
                                     stdout=self.log.open("w"), stderr=subprocess.STDOUT, env=self.env)

    def _relaunching(self, attempt: Callable[[], T]) -> T:
        """`attempt()`; a server that exited because its port was taken meanwhile starts again on another."""
        return relaunch_on_lost_port(attempt, lambda: port_lost(self.proc, self.log.read_text()), self._launch)

    def wait_ready(self, timeout: float = 180) -> None:
        """Wait for /ready (relaunching on a lost port)."""
        self._relaunching(lambda: wait_until_ready(self.url, self.proc, timeout, self.log.read_text))

    def first_answer(self, timeout: float = 120) -> httpx.Response:
        """The first response of GET /ready (any status: the model may still load), relaunching on a lost port."""
        deadline = time.monotonic() + timeout

        def answer() -> httpx.Response:
            while self.proc.poll() is None:
                if time.monotonic() > deadline:
                    raise AssertionError(f"the server did not answer in {timeout:g} s:\n{self.log.read_text()}")
                try:
                    return httpx.get(self.url + "/ready", timeout=5)
                except httpx.TransportError:
                    time.sleep(0.05)
            raise ApplianceError(f"the server exited with {self.proc.returncode}:\n{self.log.read_text()}")

        return self._relaunching(answer)

    def metrics(self) -> dict[str, float]:
        """Samples by name; labels other than model_name stay in the key as name{label="value"}."""
        out = {}
        for family in text_string_to_metric_families(httpx.get(self.url + "/metrics", timeout=30).text):
            for sample in family.samples:
                labels = sorted((k, v) for k, v in sample.labels.items() if k != "model_name")
                suffix = "{" + ",".join(f'{k}="{v}"' for k, v in labels) + "}" if labels else ""
                out[sample.name + suffix] = sample.value
        return out

    def wait_idle(self, free_pages: float, timeout: float = 120) -> dict[str, float]:
        """Wait until nothing runs or waits and the KV pool has `free_pages` free again; returns the metrics."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = m["muxd:num_requests_running"] == 0 and m["muxd:num_requests_waiting"] == 0
            if idle and m["muxd:kv_cache_free_pages"] == free_pages:
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"KV pool did not return to {free_pages} free pages: {m}")
            time.sleep(0.1)

    def rss_bytes(self) -> int:
        """Resident memory of the server process (Linux /proc)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("VmRSS not found")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
