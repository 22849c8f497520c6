"""OpenAI completions and chat completions on top of the AsyncEngine: prompt -> engine request -> response body or
SSE stream, with usage accounting, metrics, and abort when the client goes away.
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel

from appliance.engine.async_engine import AsyncEngine
from appliance.engine.request import RequestOutput
from appliance.errors import RequestError
from appliance.server.metrics import Metrics, TokenTimer
from appliance.server import protocol as p


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, model_name: str, metrics: Metrics) -> None:
        self.engine, self.model_name, self.metrics = engine, model_name, metrics
        self.tokenizer = engine.engine.tokenizer
        self.max_model_len = engine.engine.max_model_len

    def check_model(self, requested: str | None) -> None:
        if requested is not None and requested != self.model_name:
            raise RequestError(f"model {requested!r} does not exist; this server serves {self.model_name!r}",
                               "model")

    # ---- endpoints ------------------------------------------------------------------------------------------------
    async def completion(self, body: p.CompletionRequest, http: HTTPRequest):
        self.check_model(body.model)
        body.check_supported()
        prompt = body.single_prompt()
        if isinstance(prompt, str):
            ids = self._tokenizer().encode(prompt) if prompt else []
        else:
            ids = list(prompt)
        rid = p.new_id("cmpl")

        def chunk(out: RequestOutput | None, usage: p.Usage | None) -> BaseModel:
            choices = [] if out is None else [p.CompletionChoice(text=out.new_text, finish_reason=out.finish_reason)]
            return p.CompletionResponse(id=rid, model=self.model_name, choices=choices, usage=usage)

        def final(text: str, out: RequestOutput) -> BaseModel:
            return p.CompletionResponse(id=rid, model=self.model_name, usage=_usage(out),
                                        choices=[p.CompletionChoice(text=text, finish_reason=out.finish_reason)])

        return await self._serve(body, ids, body.max_tokens, rid, http, chunk, final, first=None)

    async def chat(self, body: p.ChatCompletionRequest, http: HTTPRequest):
        self.check_model(body.model)
        body.check_supported()
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        text = self._tokenizer().apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt)
        ids = self._tokenizer().encode(text, add_special_tokens=False)
        rid = p.new_id("chatcmpl")

        def chunk(out: RequestOutput | None, usage: p.Usage | None) -> BaseModel:
            choices = [] if out is None else [p.ChatChunkChoice(
                delta=p.ChatDelta(content=out.new_text or None), finish_reason=out.finish_reason)]
            return p.ChatCompletionChunk(id=rid, model=self.model_name, choices=choices, usage=usage)

        def final(text: str, out: RequestOutput) -> BaseModel:
            return p.ChatCompletionResponse(id=rid, model=self.model_name, usage=_usage(out), choices=[
                p.ChatChoice(message=p.ChatMessageOut(content=text), finish_reason=out.finish_reason)])

        first = p.ChatCompletionChunk(id=rid, model=self.model_name,
                                      choices=[p.ChatChunkChoice(delta=p.ChatDelta(role="assistant", content=""))])
        return await self._serve(body, ids, body.requested_max_tokens(), rid, http, chunk, final, first)

    # ---- shared flow ----------------------------------------------------------------------------------------------
    def _tokenizer(self):
        if self.tokenizer is None:
            raise RequestError("this model has no tokenizer; send prompts as token ids to /v1/completions", "prompt")
        return self.tokenizer

    async def _serve(self, body: p._SamplingRequest, ids: list[int], max_tokens: int | None, rid: str,
                     http: HTTPRequest, chunk: Callable, final: Callable, first: BaseModel | None):
        if max_tokens is None:
            max_tokens = max(1, self.max_model_len - len(ids))
        request = self.engine.make_request(ids, body.sampling_params(max_tokens), request_id=rid)
        request.slo_class = self._slo_class(body, http)
        timer = TokenTimer(self.metrics)
        outputs = await self.engine.submit(request)
        if body.stream:
            return StreamingResponse(self._sse(outputs, timer, chunk, first, body.include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        collect = asyncio.ensure_future(self._collect(outputs, timer))
        gone = asyncio.ensure_future(_wait_disconnect(http))
        await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not collect.done():  # the client left: stop generating for it
            collect.cancel()
            await asyncio.gather(collect, return_exceptions=True)
            return JSONResponse(status_code=499, content={"error": {"message": "client disconnected",
                                                                    "type": "client_closed_request"}})
        gone.cancel()
        text, last = collect.result()
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
                   first: BaseModel | None, include_usage: bool) -> AsyncIterator[str]:
        last = None
        try:
            if first is not None:
                yield _event(first)
            async for out in outputs:
                timer.tokens(len(out.new_token_ids))
                last = out
                if out.new_text or out.finished:
                    yield _event(chunk(out, None))
            self._done(last, timer)
            if include_usage and last is not None:
                yield _event(chunk(None, _usage(last)))
            yield "data: [DONE]\n\n"
        finally:
            await outputs.aclose()  # type: ignore[attr-defined]

    def _done(self, last: RequestOutput | None, timer: TokenTimer) -> None:
        if last is not None:
            self.metrics.request_done(last.finish_reason, last.num_prompt_tokens, last.num_cached_tokens,
                                      last.num_output_tokens, timer.started)


def _usage(out: RequestOutput) -> p.Usage:
    return p.Usage.of(out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens)


def _event(model: BaseModel) -> str:
    return f"data: {model.model_dump_json(exclude_none=True)}\n\n"


async def _wait_disconnect(http: HTTPRequest) -> None:
    """Returns when the client closes the connection (the body was already read, so only a disconnect arrives)."""
    while True:
        message = await http.receive()
        if message["type"] == "http.disconnect":
            return
