"""OpenAI completions and chat completions on top of the AsyncEngine: prompt -> engine request -> response body or
SSE stream, with usage accounting, metrics, and abort when the client goes away.

Rendering chat templates and tokenizing run in a thread pool, never on the event loop: a multi-megabyte body must
not stall /health or other streams. A stream that fails after it started ends with an error event and [DONE].
"""
from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Callable

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel

from appliance.engine.admission import CONTEXT_LENGTH_EXCEEDED
from appliance.engine.async_engine import AsyncEngine
from appliance.engine.request import Request, RequestOutput
from appliance.errors import ModelNotFoundError, RequestError
from appliance.server import protocol as p
from appliance.server import responses as r
from appliance.server.errors import sse_error
from appliance.server.metrics import Metrics, TokenTimer


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, model_name: str, metrics: Metrics) -> None:
        self.engine, self.model_name, self.metrics = engine, model_name, metrics
        self.tokenizer = engine.engine.tokenizer
        self.max_model_len = engine.engine.max_model_len
        self._pool = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="muxd-prep")

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def check_model(self, requested: str | None) -> None:
        if requested is not None and requested != self.model_name:
            raise ModelNotFoundError(f"the model {requested!r} does not exist; this server serves "
                                     f"{self.model_name!r}")

    # ---- endpoints ------------------------------------------------------------------------------------------------
    async def completion(self, body: p.CompletionRequest, http: HTTPRequest):
        self.check_model(body.model)
        rid = r.new_id("cmpl")
        request = await self._off_loop(self._completion_request, body, rid)

        def chunk(out: RequestOutput | None, usage: r.Usage | None) -> BaseModel:
            choices = [] if out is None else [r.CompletionChoice(text=out.new_text, finish_reason=out.finish_reason)]
            return r.CompletionResponse(id=rid, model=self.model_name, choices=choices, usage=usage)

        def final(text: str, out: RequestOutput) -> BaseModel:
            return r.CompletionResponse(id=rid, model=self.model_name, usage=_usage(out),
                                        choices=[r.CompletionChoice(text=text, finish_reason=out.finish_reason)])

        return await self._serve(body, request, http, chunk, final, first=None)

    async def chat(self, body: p.ChatCompletionRequest, http: HTTPRequest):
        self.check_model(body.model)
        rid = r.new_id("chatcmpl")
        request = await self._off_loop(self._chat_request, body, rid)

        def chunk(out: RequestOutput | None, usage: r.Usage | None) -> BaseModel:
            choices = [] if out is None else [r.ChatChunkChoice(
                delta=r.ChatDelta(content=out.new_text or None), finish_reason=out.finish_reason)]
            return r.ChatCompletionChunk(id=rid, model=self.model_name, choices=choices, usage=usage)

        def final(text: str, out: RequestOutput) -> BaseModel:
            return r.ChatCompletionResponse(id=rid, model=self.model_name, usage=_usage(out), choices=[
                r.ChatChoice(message=r.ChatMessageOut(content=text), finish_reason=out.finish_reason)])

        first = r.ChatCompletionChunk(id=rid, model=self.model_name,
                                      choices=[r.ChatChunkChoice(delta=r.ChatDelta(role="assistant", content=""))],
                                      usage=r.Usage.of(request.num_prompt_tokens, 0, 0) if body.continuous_usage
                                      else None)
        return await self._serve(body, request, http, chunk, final, first)

    # ---- request preparation (thread pool) ------------------------------------------------------------------------
    async def _off_loop(self, fn: Callable, *args) -> Request:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _completion_request(self, body: p.CompletionRequest, rid: str) -> Request:
        prompt = body.single_prompt()
        ids = self._encode(prompt, True, "prompt") if isinstance(prompt, str) else list(prompt)
        return self._make(body, ids, body.max_tokens, rid)

    def _chat_request(self, body: p.ChatCompletionRequest, rid: str) -> Request:
        messages = [m.for_template() for m in body.messages]
        text = self._tokenizer().apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt
                                                     is not False)
        return self._make(body, self._encode(text, False, "messages"), body.requested_max_tokens(), rid)

    def _encode(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        tok = self._tokenizer()
        try:
            p.valid_unicode(text)  # the template may have copied in message fields that are not validated as text
        except ValueError as exc:
            raise RequestError(f"{param}: {exc}", param) from None
        at_least = tok.min_tokens(text)
        if at_least >= self.max_model_len:
            source = "prompt" if param == "prompt" else "prompt rendered from the messages"
            raise RequestError(f"the {source} is longer than this model's context of {self.max_model_len} tokens: "
                               f"its {len(text.encode())} bytes make at least {at_least} tokens", param,
                               CONTEXT_LENGTH_EXCEEDED)
        return tok.encode(text, add_special_tokens=add_special_tokens)

    def _make(self, body: p._SamplingRequest, ids: list[int], max_tokens: int | None, rid: str) -> Request:
        if max_tokens is None:
            max_tokens = max(1, self.max_model_len - len(ids))
        return self.engine.make_request(ids, body.sampling_params(max_tokens), request_id=rid)

    def _tokenizer(self):
        if self.tokenizer is None:
            raise RequestError("this model has no tokenizer; send prompts as token ids to /v1/completions", "prompt")
        return self.tokenizer

    # ---- shared flow ----------------------------------------------------------------------------------------------
    async def _serve(self, body: p._SamplingRequest, request: Request, http: HTTPRequest, chunk: Callable,
                     final: Callable, first: BaseModel | None):
        request.slo_class = self._slo_class(body, http)
        timer = TokenTimer(self.metrics)
        outputs = await self.engine.submit(request)
        if body.stream:
            return StreamingResponse(self._sse(outputs, timer, chunk, first, body.include_usage, body.continuous_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        collect = asyncio.ensure_future(self._collect(outputs, timer))
        gone = asyncio.ensure_future(_wait_disconnect(http))
        await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not collect.done():  # the client left: stop generating for it
            collect.cancel()
            await asyncio.gather(collect, return_exceptions=True)
            return JSONResponse(status_code=499, content={"error": {
                "message": "client disconnected", "type": "client_closed_request", "param": None, "code": None}})
        gone.cancel()
        text, last = collect.result()  # raises what ended the request early (engine error, shutdown)
        return JSONResponse(final(text, last).model_dump())

    def _slo_class(self, body: p._SamplingRequest, http: HTTPRequest) -> str | None:
        """The request's SLO class: the X-SLO-Class header or the slo_class field (400 when unknown or when the
        two disagree)."""
        header = http.headers.get("x-slo-class")
        if header is not None and body.slo_class is not None and header != body.slo_class:
            raise RequestError(f"X-SLO-Class header {header!r} and slo_class field {body.slo_class!r} disagree; "
                               "send one", "slo_class")
        return self.engine.engine.slo_class(header if header is not None else body.slo_class)

    async def _collect(self, outputs: AsyncIterator[RequestOutput], timer: TokenTimer) -> tuple[str, RequestOutput]:
        parts, last = [], None
        try:
            async for out in outputs:
                timer.tokens(len(out.new_token_ids))
                parts.append(out.new_text)
                last = out
        finally:
            await outputs.aclose()  # type: ignore[attr-defined]
        self._done(last, timer)
        return "".join(parts), last

    async def _sse(self, outputs: AsyncIterator[RequestOutput], timer: TokenTimer, chunk: Callable,
                   first: BaseModel | None, include_usage: bool, continuous: bool) -> AsyncIterator[str]:
        last = None
        try:
            if first is not None:
                yield _event(first)
            async for out in outputs:
                timer.tokens(len(out.new_token_ids))
                last = out
                # a model without a tokenizer has no text: every token still gets its chunk (TTFT/TBT stay visible)
                if out.new_text or out.finished or (self.tokenizer is None and out.new_token_ids):
                    yield _event(chunk(out, _usage(out) if continuous else None))
            self._done(last, timer)
            if include_usage and last is not None:
                yield _event(chunk(None, _usage(last)))
        except Exception as exc:  # noqa: BLE001 - the stream has started: the error travels as an event
            yield sse_error(exc)
        finally:
            await outputs.aclose()  # type: ignore[attr-defined]
        yield "data: [DONE]\n\n"

    def _done(self, last: RequestOutput | None, timer: TokenTimer) -> None:
        if last is not None:
            self.metrics.request_done(last.finish_reason, last.num_prompt_tokens, last.num_cached_tokens,
                                      last.num_output_tokens, timer.started)


def _usage(out: RequestOutput) -> r.Usage:
    return r.Usage.of(out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens)


def _event(model: BaseModel) -> str:
    return f"data: {model.model_dump_json(exclude_none=True)}\n\n"


async def _wait_disconnect(http: HTTPRequest) -> None:
    """Returns when the client closes the connection (the body was already read, so only a disconnect arrives)."""
    while True:
        message = await http.receive()
        if message["type"] == "http.disconnect":
            return
