"""AsyncEngine: runs an Engine's step loop on a background thread and gives each request an async token stream.

Requests are validated on the caller's thread (so bad input fails before any streaming starts) and handed to the engine
thread through an inbox; aborts travel the same way. Closing a stream early (client gone) aborts its request, which
frees its KV pages on the engine's next loop turn. `close` ends every open stream with an error (shutdown).
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import AsyncIterator

from appliance.engine.engine import Engine
from appliance.engine.request import Request, RequestOutput, SamplingParams
from appliance.errors import RequestError

log = logging.getLogger("muxd.engine")


class EngineDeadError(RuntimeError):
    """The engine loop stopped on an unexpected error; no request can be served any more."""


class AsyncEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = False
        self.error: BaseException | None = None
        self._closed: BaseException | None = None
        self.stats: dict[str, float] = {}
        self._publish_stats()

    # ---- lifecycle --------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; call from inside the event loop that will consume the streams."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="muxd-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self.error is None and self._thread is not None and self._thread.is_alive()

    # ---- requests ---------------------------------------------------------------------------------------------
    def make_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                     add_special_tokens: bool = True) -> Request:
        """Validate and tokenize now (raises RequestError); stream it later with `stream`."""
        return self.engine.make_request(prompt, params, request_id, add_special_tokens)

    async def submit(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Hand a request made by `make_request` to the engine; returns its output stream once accepted.

        Raises here (before any output) when the engine refuses it: CapacityError when the waiting queue is full.
        Iterate the stream to the end or close it: leaving early aborts the request and frees its pages.
        """
        if self.error is not None:
            raise EngineDeadError(f"engine stopped: {self.error!r}")
        if self._closed is not None:
            raise self._closed
        rid = request.request_id
        if rid in self._streams:
            raise RequestError(f"request id {rid!r} is already in use", "request_id")
        outputs: asyncio.Queue = asyncio.Queue()
        accepted = asyncio.get_running_loop().create_future()
        self._streams[rid] = outputs
        self._inbox.put(("add", request, accepted))
        self._wake.set()
        try:
            await accepted
        except BaseException:
            self._streams.pop(rid, None)
            raise
        return self._outputs(rid, outputs)

    async def _outputs(self, rid: str, outputs: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                out = await outputs.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
        finally:
            self._streams.pop(rid, None)
            if not finished:
                self.abort(rid)

    async def stream(self, request: Request) -> AsyncIterator[RequestOutput]:
        """submit() and iterate in one: yields the request's outputs until it finishes."""
        outputs = await self.submit(request)
        try:
            async for out in outputs:
                yield out
        finally:
            await outputs.aclose()  # type: ignore[attr-defined]

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id, None))
        self._wake.set()

    def close(self, exc: BaseException) -> int:
        """Refuse new requests with `exc` and end every open stream with it (their requests are aborted as their
        consumers stop). Call on the event loop; returns how many streams were open."""
        self._closed = exc
        open_streams = len(self._streams)
        self._fail_all(exc)
        return open_streams

    # ---- engine thread ----------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop:
                self._drain_inbox()
                if self.engine.has_unfinished():
                    outputs = self.engine.step()
                    self._publish_stats()
                    if outputs:
                        self._loop.call_soon_threadsafe(self._dispatch, outputs)
                else:
                    self._publish_stats()
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
        except BaseException as exc:  # noqa: BLE001 - the loop must report every failure to the waiting clients
            log.exception("engine loop failed")
            self.error = exc
            dead = EngineDeadError(f"engine stopped: {exc!r}")
            self._loop.call_soon_threadsafe(self._fail_all, dead)

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item, done = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                try:
                    self.engine.submit(item)
                    self._loop.call_soon_threadsafe(_resolve, done, None)
                except Exception as exc:  # noqa: BLE001 - handed to the caller
                    self._loop.call_soon_threadsafe(_resolve, done, exc)
            else:
                self.engine.abort(item)

    def _publish_stats(self) -> None:
        sched, pool = self.engine.scheduler, self.engine.pool
        executor = self.engine.executor
        planner_stats = getattr(sched.planner, "stats", None)
        self.stats = {"num_waiting": len(sched.waiting), "num_running": sched.num_running,
                      "kv_usage": pool.usage, "free_pages": pool.num_free_pages,
                      "num_preemptions": self.engine.num_preemptions,
                      "decode_sms": executor.current.decode_sms, "partition_switches": executor.switches,
                      "prefill_layers_launched": executor.layers_launched,
                      "prefill_pauses": getattr(planner_stats, "pauses", 0),
                      "control": sched.planner.control_state()}

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            q = self._streams.get(out.request_id)
            if q is not None:
                q.put_nowait(out)

    def _fail_all(self, exc: BaseException) -> None:
        for q in self._streams.values():
            q.put_nowait(exc)


def _resolve(fut: asyncio.Future, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)
