"""AsyncEngine: runs an Engine's step loop on a background thread and gives each request an async token stream.

Requests are validated on the caller's thread (so bad input fails before any streaming starts) and handed to the engine
thread through an inbox; aborts travel the same way. Closing a stream early (client gone) aborts its request, which
frees its KV pages on the engine's next loop turn. `close` ends every open stream with an error (shutdown).

A step that raises is supervised: every request the engine held, and every one waiting in the inbox, ends at once
with an error; the engine is rebuilt around the same weights (engine/supervisor.py) while new requests get 503; past
the restart budget the engine stops for good and `on_fatal` tells the server to exit.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import AsyncIterator, Callable

import torch

from appliance.engine import gc_pauses
from appliance.engine.engine import Engine
from appliance.engine.request import Request, RequestOutput, SamplingParams
from appliance.engine.supervisor import RestartBudget
from appliance.errors import RequestError, UnavailableError

log = logging.getLogger("muxd.engine")
RESTARTING = "engine_restarting"  # the 503 code while a new engine is built
MAX_RETRY_AFTER_S = 60.0  # the longest Retry-After a rebuild's 503 asks for (clients such as OpenAI's SDK honour up
#                           to 60 s and back off on their own beyond; a retry still too early gets the time left)
CONTROL_EVERY_S = 0.5  # the closed loop's state is published this often while steps run


class EngineDeadError(RuntimeError):
    """The engine loop stopped on an unexpected error; no request can be served any more."""


class EngineStepError(RuntimeError):
    """An engine step failed while this request was in the engine; the request was ended (the engine restarts)."""


class AsyncEngine:
    def __init__(self, engine: Engine, rebuild: Callable[[Engine], Engine] | None = None,
                 restarts: RestartBudget | None = None,
                 on_fatal: Callable[[BaseException], None] | None = None) -> None:
        """rebuild: makes a new engine from a failed one (None: a failed step stops the engine for good);
        restarts: how many failures it recovers from; on_fatal: called on the event loop when it stops for good."""
        self.engine = engine
        self.rebuild, self.on_fatal = rebuild, on_fatal
        self.restarts = restarts or RestartBudget(3, 300.0)
        self.restart_count = 0
        self._restart_began: float | None = None  # (monotonic) when the engine being rebuilt failed
        self._rebuild_s: float | None = None  # how long the last rebuild took
        self.on_rebuilt: Callable[[Engine], None] | None = None  # told of each rebuilt engine before it steps
        self.restarting = False
        self._lock = threading.Lock()  # the state (restarting, dead, closed) and the inbox change together
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = False
        self.error: BaseException | None = None
        self._closed: BaseException | None = None
        self.stats: dict[str, float] = {}
        self._control: dict = {}
        self._control_at = 0.0
        self._gc: dict = {}
        self._memory: dict = {}  # the caching allocator against the memory budget (engine/memory_guard.py)
        self.engine_cpu_s = 0.0  # the engine thread's CPU time so far (its share of the interpreter, with the loop's)
        self.on_step: Callable[[list[RequestOutput]], None] | None = None  # given each step's outputs, on the loop
        self._publish_stats()

    # ---- lifecycle --------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; call from inside the event loop that will consume the streams. Everything alive
        now (the model, compiled code, graphs) leaves the garbage collector's reach (engine/gc_pauses.py)."""
        gc_pauses.freeze()
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="muxd-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        gc_pauses.unfreeze()

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
        rid = request.request_id
        outputs: asyncio.Queue = asyncio.Queue()
        accepted = asyncio.get_running_loop().create_future()
        with self._lock:  # the engine thread cannot fail, restart or stop between this check and the put
            self.check_open()
            if rid in self._streams:
                raise RequestError(f"request id {rid!r} is already in use", "request_id")
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

    def check_open(self) -> None:
        """Raise what a new request would meet now: the engine dead, shut down, or being rebuilt (503)."""
        if self.error is not None:
            raise EngineDeadError(f"engine stopped: {self.error!r}")
        if self._closed is not None:
            raise self._closed
        if self.restarting:
            raise self._restarting_error()

    def _restarting_error(self) -> UnavailableError:
        """The 503 of a request met by a rebuild: with the seconds the rebuild likely has left (the last rebuild's
        time, else the failed engine's build), at most MAX_RETRY_AFTER_S, as its Retry-After."""
        expected = self._rebuild_s or getattr(self.engine, "startup", {}).get("build_s")
        if not expected or self._restart_began is None:
            return UnavailableError("the engine is restarting after a failed step; retry in a few seconds", RESTARTING)
        left = expected - (time.monotonic() - self._restart_began)
        wait = min(MAX_RETRY_AFTER_S, left if left >= 1.0 else 5.0)
        return UnavailableError(f"the engine is restarting after a failed step (the last engine build took "
                                f"{expected:.0f} s); retry in about {wait:.0f} s", RESTARTING, retry_after=wait)

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id, None))
        self._wake.set()

    def close(self, exc: BaseException) -> int:
        """Refuse new requests with `exc` and end every open stream with it (their requests are aborted as their
        consumers stop). Call on the event loop; returns how many streams were open."""
        with self._lock:
            self._closed = exc
        open_streams = len(self._streams)
        self._fail_all(exc)
        return open_streams

    # ---- engine thread ----------------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop:
            try:
                self._turn()
            except BaseException as exc:  # noqa: BLE001 - every failure ends its requests and is recovered from
                if not self._recover(exc):
                    return

    def _turn(self) -> None:
        self._drain_inbox()
        if self.engine.has_unfinished():
            outputs = self.engine.step()
            self.engine_cpu_s = time.thread_time()
            self._publish_stats(fresh_control=False)
            if outputs:
                self._loop.call_soon_threadsafe(self._dispatch, outputs)
        else:
            self.engine_cpu_s = time.thread_time()
            self._publish_stats()
            self._wake.wait(timeout=0.5)
            self._wake.clear()

    def _recover(self, exc: BaseException) -> bool:
        """End every request of the failed engine and of the inbox with an error, then rebuild the engine (True) or,
        past the restart budget or when rebuilding fails, stop for good and tell `on_fatal` (False)."""
        log.error("engine step failed: %s: %s%s", type(exc).__name__, exc, _hint(exc), exc_info=exc)
        with self._lock:
            self._restart_began = time.monotonic()
            self.restarting = True
            pending = self._take_inbox()
        old = self.engine
        failed = EngineStepError(f"the engine failed while serving this request ({type(exc).__name__}: {exc}); it "
                                 "was ended and the engine restarted: retry it")
        self._end(list(old.scheduler.requests), failed, pending, self._restarting_error())
        allowed = self.rebuild is not None and self.restarts.allow(time.monotonic())
        if allowed:
            started = time.monotonic()
            try:
                self.engine = self.rebuild(old)
                del old
                gc_pauses.freeze()
            except BaseException as rebuild_exc:  # noqa: BLE001 - a rebuild that fails is the end
                log.error("rebuilding the engine failed: %s: %s", type(rebuild_exc).__name__, rebuild_exc,
                          exc_info=rebuild_exc)
                exc, allowed = rebuild_exc, False
        if not allowed:
            self._die(exc)
            return False
        self.restart_count += 1
        self._rebuild_s = time.monotonic() - started
        if self.on_rebuilt is not None:
            try:
                self.on_rebuilt(self.engine)
            except Exception:  # noqa: BLE001 - an observer's failure does not stop the serving engine
                log.exception("a hook on the rebuilt engine failed")
        with self._lock:
            self.restarting = False
        log.warning("engine rebuilt in %.1f s after a failed step (%d failures in the last %.0f s, %d allowed); "
                    "serving again", time.monotonic() - started, self.restarts.recent, self.restarts.window_s,
                    self.restarts.restarts)
        return True

    def _die(self, exc: BaseException) -> None:
        with self._lock:
            self.error = exc
            self.restarting = False
            pending = self._take_inbox()
        dead = EngineDeadError(f"engine stopped: {exc!r}")
        self._end(None, dead, pending, dead)
        if self.rebuild is not None:
            log.critical("the engine failed %d times within %.0f s (more than the %d restarts allowed) or could not "
                         "be rebuilt: stopping the server so that its supervisor restarts the process",
                         self.restarts.recent, self.restarts.window_s, self.restarts.restarts)
        if self.on_fatal is not None:
            self._loop.call_soon_threadsafe(self.on_fatal, exc)

    def _take_inbox(self) -> list[tuple[Request, asyncio.Future]]:
        """Empty the inbox (under the lock); returns the requests that were waiting to be added."""
        adds = []
        while True:
            try:
                kind, item, done = self._inbox.get_nowait()
            except queue.Empty:
                return adds
            if kind == "add":
                adds.append((item, done))

    def _end(self, ids: list[str] | None, exc: BaseException, pending: list[tuple[Request, asyncio.Future]],
             pending_exc: BaseException) -> None:
        """On the event loop: end the streams of `ids` (None: every open stream) with `exc`, and refuse the
        `pending` adds with `pending_exc` (their submit raises it before any output)."""
        def end() -> None:
            for rid in list(self._streams) if ids is None else ids:
                q = self._streams.get(rid)
                if q is not None:
                    q.put_nowait(exc)
            for _, done in pending:
                _resolve(done, pending_exc)

        self._loop.call_soon_threadsafe(end)

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

    def _publish_stats(self, fresh_control: bool = True) -> None:
        """The figures /metrics reads. The closed loop's state (percentiles of recent gaps) and the garbage
        collector's counts are taken at most every CONTROL_EVERY_S while steps run, and afresh whenever the engine
        goes idle."""
        sched, pool = self.engine.scheduler, self.engine.pool
        now = time.monotonic()
        if fresh_control or now - self._control_at >= CONTROL_EVERY_S:
            self._control, self._control_at = sched.planner.control_state(), now
            self._gc = gc_pauses.recorder().snapshot()
            guard = self.engine.executor.memory_guard
            self._memory = {} if guard is None else {"allocator_reserved_bytes": guard.reserved_bytes(),
                                                     "allocator_budget_bytes": guard.limit,
                                                     "allocator_releases": guard.releases}
        executor = self.engine.executor
        planner_stats = getattr(sched.planner, "stats", None)
        self.stats = {"num_waiting": len(sched.waiting), "num_running": sched.num_running,
                      "kv_usage": pool.usage, "free_pages": pool.num_free_pages,
                      "num_preemptions": self.engine.num_preemptions,
                      "decode_sms": executor.current.decode_sms, "partition_switches": executor.switches,
                      "prefill_layers_launched": executor.layers_launched,
                      "prefill_pauses": getattr(planner_stats, "pauses", 0),
                      "control": self._control, "gc": self._gc, "engine_cpu_s": self.engine_cpu_s, **self._memory}

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        if self.on_step is not None:
            self.on_step(outputs)
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


def _hint(exc: BaseException) -> str:
    """What a user can change so that the failure does not come back, where the failure says (else '')."""
    if isinstance(exc, torch.OutOfMemoryError):
        return ("\nThe GPU ran out of memory within a step (its activations did not fit beside the weights and the KV "
                "cache): serve with a lower --gpu-memory-utilization (a smaller KV cache, more room for activations) "
                "or a lower --max-num-batched-tokens (smaller steps).")
    return ""
