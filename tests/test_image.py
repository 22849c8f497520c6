"""The CPU image, run as `docker run` would run it: GET /ready, one chat request, SIGTERM (exit code 0), as the
unprivileged user, with Docker's health check. Runs where a container engine (docker, or podman as root) can run
containers and the image was built (`packaging/image/build-cpu.sh`, or `docker build --build-arg FLAVOR=cpu ...`);
skips, saying why, elsewhere."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import uuid

import httpx
import pytest

from appliance.bench.launcher import wait_until_ready

IMAGE = os.environ.get("MUXD_IMAGE", "localhost/muxd:cpu")
# where the kernel's cgroups are v1/hybrid and raising rlimits is refused (as on the project's VMs), podman runs
# containers through runc with rlimits it may set
FALLBACK = ["--runtime", "runc", "--ulimit", "nofile=4096:4096", "--ulimit", "nproc=4096:4096"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def engine() -> tuple[str, list[str]]:
    """(docker or podman, the run flags that work here); skips when none can run the image."""
    for tool in ("docker", "podman"):
        if shutil.which(tool) is None or _run([tool, "info"]).returncode != 0:
            continue
        if _run([tool, "image", "inspect", IMAGE]).returncode != 0:
            pytest.skip(f"{tool} works but has no image {IMAGE}: build it with packaging/image/build-cpu.sh")
        for flags in ([], FALLBACK if tool == "podman" else None):
            if flags is not None and _run([tool, "run", "--rm", *flags, IMAGE, "--help"]).returncode == 0:
                return tool, flags
        pytest.fail(f"{tool} cannot run {IMAGE}: {_run([tool, 'run', '--rm', IMAGE, '--help']).stderr[-500:]}")
    pytest.skip("no container engine can run containers here (docker has no daemon; podman is not installed)")


def test_the_image_serves_chat_and_drains_on_sigterm(engine):
    tool, flags = engine
    name, port = f"muxd-test-{uuid.uuid4().hex[:8]}", free_port()
    started = _run([tool, "run", "-d", "--name", name, *flags, "-p", f"127.0.0.1:{port}:8000", IMAGE,
                    "--max-model-len", "256"])
    assert started.returncode == 0, started.stderr
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_ready(url, None, 180, lambda: _run([tool, "logs", name]).stderr[-2000:])
        assert httpx.get(url + "/ready").json() == {"status": "ready", "model": "muxd-embedded"}
        chat = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "What does len do?"}], "max_tokens": 16})
        assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"]
        assert _run([tool, "kill", "--signal", "TERM", name]).returncode == 0
        waited = _run([tool, "wait", name], timeout=120)
        assert waited.stdout.strip() == "0", waited.stdout + waited.stderr  # drained and exited cleanly
        logs = _run([tool, "logs", name]).stdout + _run([tool, "logs", name]).stderr
        assert "Traceback" not in logs and "Application shutdown complete" in logs
        image = json.loads(_run([tool, "image", "inspect", IMAGE]).stdout)[0]
        config = image["Config"]
        assert config["User"] == "10001:10001" and config["Entrypoint"] == ["muxd", "serve"]
        health = config.get("Healthcheck") or image.get("Healthcheck")  # docker keeps it in Config, podman beside
        assert "/health" in " ".join(health["Test"])
    finally:
        _run([tool, "rm", "-f", name])
