"""The FastAPI application: routes, the gate in front of them and CORS (--allowed-origins ...) in front of the gate,
exception -> OpenAI error body mapping, and the lifespan (background model load; engine stopped at exit). No
`from __future__ import annotations` here: FastAPI reads the completion route's body type, built per model, from its
runtime annotation.
"""
import asyncio
import contextlib
import json
import logging
import time
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import ValidationError

from appliance.config import Config
from appliance.errors import RequestError
from appliance.model_zoo.config import ModelConfig
from appliance.model_zoo.loader import resolve_model_dir
from appliance.server import openapi
from appliance.server import protocol as p
from appliance.server import responses as r
from appliance.server import tokenize as t
from appliance.server.errors import error_response, install_handlers
from appliance.server.gate import Gate
from appliance.server.http import RequestIdHeader
from appliance.server.lifecycle import ServerState
from appliance.server.responses_api import Event, ResponseObject, responses_body

log = logging.getLogger("muxd.server")
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


class PrometheusResponse(PlainTextResponse):
    media_type = PROMETHEUS_TEXT


def create_app(cfg: Config, on_fatal: Callable[[BaseException], None] | None = None) -> FastAPI:
    state = ServerState(cfg, on_fatal)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.create_task(state.start())
        yield
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await state.stop()

    docs = {"openapi_url": None, "docs_url": None, "redoc_url": None} if cfg.vllm.disable_fastapi_docs else {}
    app = FastAPI(title="muxd", version=__import__("appliance").__version__, lifespan=lifespan, **docs,
                  description="OpenAI-compatible API of one model. Errors are {\"error\": {\"message\", \"type\", "
                              "\"param\", \"code\"}}.")
    app.root_path = cfg.vllm.root_path or ""  # as vLLM sets it: routes answer with the prefix and without it
    app.state.muxd = state
    app.add_middleware(Gate, traffic=state.traffic, max_body=cfg.server.request_byte_limit,
                       api_key=cfg.server.api_key, body_timeout=cfg.server.body_timeout,
                       max_in_flight=cfg.scheduler.max_num_seqs + cfg.scheduler.max_waiting)
    if cfg.vllm.enable_request_id_headers:  # on every answer, the gate's refusals too
        app.add_middleware(RequestIdHeader)
    # outermost (added last): preflights are answered before the gate, and its refusals carry the CORS headers
    app.add_middleware(CORSMiddleware, **cfg.server.cors())
    openapi.install(app, api_key=cfg.server.api_key is not None)

    install_handlers(app)

    @app.get("/health", response_model=r.HealthStatus, responses=openapi.errors(500),
             summary="Liveness: 200 while the process and its engine run (also while loading and draining).")
    async def health():
        if state.engine is not None and state.engine.error is not None:
            return error_response(500, f"engine stopped: {state.engine.error!r}", "internal_error", None,
                                  "engine_dead")
        return r.HealthStatus()

    @app.get("/ready", response_model=r.ReadyStatus, responses=openapi.errors(500, 503),
             summary="Readiness: 200 once the model is loaded; 503 while loading or shutting down.")
    async def ready():
        state.require_ready()
        return r.ReadyStatus(model=cfg.model.model_name)

    @app.get("/metrics", response_class=PrometheusResponse, summary="Prometheus metrics (muxd:*).",
             responses={200: {"content": {PROMETHEUS_TEXT: {"schema": {"type": "string"}}},
                              "description": "Prometheus text exposition format 0.0.4."}})
    async def metrics():
        stats = state.engine.stats if state.engine is not None else {
            "num_running": 0, "num_waiting": 0, "kv_usage": 0.0, "free_pages": 0}
        return PrometheusResponse(state.metrics.render(stats))

    @app.get("/debug/timeline", responses=openapi.errors(401, 500, 503),
             summary="The engine's recent timeline (decode steps, prefill launches per SM partition, switches, "
                     "merges) as Chrome-trace JSON, for chrome://tracing or Perfetto.")
    async def timeline():
        state.require_ready()
        return JSONResponse(state.engine.engine.executor.timeline.chrome_trace())

    created = int(time.time())  # the model cards' "created": one value, whichever route returns them

    def model_card(name: str) -> r.ModelCard:
        return r.ModelCard(id=name, root=cfg.model.model_name, max_model_len=state.require_ready().max_model_len,
                           created=created)

    @app.get("/v1/models", response_model=r.ModelList, responses=openapi.errors(401, 500, 503),
             summary="The served model, a card per name it is served under (--served-model-name a b).")
    async def models():
        return r.ModelList(data=[model_card(name) for name in cfg.model.served_names])

    @app.get("/v1/models/{model:path}", response_model=r.ModelCard, responses=openapi.errors(401, 404, 500, 503),
             summary="One served model, as /v1/models lists it (404 model_not_found for any other id).")
    async def model(model: str):
        return model_card(state.require_ready().check_model(model))

    # bodies specialised to this model: token ids within its vocabulary, slo_class among its contract's classes,
    # thinking_token_budget where a reasoning parser serves it
    contract = cfg.scheduler.contract
    vocab_size = ModelConfig.from_file(resolve_model_dir(cfg.model.model_dir) / "config.json",
                                       cfg.model.config_overrides()).vocab_size
    completion_body, chat_body = p.bodies_for(vocab_size, list(contract.classes), cfg.server.reasoning_parser != "none")
    detokenize_body = t.detokenize_body(vocab_size)
    response_body = responses_body(chat_body)

    @app.post("/v1/completions", response_model=None, responses={
        **openapi.streamed(r.CompletionResponse, r.CompletionResponse), **openapi.errors(*openapi.GENERATE_ERRORS)})
    async def completions(body: completion_body, request: Request):  # type: ignore[valid-type]
        return await state.require_ready().completion(body, request)

    @app.post("/v1/chat/completions", response_model=None, responses={
        **openapi.streamed(r.ChatCompletionResponse, r.ChatCompletionChunk),
        **openapi.errors(*openapi.GENERATE_ERRORS)})
    async def chat_completions(body: chat_body, request: Request):  # type: ignore[valid-type]
        return await state.require_ready().chat(body, request)

    @app.post("/v1/responses", response_model=None, summary="OpenAI's Responses API, for text (as vLLM serves it).",
              responses={**openapi.streamed(ResponseObject, Event), **openapi.errors(*openapi.GENERATE_ERRORS)})
    async def responses(body: response_body, request: Request):  # type: ignore[valid-type]
        return await state.require_ready().responses(body, chat_body, request)

    @app.post("/invocations", response_model=None, responses={
        **openapi.streamed(r.ChatCompletionResponse | r.CompletionResponse, r.ChatCompletionChunk,
                           r.CompletionResponse),
        **openapi.errors(*openapi.GENERATE_ERRORS)},
              summary="SageMaker's route (as vLLM serves it): a body with messages is a chat completion, one with a "
                      "prompt a completion; behind the API key as /v1 is.",
              openapi_extra={"requestBody": {"required": True, "content": {"application/json": {"schema": {
                  "anyOf": [{"$ref": "#/components/schemas/ChatCompletionRequest"},
                            {"$ref": "#/components/schemas/CompletionRequest"}]}}}}})
    async def invocations(request: Request):
        try:
            data = json.loads(await request.body())
        except ValueError:
            raise RequestError("the body is not JSON", None) from None
        kind = None if not isinstance(data, dict) else chat_body if "messages" in data else \
            completion_body if "prompt" in data else None
        if kind is None:
            raise RequestError("/invocations takes a chat completion (a body with messages) or a completion (a body "
                               "with a prompt)", None)
        try:
            body = kind.model_validate(data)
        except ValidationError as exc:
            raise RequestValidationError(exc.errors()) from None
        serving = state.require_ready()
        return await (serving.chat if kind is chat_body else serving.completion)(body, request)

    @app.api_route("/ping", methods=["GET", "POST"], response_model=r.HealthStatus, responses=openapi.errors(500),
                   summary="SageMaker's health check: /health.")
    async def ping():
        return await health()

    @app.get("/version", response_model=r.VersionResponse, summary="The muxd version.")
    async def version():
        return r.VersionResponse(version=__import__("appliance").__version__)

    @app.get("/load", response_model=r.ServerLoad, summary="vLLM's load: with --enable-server-load-tracking, the "
             "requests in flight on /v1 and /invocations; without it, 0.")
    async def load():
        return r.ServerLoad(server_load=state.traffic.in_flight if cfg.vllm.enable_server_load_tracking else 0)

    if cfg.vllm.enable_tokenizer_info_endpoint:  # (as vLLM's: the route exists with the flag only)
        @app.get("/tokenizer_info", response_model=dict[str, Any], responses=openapi.errors(400, 500, 503),
                 summary="vLLM's tokenizer information: tokenizer_config.json's fields (less vocabulary file "
                 "paths, tokens as their text), tokenizer_class and the chat template served.")
        async def tokenizer_info():
            return state.require_ready().tokenizer_info()

    @app.post("/tokenize", response_model=r.TokenizeResponse, responses=openapi.errors(400, 401, 404, 413, 500, 503),
              summary="Token ids of a prompt, or of chat messages rendered through the chat template (as vLLM).")
    async def tokenize(body: t.TokenizeRequest):
        return await state.require_ready().tokenize(body)

    @app.post("/detokenize", response_model=r.DetokenizeResponse,
              responses=openapi.errors(400, 401, 404, 413, 500, 503),
              summary="The text of token ids (as vLLM).")
    async def detokenize(body: detokenize_body):  # type: ignore[valid-type]
        return await state.require_ready().detokenize(body)

    return app
