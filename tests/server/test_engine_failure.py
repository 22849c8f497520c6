"""An engine that fails in the middle of a stream: the stream ends with an SSE error event and [DONE] (never a cut
chunked body), and every later request gets an OpenAI-style 500. The server runs in process so that a fault can be
injected into its engine."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import uvicorn
from live_server import free_port

from appliance.config import Config
from appliance.server.api import create_app


@pytest.fixture
def live_app():
    app = create_app(Config.flat(kv_cache_memory="16MiB", max_model_len=256))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/ready").status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    yield app, url
    server.should_exit = True
    thread.join(30)


def test_engine_failure_mid_stream_ends_with_an_error_event(live_app, caplog):
    app, url = live_app
    engine = app.state.muxd.engine.engine
    events = []
    with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
            "prompt": "import", "max_tokens": 200, "ignore_eos": True, "stream": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if len(events) == 2:  # the stream is under way: the next engine step fails

                def broken_step():
                    raise RuntimeError("injected device fault")

                engine.step = broken_step
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "internal_error" and error["code"] == "engine_dead"
    assert "injected device fault" in error["message"]
    assert all("choices" in json.loads(e) for e in events[:-2])

    for response in (httpx.get(url + "/health"), httpx.post(url + "/v1/completions", json={"prompt": "x"})):
        assert response.status_code == 500 and response.json()["error"]["code"] == "engine_dead"
    assert "engine loop failed" in caplog.text
