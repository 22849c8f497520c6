"""The gate in front of the routes, in process: API key, body cap (Content-Length and chunked), refusal while
draining or over the in-flight cap, and unexpected exceptions turned into OpenAI-style 500 bodies."""
from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi import FastAPI, Request

from appliance.server.errors import install_handlers
from appliance.server.gate import Gate, Traffic

KEY = "sk-test-123"


def make_app(traffic: Traffic, **gate) -> FastAPI:
    app = FastAPI()
    install_handlers(app)
    app.add_middleware(Gate, traffic=traffic, **{"max_body": 1000, "max_in_flight": 8, **gate})

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.post("/v1/echo")
    async def echo(request: Request):
        return {"bytes": len(await request.body())}

    @app.get("/v1/boom")
    async def boom():
        raise RuntimeError("injected failure")

    return app


def call(app: FastAPI, method: str, path: str, **kw) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await client.request(method, path, **kw)
    return asyncio.run(go())


def error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["message"]
    return body


def test_api_key_guards_v1_only():
    app = make_app(Traffic(), api_key=KEY)
    assert error(call(app, "POST", "/v1/echo", content=b"x"), 401)["code"] == "invalid_api_key"
    wrong = call(app, "POST", "/v1/echo", content=b"x", headers={"Authorization": "Bearer sk-test-124"})
    assert error(wrong, 401)["type"] == "invalid_request_error" and wrong.headers["www-authenticate"] == "Bearer"
    assert error(call(app, "POST", "/v1/echo", headers={"Authorization": KEY}), 401)  # the scheme is required
    right = call(app, "POST", "/v1/echo", content=b"xyz", headers={"Authorization": f"Bearer {KEY}"})
    assert right.json() == {"bytes": 3}
    assert call(app, "GET", "/health").json() == {"status": "ok"}


def test_body_over_the_cap_is_413_with_or_without_content_length():
    app = make_app(Traffic())
    assert call(app, "POST", "/v1/echo", content=b"x" * 1000).json() == {"bytes": 1000}
    declared = call(app, "POST", "/v1/echo", content=b"x" * 1001)
    assert error(declared, 413)["code"] == "request_too_large" and "1000 bytes" in declared.json()["error"]["message"]

    async def chunks():
        for _ in range(5):
            yield b"x" * 300  # sent chunked: no Content-Length to check up front

    assert error(call(app, "POST", "/v1/echo", content=chunks()), 413)["code"] == "request_too_large"


def test_unexpected_exception_is_a_json_500_and_logged(caplog):
    body = error(call(make_app(Traffic()), "GET", "/v1/boom"), 500)
    assert body["type"] == "internal_error" and "injected failure" in body["message"]
    assert "unexpected error serving GET /v1/boom" in caplog.text


def test_draining_refuses_v1_with_503_and_retry_after():
    traffic = Traffic()
    traffic.draining = True
    app = make_app(traffic)
    refused = call(app, "POST", "/v1/echo", content=b"x")
    assert error(refused, 503)["code"] == "shutting_down" and refused.headers["retry-after"]
    assert call(app, "GET", "/health").status_code == 200


def test_in_flight_cap_answers_429_and_counts_down():
    traffic = Traffic()
    app = make_app(traffic, max_in_flight=2)
    traffic.in_flight = 2  # as if two requests were running
    busy = call(app, "POST", "/v1/echo", content=b"x")
    assert error(busy, 429)["type"] == "rate_limit_error" and busy.headers["retry-after"] == "1"
    traffic.in_flight = 1
    assert call(app, "POST", "/v1/echo", content=b"x").status_code == 200
    assert traffic.in_flight == 1  # the request left again


@pytest.mark.parametrize("in_flight, idle", [(0, True), (1, False)])
def test_wait_idle(in_flight, idle):
    traffic = Traffic()
    traffic.in_flight = in_flight
    assert asyncio.run(traffic.wait_idle(0.05)) is idle


def test_debug_routes_need_the_key_too():
    app = make_app(Traffic(), api_key=KEY)

    @app.get("/debug/timeline")
    async def timeline():
        return {"traceEvents": []}

    assert error(call(app, "GET", "/debug/timeline"), 401)["code"] == "invalid_api_key"
    assert call(app, "GET", "/debug/timeline", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_a_body_that_trickles_gets_408_and_never_holds_a_seat():
    """The body must arrive whole within --body-timeout; while it arrives the request holds no seat."""
    traffic = Traffic()
    gate = make_app(traffic, body_timeout=0.2).build_middleware_stack()
    sent: list[dict] = []
    seats_while_receiving: list[int] = []

    async def receive():
        seats_while_receiving.append(traffic.in_flight)
        if len(seats_while_receiving) == 1:
            return {"type": "http.request", "body": b'{"a', "more_body": True}
        await asyncio.Event().wait()  # the rest never comes

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/echo", "headers": [], "query_string": b"",
             "http_version": "1.1", "scheme": "http", "server": ("t", 80), "client": ("c", 1), "root_path": ""}
    asyncio.run(gate(scope, receive, send))
    assert sent[0]["status"] == 408 and (b"connection", b"close") in sent[0]["headers"]
    assert b"--body-timeout" in sent[1]["body"]
    assert seats_while_receiving == [0, 0] and traffic.in_flight == 0 and traffic.receiving_bytes == 0


def test_a_seat_is_checked_again_once_the_body_has_arrived():
    traffic = Traffic()
    app = make_app(traffic, max_in_flight=1)

    async def body():
        traffic.in_flight = 1  # every seat was taken while this body arrived
        yield b"x"

    assert error(call(app, "POST", "/v1/echo", content=body()), 429)["code"] == "queue_full"
