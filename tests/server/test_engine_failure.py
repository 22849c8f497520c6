"""A failed engine step, injected into an in-process server: the requests it held and the ones waiting to enter it
end at once with an error (stream: error event + [DONE]; otherwise a JSON 5xx), the engine is rebuilt around the same
weights and serves again with every KV page free, /ready is 503 meanwhile; past --engine-restarts the engine stops
for good and the server is told to exit."""
from __future__ import annotations

import json
import logging
import threading
import time

import httpx
import pytest
import torch
import uvicorn
from live_server import free_port

from appliance.bench.launcher import wait_until_ready
from appliance.config import Config
from appliance.server.api import create_app

BODY = {"prompt": "import", "max_tokens": 200, "ignore_eos": True}


@pytest.fixture
def live_app(request):
    fatal: list[BaseException] = []
    flags = getattr(request, "param", {})
    app = create_app(Config.flat(kv_cache_memory="16MiB", max_model_len=256, **flags), fatal.append)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, 120)
    yield app, url, fatal
    server.should_exit = True
    thread.join(30)


def wait_ready(url: str, timeout: float) -> float:
    """Seconds until GET /ready answered 200 (ApplianceError after `timeout`)."""
    started = time.monotonic()
    wait_until_ready(url, None, timeout, lambda: "")
    return time.monotonic() - started


def eventually(condition, timeout: float = 30) -> bool:
    """True once condition() holds (a seat is given back just after its response has gone out)."""
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def break_next_step(engine, release: threading.Event | None = None,
                    fault: BaseException | None = None) -> threading.Event:
    """The engine's next step fails (after `release` is set, if given) with `fault` (default: a RuntimeError);
    returns an event set when it started."""
    entered = threading.Event()

    def broken_step():
        entered.set()
        if release is not None:
            release.wait(60)
        raise fault or RuntimeError("injected device fault")

    engine.step = broken_step
    return entered


def stream_events(url: str, events: list[str], started: threading.Event) -> None:
    with httpx.stream("POST", url + "/v1/completions", timeout=60, json={**BODY, "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                started.set()


@pytest.mark.parametrize("live_app", [{"engine_restarts": 2}], indirect=True)
def test_a_failed_step_ends_its_requests_and_the_engine_comes_back(live_app, caplog):
    app, url, fatal = live_app
    state = app.state.muxd
    async_engine = state.engine
    first_engine = async_engine.engine
    total_pages = first_engine.pool.num_pages
    events: list[str] = []
    started = threading.Event()
    streamer = threading.Thread(target=stream_events, args=(url, events, started))
    streamer.start()
    assert started.wait(60)
    whole: list[httpx.Response] = []
    release = threading.Event()
    entered = break_next_step(first_engine, release)
    assert entered.wait(60)
    # while the failing step runs: one request already in the engine (the stream), three sent now that wait in
    # the inbox; before supervision these hung forever and kept their seats
    senders = [threading.Thread(target=lambda: whole.append(httpx.post(url + "/v1/completions", json=BODY,
                                                                       timeout=60))) for _ in range(3)]
    for t in senders:
        t.start()
    deadline = time.monotonic() + 60
    while async_engine._inbox.qsize() < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert async_engine._inbox.qsize() == 3
    with caplog.at_level(logging.WARNING, logger="muxd.engine"):
        release.set()
        for t in (streamer, *senders):
            t.join(60)
        back_after = wait_ready(url, 10)  # the acceptance bound: the engine serves again within 10 s
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "engine_step_failed" and "injected device fault" in error["message"]
    assert sorted(r.status_code for r in whole) == [503, 503, 503]
    assert all(r.json()["error"]["code"] == "engine_restarting" and "retry-after" in r.headers for r in whole)
    assert back_after < 10
    assert async_engine.engine is not first_engine and async_engine.engine.model is first_engine.model
    assert "engine step failed: RuntimeError: injected device fault" in caplog.text
    assert "engine rebuilt" in caplog.text

    ok = httpx.post(url + "/v1/completions", json={**BODY, "max_tokens": 4}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
    assert async_engine.engine.pool.num_free_pages == total_pages == async_engine.engine.pool.num_pages
    assert eventually(lambda: state.traffic.in_flight == 0)  # every seat given back
    assert httpx.get(url + "/health").status_code == 200 and not fatal


@pytest.mark.parametrize("live_app", [{"engine_restarts": 2}], indirect=True)
def test_a_step_out_of_memory_says_which_flags_make_room(live_app, caplog):
    app, url, fatal = live_app
    async_engine = app.state.muxd.engine
    with caplog.at_level(logging.WARNING, logger="muxd.engine"):
        entered = break_next_step(async_engine.engine, fault=torch.OutOfMemoryError("CUDA out of memory (injected)"))
        response = httpx.post(url + "/v1/completions", json=BODY, timeout=60)
        assert entered.is_set()
        wait_ready(url, 10)
    assert response.status_code == 500 and response.json()["error"]["code"] == "engine_step_failed"
    assert "out of memory (injected)" in response.json()["error"]["message"]
    assert "ran out of memory within a step" in caplog.text
    assert "--gpu-memory-utilization" in caplog.text and "--max-num-batched-tokens" in caplog.text
    assert "engine rebuilt" in caplog.text and not fatal
    ok = httpx.post(url + "/v1/completions", json={**BODY, "max_tokens": 4}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("live_app", [{"engine_restarts": 1, "engine_restart_window": 3600}], indirect=True)
def test_failures_past_the_budget_stop_the_engine_and_the_server(live_app, caplog):
    app, url, fatal = live_app
    async_engine = app.state.muxd.engine
    with caplog.at_level(logging.WARNING, logger="muxd.engine"):
        break_next_step(async_engine.engine)
        first = httpx.post(url + "/v1/completions", json=BODY, timeout=60)
        assert first.status_code == 500 and first.json()["error"]["code"] == "engine_step_failed"
        wait_ready(url, 60)
        break_next_step(async_engine.engine)  # the second failure within the window: one more than allowed
        second = httpx.post(url + "/v1/completions", json=BODY, timeout=60)
    assert second.status_code == 500 and second.json()["error"]["code"] == "engine_step_failed"
    assert eventually(lambda: bool(fatal)) and "the engine stopped after failed steps" in str(fatal[0])
    assert "stopping the server so that its supervisor restarts the process" in caplog.text
    for response in (httpx.get(url + "/health"), httpx.get(url + "/ready"),
                     httpx.post(url + "/v1/completions", json={"prompt": "x"})):
        assert response.status_code == 500 and response.json()["error"]["code"] == "engine_dead"
    assert eventually(lambda: app.state.muxd.traffic.in_flight == 0)
