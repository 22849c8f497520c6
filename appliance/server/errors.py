"""Every failure as an OpenAI-style error: the HTTP status, type and code of each exception, the JSON body, the SSE
error event that ends a stream, and readable messages for pydantic's validation errors.
"""
from __future__ import annotations

import json
import math
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from appliance.engine.async_engine import EngineDeadError, EngineStepError
from appliance.errors import ApplianceError, CapacityError, ModelNotFoundError, RequestError, UnavailableError
from appliance.server.responses import ErrorInfo, ErrorResponse

RETRY_AFTER_S = {429: "1", 503: "5"}


class ErrorJSONResponse(JSONResponse):
    """ASCII-escaped JSON: an error message may quote input that is not valid Unicode (a lone surrogate)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_response(status: int, message: str, type_: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    headers = dict(headers or {})
    if status in RETRY_AFTER_S:
        headers.setdefault("Retry-After", RETRY_AFTER_S[status])
    body = ErrorResponse(error=ErrorInfo(message=message, type=type_, param=param, code=code))
    return ErrorJSONResponse(status_code=status, content=body.model_dump(), headers=headers)


def describe(exc: BaseException) -> tuple[int, ErrorInfo]:
    """HTTP status and error object of an exception; anything unexpected is a 500 internal_error."""
    if isinstance(exc, ModelNotFoundError):
        return 404, ErrorInfo(message=str(exc), type="invalid_request_error", param="model", code="model_not_found")
    if isinstance(exc, RequestError):
        return 400, ErrorInfo(message=str(exc), type="invalid_request_error", param=exc.param,
                              code=exc.code or "invalid_value")
    if isinstance(exc, CapacityError):
        return 429, ErrorInfo(message=str(exc), type="rate_limit_error", code="queue_full")
    if isinstance(exc, UnavailableError):
        return 503, ErrorInfo(message=str(exc), type="service_unavailable", code=exc.code)
    if isinstance(exc, ApplianceError):
        return 400, ErrorInfo(message=str(exc), type="invalid_request_error")
    if isinstance(exc, EngineDeadError):
        return 500, ErrorInfo(message=str(exc), type="internal_error", code="engine_dead")
    if isinstance(exc, EngineStepError):
        return 500, ErrorInfo(message=str(exc), type="internal_error", code="engine_step_failed")
    if isinstance(exc, HTTPException):
        code = "request_too_large" if exc.status_code == 413 else None
        return exc.status_code, ErrorInfo(message=str(exc.detail), type="invalid_request_error", code=code)
    return 500, ErrorInfo(message=f"internal error: {type(exc).__name__}: {exc}", type="internal_error")


def response_for(exc: BaseException) -> JSONResponse:
    status, info = describe(exc)
    headers = dict(getattr(exc, "headers", None) or {})
    retry_after = getattr(exc, "retry_after", None)
    if isinstance(exc, (CapacityError, UnavailableError)) and retry_after is not None:
        # the SLO contract's shedding, or the engine's rebuild, says when to come back
        headers["Retry-After"] = str(max(1, math.ceil(retry_after)))
    return error_response(status, info.message, info.type, info.param, info.code, headers)


def sse_error(exc: BaseException) -> str:
    """The event that ends a stream which failed after it started (the openai client raises it as APIError)."""
    _, info = describe(exc)
    return f"data: {json.dumps(ErrorResponse(error=info).model_dump(), ensure_ascii=True)}\n\n"


# ---- pydantic validation errors ---------------------------------------------------------------------------------
_FIELD = re.compile(r"^[a-z_][a-z0-9_]*$|^\d+$")
_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none"}


def _where(loc: tuple[Any, ...]) -> str:
    """'messages.0.content' from pydantic's loc, without 'body' and the union-member tags ('list[int]', ...)."""
    parts = [str(x) for x in loc if x != "body"]
    return ".".join(x for x in parts if _FIELD.match(x) and x not in _TYPE_NAMES)


def validation_error(errors: list[dict[str, Any]]) -> JSONResponse:
    """One 400 for all of a body's validation errors, naming the first offending field in `param`."""
    if errors and errors[0].get("type") == "json_invalid":
        detail = (errors[0].get("ctx") or {}).get("error") or errors[0].get("msg")
        return error_response(400, f"request body is not valid JSON: {detail}", "invalid_request_error",
                              None, "invalid_json")
    messages: dict[str, str] = {}
    mismatched: set[str] = set()  # fields whose message is a union member's type mismatch
    located = [(_where(tuple(e.get("loc", ()))), e) for e in errors]
    deeper = {where for where, _ in located}
    for where, e in located:
        if any(other.startswith(where + ".") for other in deeper):
            continue  # a union member failed deeper inside: that error is the one that explains
        if not where and e.get("type") in ("model_attributes_type", "dict_type", "model_type"):
            messages[where] = ("request body must be a JSON object, sent with the header 'Content-Type: "
                               "application/json'")
            continue
        if where in messages and (where not in mismatched or _mismatch(e)):
            continue  # a union reports one error per member: the first whose type the value has says enough
        mismatched.discard(where)
        if _mismatch(e):
            mismatched.add(where)
        if e.get("type") == "extra_forbidden":
            messages[where] = f"unrecognized request argument supplied: {where}"
            continue
        msg = str(e.get("msg", "invalid value")).removeprefix("Value error, ")
        value = e.get("input")
        if isinstance(value, (int, float, str)) and len(repr(value)) <= 40 and e.get("type") != "missing" and \
                f"got {value!r}" not in msg:
            msg += f" (got {value!r})"
        messages[where] = f"{where or 'request body'}: {msg}"
    param = next(iter(messages), None) or None
    return error_response(400, "; ".join(messages.values()) or "invalid request", "invalid_request_error", param,
                          "invalid_value")


def _mismatch(error: dict[str, Any]) -> bool:
    """A value of another type than the one expected (in a union: the member the value is not meant for)."""
    return str(error.get("type", "")).endswith("_type")


_ROUTING_DETAILS = ("Not Found", "Method Not Allowed")


def routing_error(request: Request, exc: HTTPException) -> JSONResponse:
    """A path this server does not serve, or a method its path does not take, named in the message (Starlette says
    only 'Not Found')."""
    where = f"{request.method} {request.url.path}"
    if exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow")  # (Starlette's 405 names the path's methods)
        message = f"{where}: the method is not allowed on this path" + (f" (allowed: {allowed})" if allowed else "")
        return error_response(405, message, "invalid_request_error", code="method_not_allowed",
                              headers=exc.headers)
    message = (f"{where}: no such endpoint; this server serves text generation for one model "
               "(POST /v1/chat/completions, /v1/completions, /v1/responses, /tokenize, /detokenize; GET /v1/models)")
    return error_response(404, message, "invalid_request_error", code="not_found")


def install_handlers(app: FastAPI) -> None:
    """Route every known exception kind to its OpenAI-style body (the gate catches the unknown ones)."""

    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(list(exc.errors()))

    async def known(request: Request, exc: Exception) -> JSONResponse:
        if isinstance(exc, HTTPException) and exc.status_code in (404, 405) and exc.detail in _ROUTING_DETAILS:
            return routing_error(request, exc)
        return response_for(exc)

    app.add_exception_handler(RequestValidationError, invalid)
    for kind in (ApplianceError, EngineDeadError, EngineStepError, HTTPException):
        app.add_exception_handler(kind, known)
