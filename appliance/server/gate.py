"""The gate in front of every route (pure ASGI middleware): API-key check on /v1, refusal while draining or when too
many requests are in flight, the request-body size cap, the count of /v1 requests in flight that shutdown waits
for, and the last line of defence that turns any unexpected exception into an OpenAI-style 500 body.
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


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body is larger than {limit} bytes (--max-request-bytes)",
                         headers={"Connection": "close"})


class Traffic:
    """The /v1 requests in flight and whether the server is draining; shared by the gate and the shutdown."""

    def __init__(self) -> None:
        self.in_flight = 0
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


class Gate:
    def __init__(self, app: ASGIApp, *, traffic: Traffic, max_body: int, max_in_flight: int,
                 api_key: str | None = None) -> None:
        self.app, self.traffic = app, traffic
        self.max_body, self.max_in_flight = max_body, max_in_flight
        self._key = api_key.encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        api = scope["path"] == "/v1" or scope["path"].startswith("/v1/")
        refusal = self._refusal(Headers(scope=scope), api)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        started = False
        received = 0

        async def tracked_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        async def limited_receive() -> Message:
            # Content-Length was checked already; this counts chunked bodies (and liars)
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body:
                    raise BodyTooLarge(self.max_body)
            return message

        if api:
            self.traffic.enter()
        try:
            await self.app(scope, limited_receive, tracked_send)
        except Exception as exc:  # noqa: BLE001 - every error must reach the client as an OpenAI-style body
            if not isinstance(exc, HTTPException):
                log.exception("unexpected error serving %s %s", scope.get("method"), scope["path"])
            if not started:
                await response_for(exc)(scope, receive, send)
        finally:
            if api:
                self.traffic.leave()

    def _refusal(self, headers: Headers, api: bool):
        if api and self._key is not None and not self._authorized(headers.get("authorization")):
            return error_response(401, "missing or incorrect API key: send the header 'Authorization: Bearer "
                                  "<key>' with the key given to --api-key (or MUXD_API_KEY)",
                                  "invalid_request_error", None, "invalid_api_key",
                                  headers={"WWW-Authenticate": "Bearer"})
        if api and self.traffic.draining:
            return error_response(503, "the server is shutting down and takes no new requests; retry on another "
                                  "replica", "service_unavailable", None, "shutting_down")
        if api and self.traffic.in_flight >= self.max_in_flight:
            return error_response(429, f"{self.traffic.in_flight} requests are in flight (limit "
                                  f"{self.max_in_flight} = --max-num-seqs + --max-waiting); retry later",
                                  "rate_limit_error", None, "queue_full")
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            return response_for(BodyTooLarge(self.max_body))
        return None

    def _authorized(self, header: str | None) -> bool:
        scheme, _, token = (header or "").partition(" ")
        # compare_digest takes as long for any wrong key of the same length: no timing oracle on the key
        return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), self._key)
