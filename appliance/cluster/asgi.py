"""One HTTP request served by an ASGI application in this process, as a stream of messages: a replica runs the
whole single-server muxd app this way, so a request behind the ingress meets the same validation, errors, SSE
format, metrics and engine as one sent to `muxd serve`.

A proxied request travels as a dict (method, path, query, headers, body); the answer comes back as
`("start", status, headers)` then `("body", bytes)` messages. Closing the stream early (the client went away, or the
ingress gave up) tells the app the client disconnected, which aborts the engine requests behind it.
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator

from starlette.types import ASGIApp, Message

DISCONNECT_GRACE_S = 5.0  # how long the app may take to wind down after a disconnect before it is cancelled


def proxied(method: str, path: str, query: bytes = b"", headers: list[tuple[bytes, bytes]] | None = None,
            body: bytes = b"") -> dict[str, Any]:
    return {"method": method, "path": path, "query": query, "headers": list(headers or []), "body": body}


async def call(app: ASGIApp, request: dict[str, Any]) -> AsyncIterator[tuple]:
    """Serve `request` with `app`; yields ("start", status, headers) once, then ("body", bytes) chunks."""
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": request["method"], "scheme": "http", "path": request["path"], "raw_path":
             request["path"].encode(), "query_string": request.get("query", b""), "root_path": "",
             "headers": [(bytes(k).lower(), bytes(v)) for k, v in request.get("headers", [])],
             "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 80), "state": {}}
    outbox: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    body_sent = False

    async def receive() -> Message:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request.get("body", b""), "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        outbox.put_nowait(message)

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            outbox.put_nowait(None)

    task = asyncio.ensure_future(run())
    finished = False
    try:
        while True:
            message = await outbox.get()
            if message is None:
                break
            if message["type"] == "http.response.start":
                yield ("start", message["status"], [(bytes(k), bytes(v)) for k, v in message.get("headers", [])])
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield ("body", bytes(message["body"]))
                if not message.get("more_body", False):
                    finished = True
                    break
        await task  # raises what the app raised
    finally:
        if not task.done():
            gone.set()  # the consumer left early: the app sees a disconnect and aborts its engine requests
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
                await asyncio.wait_for(asyncio.shield(task), DISCONNECT_GRACE_S if not finished else 1.0)
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
