"""The gate in front of every route (pure ASGI middleware): API-key check on /v1, /debug and /invocations (with or
without the --root-path prefix, as the routes match them), refusal while draining or when too many requests are in
flight, the request body read whole within --body-timeout and under the size cap before a request takes its seat,
the count of /v1 and /invocations requests in flight that shutdown waits for, and the last line of defence that
turns any unexpected exception into an OpenAI-style 500 body.

A seat (one of --max-num-seqs + --max-waiting) is taken only once the body has arrived, so clients that trickle
their bodies cannot fill the seats; the bytes of bodies still arriving are bounded by the same seats x body cap.
"""
from __future__ import annotations

import asyncio
import logging
import secrets

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from appliance.server.errors import error_response, response_for

log = logging.getLogger("muxd.server")
API = ("/v1", "/invocations")  # the routes whose bodies, seats and drain the gate manages
GUARDED = (*API, "/debug")  # the routes behind the API key; /health, /ready, /metrics stay open


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body is larger than {limit} bytes (--max-request-bytes)",
                         headers={"Connection": "close"})


class BodyTimeout(HTTPException):
    def __init__(self, timeout: float) -> None:
        super().__init__(408, f"the request body did not arrive within {timeout:g} s (--body-timeout)",
                         headers={"Connection": "close"})


class Traffic:
    """The /v1 requests in flight, the bytes of bodies still arriving, and whether the server is draining; shared by
    the gate and the shutdown."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.receiving_bytes = 0
        self.draining = False
        self._idle = asyncio.Event()

    def enter(self) -> None:
        self.in_flight += 1

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """True once no request is in flight; False if `timeout` seconds pass first."""
        if self.in_flight == 0:
            return True
        self._idle.clear()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return self.in_flight == 0
        return True


def route_path(scope: Scope) -> str:
    """The path the routes match (as Starlette reads it): without the --root-path prefix where the request has it."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root):len(root) + 1] in ("", "/"):
        return path[len(root):] or "/"
    return path


def _under(path: str, prefixes: tuple[str, ...]) -> bool:
    return any(path == p or path.startswith(p + "/") for p in prefixes)


class Gate:
    def __init__(self, app: ASGIApp, *, traffic: Traffic, max_body: int, max_in_flight: int,
                 api_key: str | None = None, body_timeout: float = 30.0) -> None:
        self.app, self.traffic = app, traffic
        self.max_body, self.max_in_flight, self.body_timeout = max_body, max_in_flight, body_timeout
        self._key = api_key.encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = route_path(scope)
        api = _under(path, API)
        refusal = self._refusal(Headers(scope=scope), api, _under(path, GUARDED))
        if refusal is None and api:
            try:
                body = await self._read_body(receive)
            except HTTPException as exc:
                refusal = response_for(exc)
            else:
                if body is None:
                    return  # the client left before its body arrived
                refusal = self._seat_refusal()
                receive = _replay(body, receive)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        started = False

        async def tracked_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        if api:
            self.traffic.enter()
        try:
            await self.app(scope, receive, tracked_send)
        except Exception as exc:  # noqa: BLE001 - every error must reach the client as an OpenAI-style body
            if not isinstance(exc, HTTPException):
                log.exception("unexpected error serving %s %s", scope.get("method"), path)
            if not started:
                await response_for(exc)(scope, receive, send)
        finally:
            if api:
                self.traffic.leave()

    async def _read_body(self, receive: Receive) -> bytes | None:
        """The whole body, within --body-timeout of the headers and under the size cap (Content-Length was checked
        already; this counts chunked bodies, and liars); None when the client disconnected."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout
        chunks: list[bytes] = []
        size = 0
        try:
            while True:
                try:
                    message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
                except asyncio.TimeoutError:
                    raise BodyTimeout(self.body_timeout) from None
                if message["type"] == "http.disconnect":
                    return None
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > self.max_body:
                    raise BodyTooLarge(self.max_body)
                self.traffic.receiving_bytes += len(chunk)
                if self.traffic.receiving_bytes > self.max_in_flight * self.max_body:
                    raise HTTPException(503, "too many request bodies are arriving at once; retry later",
                                        headers={"Connection": "close", "Retry-After": "1"})
                chunks.append(chunk)
                if not message.get("more_body", False):
                    return b"".join(chunks)
        finally:
            self.traffic.receiving_bytes -= size

    def _refusal(self, headers: Headers, api: bool, guarded: bool):
        if guarded and self._key is not None and not self._authorized(headers.get("authorization")):
            return error_response(401, "missing or incorrect API key: send the header 'Authorization: Bearer "
                                  "<key>' with the key given to --api-key (or MUXD_API_KEY)",
                                  "invalid_request_error", None, "invalid_api_key",
                                  headers={"WWW-Authenticate": "Bearer"})
        if api and self.traffic.draining:
            return error_response(503, "the server is shutting down and takes no new requests; retry on another "
                                  "replica", "service_unavailable", None, "shutting_down")
        if api:  # refused before its body is read when every seat is taken already
            refusal = self._seat_refusal()
            if refusal is not None:
                return refusal
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            return response_for(BodyTooLarge(self.max_body))
        return None

    def _seat_refusal(self):
        if self.traffic.in_flight >= self.max_in_flight:
            return error_response(429, f"{self.traffic.in_flight} requests are in flight (limit "
                                  f"{self.max_in_flight} = --max-num-seqs + --max-waiting); retry later",
                                  "rate_limit_error", None, "queue_full")
        return None

    def _authorized(self, header: str | None) -> bool:
        scheme, _, token = (header or "").partition(" ")
        # compare_digest takes as long for any wrong key of the same length: no timing oracle on the key
        return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), self._key)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that hands out the body read already, then whatever comes next (a disconnect)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
