"""The ingress's side of one request: send it to a replica, and retry it on another while the client has seen
nothing, so that nothing that had not started is lost; once it has started, relay it, and end it with a clear error
if its replica dies.

A request *starts* when the ingress first sends the client a byte, which it holds back until the replica's answer
carries output: for a stream, the first SSE event with text, a token, a finish reason, usage or an error (a chat
stream's role-only opening event waits with the rest); for anything else, the whole body. Until then a lost replica,
or a 429 or 503 from one (queue full, draining), sends the request to another replica, at most `retries` times. A
replica silent for `stall_timeout` seconds counts as lost: nothing hangs.
"""
from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator, Callable, Protocol

from appliance.cluster.hints import RoutingHints
from appliance.errors import UnavailableError
from appliance.server.errors import sse_error

log = logging.getLogger("muxd.cluster")
RETRYABLE = (429, 503)


class ReplicaLost(Exception):
    """The replica serving a request died, became unreachable or stopped answering."""

    def __init__(self, replica: str | None, detail: str) -> None:
        super().__init__(detail)
        self.replica = replica


class Backend(Protocol):
    def open(self, request: dict[str, Any], hints: RoutingHints) -> AsyncIterator[tuple]:
        """One replica's answer: ("start", status, headers, replica), then ("body", bytes); ReplicaLost when the
        replica is lost. Closing it early cancels the request on the replica."""


@dataclass
class Counters:
    """What the relay did, for the ingress's /metrics."""

    routed: dict[str, int]
    retries: int = 0
    lost_mid_stream: int = 0
    unavailable: int = 0


@dataclass
class Answer:
    """A started answer: its status and headers, the bytes held back so far, and the rest of it (None when done)."""

    status: int
    headers: list[tuple[bytes, bytes]]
    replica: str
    held: list[bytes]
    rest: AsyncIterator[tuple] | None
    streaming: bool


async def _next(stream: AsyncIterator[tuple], timeout: float, replica: str | None) -> tuple | None:
    try:
        return await asyncio.wait_for(stream.__anext__(), timeout)
    except StopAsyncIteration:
        return None
    except asyncio.TimeoutError:
        raise ReplicaLost(replica, f"no answer for {timeout:g} s (--stall-timeout)") from None


def carries_output(event: bytes) -> bool:
    """Whether one SSE event is more than a chat stream's role-only opening."""
    data = b"".join(line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:"))
    if not data or data == b"[DONE]":
        return bool(data)
    try:
        body = json.loads(data)
    except ValueError:
        return True
    choices = body.get("choices") if isinstance(body, dict) else None
    if not isinstance(choices, list) or not choices or "error" in body:
        return True
    for choice in choices:
        if not isinstance(choice, dict):
            return True
        if choice.get("finish_reason") or choice.get("text") or choice.get("logprobs"):
            return True
        delta = choice.get("delta") or {}
        if any(value for key, value in delta.items() if key != "role"):
            return True
    return False


class Relay:
    def __init__(self, backend: Backend, retries: int, stall_timeout: float) -> None:
        self.backend, self.retries, self.stall_timeout = backend, retries, stall_timeout
        self.counters = Counters(routed={})

    async def send(self, request: dict[str, Any], hints: RoutingHints) -> Answer:
        """Route `request` until an answer starts; UnavailableError when every try was lost."""
        avoid: list[str] = list(hints.avoid)
        last = "no replica answered"
        for attempt in range(self.retries + 1):
            final = attempt == self.retries
            stream = self.backend.open(request, replace(hints, avoid=tuple(avoid)))
            replica: str | None = None
            try:
                start = await _next(stream, self.stall_timeout, None)
                if start is None or start[0] != "start":
                    raise ReplicaLost(None, "the replica ended the request without an answer")
                _, status, headers, replica = start
                if status in RETRYABLE and not final:
                    last = f"replica {replica} answered {status}"
                    await _close(stream)
                    avoid.append(replica)
                    self.counters.retries += 1
                    continue
                answer = await self._hold(stream, status, headers, replica)
                self.counters.routed[replica] = self.counters.routed.get(replica, 0) + 1
                return answer
            except ReplicaLost as exc:
                await _close(stream)
                lost = exc.replica or replica
                last = f"replica {lost or '?'} was lost before answering: {exc}"
                log.warning("request not started, %s; %s", last, "giving up" if final else "retrying")
                if lost:
                    avoid.append(lost)
                if not final:
                    self.counters.retries += 1
        self.counters.unavailable += 1
        raise UnavailableError(f"no replica could serve the request ({self.retries + 1} tries; last: {last}); "
                               "retry later", "replica_unavailable")

    async def _hold(self, stream: AsyncIterator[tuple], status: int, headers: list[tuple[bytes, bytes]],
                    replica: str) -> Answer:
        """Hold the answer back until it carries output (a stream) or ends (anything else)."""
        streaming = status == 200 and any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                                          for k, v in headers)
        held: list[bytes] = []
        pending = b""
        while True:
            message = await _next(stream, self.stall_timeout, replica)
            if message is None:
                return Answer(status, headers, replica, held, None, streaming)
            held.append(message[1])
            if streaming:
                pending += message[1]
                *events, pending = pending.split(b"\n\n")
                if any(carries_output(e) for e in events):
                    return Answer(status, headers, replica, held, stream, streaming)

    async def body(self, answer: Answer) -> AsyncIterator[bytes]:
        """The answer's bytes; a stream whose replica is lost ends with an error event and [DONE]."""
        for chunk in answer.held:
            yield chunk
        if answer.rest is None:
            return
        try:
            while True:
                message = await _next(answer.rest, self.stall_timeout, answer.replica)
                if message is None:
                    return
                yield message[1]
        except ReplicaLost as exc:
            self.counters.lost_mid_stream += 1
            log.warning("replica %s lost mid-stream: %s", answer.replica, exc)
            yield sse_error(UnavailableError(
                f"the replica serving this request ({answer.replica}) was lost after the answer had started "
                f"({exc}); the output above is all there is: retry the request", "replica_lost")).encode()
            yield b"data: [DONE]\n\n"
        finally:
            await _close(answer.rest)


async def _close(stream: AsyncIterator[tuple] | None) -> None:
    aclose: Callable[[], Any] | None = getattr(stream, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except Exception:  # noqa: BLE001 - closing a lost replica's stream may fail again; nothing more to do
            pass
