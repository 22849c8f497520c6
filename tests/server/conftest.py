"""Fixtures starting a real `muxd serve` process per test module, or one per session that modules of the same flags
share (scripts/live_server.py drives it; the checks of scripts/reliability.py run here in small sizes)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from live_server import ServerProcess  # noqa: E402


@pytest.fixture(scope="module")
def serve(request, tmp_path_factory):
    """Factory: serve(*extra_args) starts a server (stopped at module end) and waits for /ready."""
    started = []

    def start(*args: str, env: dict[str, str] | None = None) -> ServerProcess:
        model = request.config.getoption("--serve-model")
        log = tmp_path_factory.mktemp("server") / "server.log"
        server = ServerProcess(["--model", model, *args], log, env)
        started.append(server)
        server.wait_ready()
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def shared_serve(request, tmp_path_factory):
    """Like `serve`, for modules that only send requests to a server of common flags: one process per set of flags
    for the whole session (stopped at its end), so that modules asking for the same flags share it."""
    started: dict[tuple[str, ...], ServerProcess] = {}

    def start(*args: str) -> ServerProcess:
        if args not in started:
            model = request.config.getoption("--serve-model")
            server = ServerProcess(["--model", model, *args], tmp_path_factory.mktemp("server") / "server.log")
            started[args] = server
            server.wait_ready()
        return started[args]

    yield start
    for server in started.values():
        server.stop()


@pytest.fixture(scope="module")
def client(server):
    """An openai client of the module's `server`."""
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model_name(client):
    [card] = client.models.list().data
    return card.id


@pytest.fixture(scope="session")
def served_dir(request) -> Path:
    from appliance.config import EMBEDDED_MODEL_DIR

    model = request.config.getoption("--serve-model")
    return EMBEDDED_MODEL_DIR if model == "embedded" else Path(model)
