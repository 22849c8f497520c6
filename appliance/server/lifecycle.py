"""Start-up and shutdown of the served engine: load in the background (/health answers at once, /ready after a
warm-up), and drain on SIGTERM/SIGINT: refuse new requests (503), let running ones finish within
--shutdown-timeout, end the rest with an error, then stop the server with exit code 0. A second signal hurries.
A signal while the model is still loading stops the server at once (`leave_if_loading`).
"""
from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any, Callable

import uvicorn

from appliance.config import Config
from appliance.engine.async_engine import AsyncEngine
from appliance.engine.factory import build_engine
from appliance.engine.request import SamplingParams
from appliance.engine.supervisor import RestartBudget, rebuild_engine
from appliance.errors import ApplianceError, RankError, UnavailableError
from appliance.server.gate import Traffic
from appliance.server.metrics import Metrics
from appliance.server.serving import OpenAIServing

log = logging.getLogger("muxd.server")
FLUSH_TIMEOUT_S = 5.0  # after ending the last requests, how long their final events may take to reach the clients
LOAD_THREAD = "muxd-load"


class ServerState:
    """What the routes need: the engine once loaded, readiness, metrics, traffic, a fatal start-up error if any."""

    def __init__(self, cfg: Config, on_fatal: Callable[[BaseException], None] | None) -> None:
        self.cfg = cfg
        self.metrics = Metrics(cfg.model.model_name)
        self.traffic = Traffic()
        self.engine: AsyncEngine | None = None
        self.serving: OpenAIServing | None = None
        self.ready = False
        self.on_fatal = on_fatal

    async def start(self) -> None:
        try:
            engine = await _in_daemon_thread(lambda: build_engine(self.cfg))
            engine.on_fatal(self._engine_lost)
            self.metrics.set_context(engine.max_model_len)
            srv = self.cfg.server
            # a tensor-parallel engine is not rebuilt: its other ranks hold the failed step's state, or are gone
            rebuild = rebuild_engine if self.cfg.parallel.tensor_parallel_size == 1 else None
            self.engine = AsyncEngine(engine, rebuild=rebuild, on_fatal=self._engine_stopped,
                                      restarts=RestartBudget(srv.engine_restarts, srv.engine_restart_window))
            self.engine.start()
            warm = self.engine.make_request([0] * 4, SamplingParams(max_tokens=2, ignore_eos=True, temperature=0))
            async for _ in self.engine.stream(warm):
                pass
            self.engine.on_step = self.metrics.step_done  # (the warm-up is not counted)
            self.serving = OpenAIServing(self.engine, self.cfg.model.accepted_names, self.metrics,
                                         self.cfg.model.special_tokens_in_messages)
            self.ready = True
            log.info("model %s ready (%d KV pages of %d tokens, max_model_len %d)", self.cfg.model.model_name,
                     engine.pool.num_pages, engine.pool.page_size, engine.max_model_len)
        except asyncio.CancelledError:
            raise  # shut down while loading: not a failure
        except BaseException as exc:  # noqa: BLE001 - reported and turned into a clean shutdown
            log.error("start-up failed: %s", exc)
            if self.on_fatal is not None:
                self.on_fatal(ApplianceError(f"start-up failed: {exc}"))

    def _engine_stopped(self, exc: BaseException) -> None:
        if self.on_fatal is not None:
            lost = isinstance(exc, RankError)  # it names the rank; no restart was tried
            self.on_fatal(exc if lost else ApplianceError(f"the engine stopped after failed steps: "
                                                          f"{type(exc).__name__}: {exc}"))

    def _engine_lost(self, exc: BaseException) -> None:
        """The engine can no longer run (a tensor-parallel rank died): the server ends with the error."""
        log.error("%s; the server stops", exc)
        if self.on_fatal is not None:
            self.on_fatal(exc)

    async def stop(self) -> None:
        if self.serving is not None:
            self.serving.shutdown()
        if self.engine is not None and self.cfg.server.trace_dir:
            path = Path(self.cfg.server.trace_dir).expanduser()
            path.mkdir(parents=True, exist_ok=True)
            self.engine.engine.executor.timeline.save(path / f"timeline-{os.getpid()}.json")
        if self.engine is not None:
            await asyncio.to_thread(self.engine.shutdown)
            await asyncio.to_thread(self.engine.engine.close)

    def require_ready(self) -> OpenAIServing:
        if self.engine is not None and not self.traffic.draining:
            self.engine.check_open()  # dead (500) or being rebuilt after a failed step (503)
        if self.traffic.draining:
            raise UnavailableError("the server is shutting down; retry on another replica", "shutting_down")
        if not self.ready or self.serving is None:
            raise UnavailableError("the model is still loading; poll GET /ready", "loading")
        return self.serving

    async def drain(self, timeout: float, hurry: asyncio.Event) -> None:
        """Stop taking requests, wait for the running ones (at most `timeout` s, less if `hurry` is set), end the
        rest with an error event or body."""
        traffic = self.traffic
        traffic.draining = True
        log.info("shutting down: new requests get 503; waiting up to %.0f s for %d running", timeout,
                 traffic.in_flight)
        waiter = asyncio.ensure_future(traffic.wait_idle(timeout))
        hurried = asyncio.ensure_future(hurry.wait())
        await asyncio.wait({waiter, hurried}, return_when=asyncio.FIRST_COMPLETED)
        hurried.cancel()
        waiter.cancel()
        if traffic.in_flight and self.engine is not None:
            stopped = self.engine.close(UnavailableError(
                "the server shut down before this request finished (--shutdown-timeout); retry it", "shutting_down"))
            log.warning("shutdown timeout: ended %d unfinished requests", stopped)
            if not await traffic.wait_idle(FLUSH_TIMEOUT_S):
                log.warning("%d requests had not ended %.0f s later; closing their connections",
                            traffic.in_flight, FLUSH_TIMEOUT_S)


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a draining shutdown. uvicorn would close the listening socket at once, cancel
    responses mid-body after its grace period, and re-raise the signal (exit code 143); this server keeps
    answering (503 for new work, /ready 503) while requests finish, and returns normally."""

    def __init__(self, config: uvicorn.Config, state: ServerState, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.state, self.shutdown_timeout = state, shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._hurry: asyncio.Event | None = None
        self._drain: asyncio.Task | None = None

    async def startup(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._hurry = asyncio.Event()
        await super().startup(sockets=sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        # a signal handler: runs between two bytecodes of the loop's thread, so it only schedules work
        if self._loop is None or self.should_exit:
            self.force_exit = self.should_exit
            self.should_exit = True
            return
        self._loop.call_soon_threadsafe(self._on_signal)

    def _on_signal(self) -> None:
        if self._drain is None:
            self._drain = asyncio.ensure_future(self._drain_and_exit())
        else:
            log.info("second signal: ending the running requests now")
            self._hurry.set()

    async def _drain_and_exit(self) -> None:
        try:
            await self.state.drain(self.shutdown_timeout, self._hurry)
        finally:
            self.should_exit = True


async def _in_daemon_thread(fn: Callable[[], Any]) -> Any:
    """Run fn on a daemon thread: unlike asyncio.to_thread, a shutdown during a long model load need not wait."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def settle(result: Any, exc: BaseException | None) -> None:
        if not done.done():
            done.set_result(result) if exc is None else done.set_exception(exc)

    def run() -> None:
        result, error = None, None
        try:
            result = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            error = exc
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop closed while loading: nobody is waiting any more
            pass

    threading.Thread(target=run, name=LOAD_THREAD, daemon=True).start()
    return await done


def leave_if_loading(code: int) -> None:
    """After the server stopped: if the model is still loading, end the process now with `code`. The load thread
    cannot be stopped, and finalising the interpreter under it (torch's threads in the middle of building the
    engine) aborts in C++ ("terminate called without an active exception", exit 134)."""
    if not any(t.name == LOAD_THREAD and t.is_alive() for t in threading.enumerate()):
        return
    log.info("stopped while the model was loading")
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
