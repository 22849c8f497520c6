"""The ingress's relay on scripted replicas (no Ray, no engine): what had not started is retried elsewhere, what had
started ends with a clear error, and nothing hangs."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from appliance.cluster.ingress import REPLICA_HEADER, create_ingress_app
from appliance.cluster.relay import ReplicaLost, carries_output
from appliance.cluster.settings import ClusterSettings
from appliance.config import Config

SSE = [(b"content-type", b"text/event-stream")]
ROLE = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
TOKEN = b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
DONE = b"data: [DONE]\n\n"


class Scripted:
    """Replicas that follow a script per try: a list of messages, where an exception is raised in place."""

    def __init__(self, *tries: list) -> None:
        self.tries = list(tries)
        self.seen: list[tuple[str, ...]] = []  # each try's avoid list
        self.closed = 0

    async def open(self, request, hints):
        self.seen.append(hints.avoid)
        script = self.tries.pop(0)
        try:
            for item in script:
                if isinstance(item, BaseException):
                    raise item
                if item == "hang":
                    await asyncio.sleep(3600)
                yield item
        finally:
            self.closed += 1

    async def ready(self):
        return True


def start(replica: str, status: int = 200, headers=SSE) -> tuple:
    return ("start", status, headers, replica)


async def post(backend, body: dict, **settings) -> httpx.Response:
    app = create_ingress_app(backend, ClusterSettings(**settings), Config.flat(), backend.ready)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ingress") as client:
        return await client.post("/v1/chat/completions", json=body)


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "stream": True}


def test_a_replica_lost_before_output_is_retried_on_another():
    backend = Scripted([start("a"), ("body", ROLE), ReplicaLost("a", "actor died")],
                       [start("b"), ("body", ROLE), ("body", TOKEN), ("body", DONE)])
    r = asyncio.run(post(backend, CHAT))
    assert r.status_code == 200 and r.headers[REPLICA_HEADER] == "b"
    assert r.text.count("assistant") == 1 and '"hi"' in r.text and r.text.endswith("[DONE]\n\n")
    assert backend.seen == [(), ("a",)]


def test_a_replica_lost_after_output_ends_the_stream_with_a_clear_error():
    backend = Scripted([start("a"), ("body", ROLE), ("body", TOKEN), ReplicaLost("a", "actor died")])
    r = asyncio.run(post(backend, CHAT))
    assert r.status_code == 200 and r.headers[REPLICA_HEADER] == "a"
    events = [e for e in r.text.split("\n\n") if e]
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == "replica_lost" and "retry" in error["message"] and "(a)" in error["message"]
    assert events[-1] == "data: [DONE]" and '"hi"' in events[1]


def test_busy_replicas_are_tried_in_turn_and_the_last_answer_stands():
    busy = [start("a", 503, [(b"content-type", b"application/json")]), ("body", b'{"error": {}}')]
    backend = Scripted(busy, [start("b", 429), ("body", b"{}")], [start("c", 429), ("body", b'{"last": 1}')])
    r = asyncio.run(post(backend, {**CHAT, "stream": False}))
    assert r.status_code == 429 and r.json() == {"last": 1} and backend.seen == [(), ("a",), ("a", "b")]


def test_every_try_lost_is_a_503_naming_the_cause():
    backend = Scripted(*[[ReplicaLost(None, "no replica")] for _ in range(3)])
    r = asyncio.run(post(backend, CHAT))
    assert r.status_code == 503 and r.json()["error"]["code"] == "replica_unavailable"
    assert "3 tries" in r.json()["error"]["message"]


def test_a_silent_replica_times_out_instead_of_hanging():
    backend = Scripted([start("a"), ("body", ROLE), ("body", TOKEN), "hang"])
    r = asyncio.run(asyncio.wait_for(post(backend, CHAT, stall_timeout=0.5), 30))
    assert "--stall-timeout" in r.text and r.text.endswith("data: [DONE]\n\n")
    assert backend.closed == 1


@pytest.mark.parametrize("event, output", [
    (ROLE, False), (TOKEN, True), (DONE, True), (b'data: {"error": {"message": "x"}}', True),
    (b'data: {"choices": [], "usage": {"total_tokens": 3}}', True),
    (b'data: {"choices":[{"index":0,"text":"a"}]}', True),
    (b'data: {"choices":[{"index":0,"delta":{"role":"assistant"},"finish_reason":"stop"}]}', True)])
def test_only_output_starts_an_answer(event, output):
    assert carries_output(event) is output


def test_the_ingress_answers_cors_as_the_single_server():
    """Preflights are answered before the API key is asked for; refusals and relayed answers carry the headers once."""
    # the replica's answer carries the replica app's own CORS header: the ingress's does not double it
    backend = Scripted([start("r0", headers=[*SSE, (b"access-control-allow-origin", b"*")]), ("body", ROLE),
                        ("body", DONE)])
    app = create_ingress_app(backend, ClusterSettings(), Config.flat(api_key="k"), backend.ready)
    origin = {"Origin": "https://app.example"}

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ingress") as client:
            preflight = await client.options("/v1/chat/completions", headers={
                **origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"})
            refused = await client.post("/v1/chat/completions", json=CHAT, headers=origin)
            relayed = await client.post("/v1/chat/completions", json=CHAT,
                                        headers={**origin, "Authorization": "Bearer k"})
            return preflight, refused, relayed
    preflight, refused, relayed = asyncio.run(go())
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == "*"
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == "*"
    assert relayed.status_code == 200 and relayed.headers.get_list("access-control-allow-origin") == ["*"]


def test_invocations_are_routed_with_the_hints_of_the_body_they_hold():
    from appliance.cluster.ingress import _hints

    chat = {"messages": [{"role": "user", "content": "x" * 400}]}
    assert _hints("/invocations", json.dumps(chat).encode(), None) == \
        _hints("/v1/chat/completions", json.dumps(chat).encode(), None)
    text = {"prompt": "y" * 400}
    hints = _hints("/invocations", json.dumps(text).encode(), "batch")
    assert hints == _hints("/v1/completions", json.dumps(text).encode(), "batch") and hints.tokens > 50
