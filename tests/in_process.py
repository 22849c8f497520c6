"""The muxd app served in this process (Starlette's TestClient, no port): `ready_app(cfg)` yields a client once the
model has loaded (GET /ready is 200)."""
from __future__ import annotations

import contextlib
import time
from typing import Iterator

from fastapi.testclient import TestClient

from appliance.config import Config
from appliance.server.api import create_app


@contextlib.contextmanager
def ready_app(cfg: Config, timeout: float = 120) -> Iterator[TestClient]:
    with TestClient(create_app(cfg)) as client:
        deadline = time.monotonic() + timeout
        while client.get("/ready").status_code != 200:
            assert time.monotonic() < deadline, "the model did not load"
            time.sleep(0.05)
        yield client
