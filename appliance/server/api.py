"""The FastAPI application: routes, OpenAI-style error bodies, and start-up (the model loads in the background so
/health answers at once and /ready turns 200 after loading and a warm-up generation).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from appliance.config import ServeConfig
from appliance.engine.async_engine import AsyncEngine, EngineDeadError
from appliance.engine.engine import Engine
from appliance.engine.request import SamplingParams
from appliance.errors import ApplianceError, CapacityError, RequestError
from appliance.server import protocol as p
from appliance.server.metrics import Metrics
from appliance.server.serving import OpenAIServing

log = logging.getLogger("muxd.server")


def error_response(status: int, message: str, type_: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    body = p.ErrorResponse(error=p.ErrorInfo(message=message, type=type_, param=param, code=code))
    return JSONResponse(status_code=status, content=body.model_dump(), headers=headers)


class ServerState:
    """What the routes need: the engine once loaded, readiness, metrics, a fatal start-up error if any."""

    def __init__(self, cfg: ServeConfig, on_fatal: Callable[[BaseException], None] | None) -> None:
        self.cfg = cfg
        self.metrics = Metrics(cfg.model_name)
        self.engine: AsyncEngine | None = None
        self.serving: OpenAIServing | None = None
        self.ready = False
        self.on_fatal = on_fatal

    async def start(self) -> None:
        try:
            engine: Engine = await asyncio.to_thread(self.cfg.build_engine)
            self.engine = AsyncEngine(engine)
            self.engine.start()
            warm = self.engine.make_request([0] * 4, SamplingParams(max_tokens=2, ignore_eos=True, temperature=0))
            async for _ in self.engine.stream(warm):
                pass
            self.serving = OpenAIServing(self.engine, self.cfg.model_name, self.metrics)
            self.ready = True
            log.info("model %s ready (%d KV pages of %d tokens, max_model_len %d)", self.cfg.model_name,
                     engine.pool.num_pages, engine.pool.page_size, engine.max_model_len)
        except BaseException as exc:  # noqa: BLE001 - reported and turned into a clean shutdown
            log.error("start-up failed: %s", exc)
            if self.on_fatal is not None:
                self.on_fatal(exc)
            raise

    def require_ready(self) -> OpenAIServing:
        if self.engine is not None and self.engine.error is not None:
            raise EngineDeadError(f"engine stopped: {self.engine.error!r}")
        if not self.ready or self.serving is None:
            raise _NotReady()
        return self.serving


class _NotReady(Exception):
    pass


def create_app(cfg: ServeConfig, on_fatal: Callable[[BaseException], None] | None = None) -> FastAPI:
    state = ServerState(cfg, on_fatal)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.create_task(state.start())
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # exceptions are logged in start()
        yield
        task.cancel()
        if state.engine is not None:
            await asyncio.to_thread(state.engine.shutdown)

    app = FastAPI(title="muxd", version=__import__("appliance").__version__, lifespan=lifespan)
    app.state.muxd = state

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            return error_response(400, f"request body is not valid JSON: {first.get('msg')}",
                                  "invalid_request_error", None, "invalid_json")
        param = ".".join(loc) or None
        message = "; ".join(f"{'.'.join(str(x) for x in e.get('loc', ()) if x != 'body')}: {e.get('msg')}"
                            for e in errors)
        return error_response(400, message, "invalid_request_error", param, "invalid_value")

    @app.exception_handler(RequestError)
    async def _bad_request(_: Request, exc: RequestError):
        return error_response(400, str(exc), "invalid_request_error", exc.param,
                              "model_not_found" if exc.param == "model" else "invalid_value")

    @app.exception_handler(CapacityError)
    async def _busy(_: Request, exc: CapacityError):
        return error_response(429, str(exc), "rate_limit_error", None, "queue_full",
                              headers={"Retry-After": str(max(1, math.ceil(exc.retry_after)))})

    @app.exception_handler(_NotReady)
    async def _not_ready(_: Request, exc: _NotReady):
        return error_response(503, "the model is still loading; poll GET /ready", "service_unavailable",
                              headers={"Retry-After": "5"})

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, exc: EngineDeadError):
        return error_response(500, str(exc), "internal_error")

    @app.exception_handler(ApplianceError)
    async def _appliance(_: Request, exc: ApplianceError):
        return error_response(400, str(exc), "invalid_request_error")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail), "invalid_request_error")

    @app.get("/health")
    async def health():
        if state.engine is not None and state.engine.error is not None:
            return error_response(500, f"engine stopped: {state.engine.error!r}", "internal_error")
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        state.require_ready()
        return {"status": "ready", "model": cfg.model_name}

    @app.get("/metrics")
    async def metrics():
        stats = state.engine.stats if state.engine is not None else {
            "num_running": 0, "num_waiting": 0, "kv_usage": 0.0, "free_pages": 0}
        return Response(state.metrics.render(stats), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        serving = state.require_ready()
        return p.ModelList(data=[p.ModelCard(id=cfg.model_name, max_model_len=serving.max_model_len)])

    @app.post("/v1/completions")
    async def completions(body: p.CompletionRequest, request: Request):
        return await state.require_ready().completion(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: p.ChatCompletionRequest, request: Request):
        return await state.require_ready().chat(body, request)

    return app
