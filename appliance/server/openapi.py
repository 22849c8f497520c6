"""The OpenAPI document, made to tell the truth: invalid bodies are 400 (never FastAPI's 422) with the OpenAI error
body, each route lists the statuses it can answer (Retry-After on 429/503), /metrics is Prometheus text, streams
are text/event-stream, the bearer scheme is declared when --api-key is set, and a route serving several methods
(/ping: GET and POST) has an operation ID per method.
"""
from __future__ import annotations

import copy
from typing import Any

from fastapi import FastAPI
from fastapi.routing import APIRoute
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from appliance.server.responses import ErrorResponse

_REF = "#/components/schemas/"
_EXTRA_SCHEMAS: set[type[BaseModel]] = set()  # models referenced only from event-stream schemas

_ERROR_DOC = {
    400: "Invalid request: wrong type, unknown field, unsupported option, prompt longer than the context.",
    401: "Missing or wrong API key (only when the server runs with --api-key).",
    404: "The model named in the body is not served here (code model_not_found).",
    408: "The request body did not arrive within --body-timeout seconds.",
    413: "Request body larger than --max-request-bytes.",
    429: "Too many requests in flight or waiting; retry after Retry-After seconds.",
    500: "Internal error: an engine step failed while serving the request (code engine_step_failed), or the engine "
         "stopped (engine_dead).",
    503: "The model is still loading, the engine is restarting after a failed step, or the server is shutting down; "
         "retry after Retry-After seconds.",
}
_RETRY = {"Retry-After": {"description": "Seconds to wait before retrying.", "schema": {"type": "string"}}}
GENERATE_ERRORS = (400, 401, 404, 408, 413, 429, 500, 503)


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` entries for a route: each status with the error body."""
    out: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        out[status] = {"model": ErrorResponse, "description": _ERROR_DOC[status]}
        if status in (429, 503):
            out[status]["headers"] = _RETRY
    return out


def streamed(model: Any, *chunks: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """200 as a JSON body (`model`, a union where a route answers in several forms), or with "stream": true as
    server-sent events: chunks (of one of `chunks`), an error body if the request fails after the stream started, and
    `data: [DONE]`. `itemSchema` describes one event (OpenAPI 3.2)."""
    _EXTRA_SCHEMAS.update(chunks)
    payload = {"anyOf": [*({"$ref": f"{_REF}{chunk.__name__}"} for chunk in chunks), {"$ref": f"{_REF}ErrorResponse"}]}
    event = {"type": "object", "required": ["data"], "properties": {
        "event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"},
        "data": {"anyOf": [{"const": "[DONE]"}, {"type": "string", "contentMediaType": "application/json",
                                                 "contentSchema": payload}]}}}
    return {200: {"model": model, "description": "The result; with \"stream\": true, server-sent events of chunks "
                  "ending with 'data: [DONE]' (an error after the stream started arrives as a data event holding "
                  "the error body).",
                  "content": {"text/event-stream": {"itemSchema": event}}}}


def install(app: FastAPI, api_key: bool) -> None:
    """Replace app.openapi with a generator that post-processes FastAPI's document once."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=_one_method_each(app.routes))
            for path, item in schema.get("paths", {}).items():
                for op in item.values():
                    op.get("responses", {}).pop("422", None)
                    if api_key and path.startswith(("/v1", "/debug")):
                        op["security"] = [{"bearer": []}]
            components = schema.setdefault("components", {})
            schemas = components.setdefault("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
            for model in _EXTRA_SCHEMAS:
                extra = model.model_json_schema(ref_template=_REF + "{model}")
                schemas.update(extra.pop("$defs", {}))
                schemas[model.__name__] = extra
            if api_key:
                components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _one_method_each(routes: list[Any]) -> list[Any]:
    """The routes as documented: a route serving several methods stands as one copy a method, each with its own
    operation ID (FastAPI gives all of a route's methods the same one, which OpenAPI forbids). The app keeps serving
    the route itself, so that a 405 lists all of its methods in Allow."""
    documented = []
    for route in routes:
        if not isinstance(route, APIRoute) or len(route.methods) < 2 or route.operation_id:
            documented.append(route)
            continue
        for method in sorted(route.methods):
            one = copy.copy(route)
            one.methods, one.operation_id = {method}, f"{route.name}_{method.lower()}"
            documented.append(one)
    return documented
