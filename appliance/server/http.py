"""uvicorn's HTTP/1.1 protocol (h11) with a header deadline: a connection must deliver a request's complete headers
within --header-timeout seconds of opening, or of the end of its previous response, or it is closed. uvicorn's own
keep-alive timeout closes idle connections only until their first byte arrives, so a client that sends its headers
one byte at a time would otherwise hold a connection forever. (The body deadline is the gate's: server/gate.py.)
A request of more than `max_header_count` headers (--h11-max-header-count) gets HTTP 431 and the connection closes.
Also the X-Request-Id response header of --enable-request-id-headers, and the access log's filter of
--disable-access-log-for-endpoints.
"""
from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("muxd.server")


class HeaderDeadlineProtocol(H11Protocol):
    def __init__(self, *args: Any, header_timeout: float = 10.0, max_header_count: int | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout = header_timeout
        self._header_timer: asyncio.TimerHandle | None = None
        if max_header_count is not None:
            parse = self.conn.next_event

            def next_event():
                event = parse()
                if isinstance(event, h11.Request) and len(event.headers) > max_header_count:
                    self._refuse_headers(len(event.headers), max_header_count)
                    return h11.NEED_DATA  # (uvicorn's loop stops; the connection is closing)
                return event

            self.conn.next_event = next_event  # type: ignore[method-assign]

    def _refuse_headers(self, count: int, limit: int) -> None:
        """HTTP 431 naming the count, then close (the request never reaches the app)."""
        self._disarm()
        log.warning("refused a request of %d headers (--h11-max-header-count %d)", count, limit)
        body = f"the request has {count} headers; this server takes at most {limit}".encode()
        headers = [(b"content-type", b"text/plain; charset=utf-8"), (b"connection", b"close")]
        for event in (h11.Response(status_code=431, headers=headers, reason=b"Request Header Fields Too Large"),
                      h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the request line and every header have arrived
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()  # the next request on this keep-alive connection gets the same deadline

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_too_slow)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            log.debug("closing a connection whose request headers did not arrive within %g s", self.header_timeout)
            self.transport.close()


class RequestIdHeader:
    """ASGI middleware (vLLM's --enable-request-id-headers): every response carries an X-Request-Id header, the
    request's own X-Request-Id or a new one."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k == b"x-request-id"), None) or uuid.uuid4().hex.encode()

        async def sending(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", given)]}
            await send(message)

        await self.app(scope, receive, sending)


class QuietPaths(logging.Filter):
    """Leaves out of uvicorn's access log the requests for some paths (their query strings aside)."""

    def __init__(self, paths: frozenset[str]) -> None:
        super().__init__()
        self.paths = paths

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args  # uvicorn's: (client, method, path with query, HTTP version, status)
        if not isinstance(args, tuple) or len(args) < 3:
            return True
        return str(args[2]).partition("?")[0] not in self.paths
