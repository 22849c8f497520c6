"""OpenAI completions and chat completions on top of the AsyncEngine: prompt -> engine requests (one per choice) ->
response body or SSE stream, with usage accounting, metrics, and abort when the client goes away; /tokenize and
/detokenize.

Rendering chat templates and tokenizing run in a thread pool, never on the event loop: a multi-megabyte body must
not stall /health or other streams. A stream that fails after it started ends with an error event and [DONE].
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Callable

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel

from appliance.engine.admission import CONTEXT_LENGTH_EXCEEDED
from appliance.engine.async_engine import AsyncEngine
from appliance.engine.request import Request, RequestOutput, ThinkingLimit
from appliance.errors import ModelNotFoundError, RequestError
from appliance.model_zoo.tokenizer import RenderedChat
from appliance.server import beam_search
from appliance.server import protocol as p
from appliance.server import responses as r
from appliance.server import tokenize as t
from appliance.server.choices import Choices, gathered
from appliance.server.errors import sse_error
from appliance.server.formatting import ChatFormat, Choice, CompletionFormat, best, replay, usage_of
from appliance.server.metrics import Metrics, TokenTimer
from appliance.server.reasoning import END, START, opens_thinking, waits_for_thinking
from appliance.server.responses_api import Event, ResponsesFormat, ResponsesRequest, renamed
from appliance.server.tools import detect_parser

logger = logging.getLogger(__name__)


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, names: tuple[str, ...], metrics: Metrics,
                 special_tokens_in_messages: bool = False) -> None:
        """`names`: what clients may send in 'model' (the first is the model's own name)."""
        self.engine, self.names, self.metrics = engine, names, metrics
        self.escape_control = not special_tokens_in_messages
        self.tokenizer = engine.engine.tokenizer
        self.max_model_len = engine.engine.max_model_len
        config = engine.engine.config
        self.share_prefill = config.cache.enable_prefix_caching
        self.auto_tools = config.server.enable_auto_tool_choice
        self.exclude_tools_when_none = config.server.exclude_tools_when_tool_choice_none
        self.trust_request_template = config.server.trust_request_chat_template
        self.tool_parser = detect_parser(self.tokenizer.chat_template if self.tokenizer else None,
                                         config.server.tool_call_parser)
        self.reasoning_parser = config.server.reasoning_parser
        self.template_defaults = config.model.template_defaults()  # --default-chat-template-kwargs
        self.tokens_as_ids = config.vllm.return_tokens_as_token_ids  # the server's default for the request field
        self.force_usage = config.vllm.enable_force_include_usage  # every stream ends with its usage
        self.stream_interval = config.server.stream_interval  # tokens a stream gathers into one chunk
        self.logprobs_mode = config.model.logprobs_mode
        # vLLM's request log: prompts as they arrive, outputs as they end, each cut to --max-log-len
        self.log_requests, self.log_outputs = config.vllm.enable_log_requests, config.vllm.enable_log_outputs
        self.max_log_len = config.vllm.max_log_len
        self._markers: dict[str, tuple[int, ...]] = {}  # a think block's start and end in tokens (_marker)
        self.sampling_defaults = config.model.sampling_defaults()
        if self.sampling_defaults:
            where = config.model.generation_config_dir
            logger.info("sampling defaults of requests that leave them unset, from %s%s: %s (--generation-config "
                        "vllm: none)", where / "generation_config.json" if where else "",
                        " and --override-generation-config" if config.model.override_generation_config else "",
                        self.sampling_defaults)
        self._pool = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="muxd-prep")

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def check_model(self, requested: str | None) -> str:
        """The name a response gives: the one requested (any served name), else the model's own; 404 for others."""
        if requested is None:
            return self.names[0]
        if requested not in self.names:
            served = " or ".join(repr(n) for n in self.names)
            raise ModelNotFoundError(f"the model {requested!r} does not exist; this server serves {served}")
        return requested

    # ---- endpoints ------------------------------------------------------------------------------------------------
    async def completion(self, body: p.CompletionRequest, http: HTTPRequest):
        name = self.check_model(body.model)
        body = self._defaults(body)
        rid = r.new_id("cmpl")
        requests, cut = await self._off_loop(self._completion_requests, body, rid)
        each = body.num_generated
        fmt = CompletionFormat(response_id("cmpl", body, http, rid), name, self.tokenizer, body,
                               [q.prompt_token_ids for q in requests[::each]], cut)
        return await self._serve(body, requests, http, fmt)

    async def chat(self, body: p.ChatCompletionRequest, http: HTTPRequest):
        name = self.check_model(body.model)
        body = self._defaults(body)
        rid = r.new_id("chatcmpl")
        requests, thinking = await self._off_loop(self._chat_requests, body, rid)
        fmt = ChatFormat(response_id("chatcmpl", body, http, rid), name, self.tokenizer, body, self.tool_parser,
                         thinking, requests[0].prompt_token_ids)
        return await self._serve(body, requests, http, fmt)

    async def responses(self, body: ResponsesRequest, chat_body: type[p.ChatCompletionRequest], http: HTTPRequest):
        """/v1/responses: the request runs as the chat request it amounts to (`chat_body`: this model's)."""
        name = self.check_model(body.model)
        chat = body.to_chat(chat_body)
        rid = r.new_id("resp")
        try:
            requests, thinking = await self._off_loop(self._chat_requests, chat, rid)
            fmt = ResponsesFormat(response_id("", body, http, rid), name, chat, body, self.tool_parser, thinking)
            return await self._serve(chat, requests, http, fmt)
        except RequestError as exc:  # named as this request names the field
            raise renamed(exc) from None

    async def tokenize(self, body: t.TokenizeRequest) -> r.TokenizeResponse:
        self.check_model(body.model)
        ids = await self._off_loop(self._tokenize, body)
        # as vLLM (convert_ids_to_tokens): the vocabulary's pieces ('Ġw'), whole where a token is part of a character
        strs = [self.tokenizer.raw.id_to_token(t) for t in ids] if body.return_token_strs else None
        return r.TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids, token_strs=strs)

    def tokenizer_info(self) -> dict[str, Any]:
        return self._tokenizer().info()

    async def detokenize(self, body: t.DetokenizeRequest) -> r.DetokenizeResponse:
        self.check_model(body.model)
        # special tokens kept, as vLLM's /detokenize keeps them (a prompt's BOS, a chat template's markers)
        return r.DetokenizeResponse(prompt=self._tokenizer().decode(body.tokens, skip_special_tokens=False))

    def _defaults(self, body: Any) -> Any:
        """The request with the server's defaults (--return-tokens-as-token-ids) where it leaves a field unset."""
        if self.tokens_as_ids and body.return_tokens_as_token_ids is None:
            return body.model_copy(update={"return_tokens_as_token_ids": True})
        return body

    # ---- request preparation (thread pool) ------------------------------------------------------------------------
    async def _off_loop(self, fn: Callable, *args) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _completion_requests(self, body: p.CompletionRequest, rid: str) -> tuple[list[Request], list[bool]]:
        """Each prompt's choices in turn (prompt i's are choices i * num_generated ...), and for each prompt whether
        truncate_prompt_tokens cut it."""
        prompts = body.prompts()
        keep = self._keep(body)
        requests: list[Request] = []
        cut: list[bool] = []
        for i, prompt in enumerate(prompts):
            param = "prompt" if len(prompts) == 1 else f"prompt.{i}"
            ids = (self._encode(prompt, body.add_special_tokens is not False, param, limit=keep is None)
                   if isinstance(prompt, str) else list(prompt))
            cut.append(keep is not None and len(ids) > keep)
            requests += self._make(body, _kept(ids, keep, body.truncation_side), body.max_tokens, rid,
                                   first=len(requests))
        return requests, cut

    def _chat_requests(self, body: p.ChatCompletionRequest, rid: str) -> tuple[list[Request], bool | None]:
        """The request's choices, and whether its output begins inside a think block (None: no reasoning split,
        without --reasoning-parser or where a grammar constrains the output from its first token)."""
        keep = self._keep(body)
        chat = self._render(body)
        self._check_text(chat.text, "messages", limit=keep is None)
        ids = self._tokenizer().encode_chat(chat, add_special_tokens=bool(body.add_special_tokens))
        thinking = opens_thinking(chat.text, self.reasoning_parser) if self.reasoning_parser != "none" else None
        after: tuple[int, ...] = ()
        if body.grammar() is not None and thinking is not None:
            if waits_for_thinking(chat.text, body):
                after = self._marker(END)
            else:
                thinking = None  # the grammar holds from the first token: no think block to split off
        requests = self._make(body, _kept(ids, keep, body.truncation_side), body.requested_max_tokens(), rid,
                              after=after, thinking=self._thinking_limit(body, thinking, chat.text))
        return requests, thinking

    def _thinking_limit(self, body: p.ChatCompletionRequest, inside: bool | None,
                        prompt: str) -> ThinkingLimit | None:
        """The request's thinking_token_budget as a cap on its think block (`inside`: the output begins in one);
        None where the prompt closed the block itself (Qwen3's enable_thinking false: nothing to cap)."""
        budget = body.thinking_token_budget
        if budget is None:
            return None
        if self.reasoning_parser == "none":
            raise RequestError("thinking_token_budget needs a server started with --reasoning-parser (which says "
                               "where a think block starts and ends)", "thinking_token_budget")
        if prompt.rstrip().endswith(END):
            return None
        return ThinkingLimit(budget, self._marker(START), self._marker(END), bool(inside))

    def _marker(self, text: str) -> tuple[int, ...]:
        """A think block's marker (reasoning.START or END) in tokens, encoded once."""
        if text not in self._markers:
            self._markers[text] = tuple(self._tokenizer().encode(text, add_special_tokens=False))
        return self._markers[text]

    def _keep(self, body: p._SamplingRequest) -> int | None:
        """How many prompt tokens truncate_prompt_tokens keeps (None: all); -1 keeps as many as the context
        leaves room for beside max_tokens (or one token when max_tokens is not given)."""
        k = body.truncate_prompt_tokens
        if k is not None and k > self.max_model_len:
            raise RequestError(f"truncate_prompt_tokens={k} is more than this model's context of "
                               f"{self.max_model_len} tokens", "truncate_prompt_tokens", CONTEXT_LENGTH_EXCEEDED)
        if k == -1:
            return max(1, self.max_model_len - (body.requested_max_tokens() or 1))
        return k

    def _render(self, body: p.ChatCompletionRequest) -> RenderedChat:
        messages = [m.for_template() for m in body.messages]
        if body.active_tools and not (body.tool_choice and body.tool_choice.constrains) and not self.auto_tools:
            raise RequestError('tool_choice "auto" is off on this server (--no-enable-auto-tool-choice); send '
                               'tool_choice "required" or a named function', "tool_choice")
        tools = body.template_tools(self.exclude_tools_when_none)
        extra = {"tools": [t.model_dump(exclude_none=True) for t in tools]} if tools else {}
        return self._tokenizer().render_chat(messages, add_generation_prompt=body.add_generation_prompt is not False,
                                             escape_control=self.escape_control,
                                             continue_final=bool(body.continue_final_message),
                                             variables={**self.template_defaults, **body.template_variables()},
                                             template=self._trusted(body.own_template()), **extra)

    def _trusted(self, template: str | None) -> str | None:
        """A request's own chat template, where the server takes one (--trust-request-chat-template)."""
        if template is not None and not self.trust_request_template:
            raise RequestError("a request's own chat template is taken only by a server started with "
                               "--trust-request-chat-template (as vLLM's); leave chat_template out to use the "
                               "server's", "chat_template")
        return template

    def _tokenize(self, body: t.TokenizeRequest) -> list[int]:
        if body.messages is not None:
            tok = self._tokenizer()
            variables = {k: v for k, v in (body.chat_template_kwargs or {}).items() if k != "chat_template"}
            extra = {"tools": [tool.model_dump(exclude_none=True) for tool in body.tools]} if body.tools else {}
            chat = tok.render_chat([m.for_template() for m in body.messages],
                                   add_generation_prompt=body.add_generation_prompt, escape_control=self.escape_control,
                                   continue_final=body.continue_final_message,
                                   variables={**self.template_defaults, **variables},
                                   template=self._trusted(body.own_template()), **extra)
            self._check_text(chat.text, "messages", limit=False)
            return tok.encode_chat(chat)
        return self._encode(body.prompt, body.add_special_tokens, "prompt", limit=False)

    def _encode(self, text: str, add_special_tokens: bool, param: str, limit: bool = True) -> list[int]:
        self._check_text(text, param, limit)
        return self._tokenizer().encode(text, add_special_tokens=add_special_tokens)

    def _check_text(self, text: str, param: str, limit: bool = True) -> None:
        """Valid Unicode, and (with `limit`) not so long that even its fewest possible tokens exceed the context."""
        tok = self._tokenizer()
        try:
            p.valid_unicode(text)  # the template may have copied in message fields that are not validated as text
        except ValueError as exc:
            raise RequestError(f"{param}: {exc}", param) from None
        at_least = tok.min_tokens(text)
        if limit and at_least >= self.max_model_len:
            source = "prompt" if param == "prompt" else "prompt rendered from the messages"
            raise RequestError(f"the {source} is longer than this model's context of {self.max_model_len} tokens: "
                               f"its {len(text.encode())} bytes make at least {at_least} tokens", param,
                               CONTEXT_LENGTH_EXCEEDED)

    def _make(self, body: p._SamplingRequest, ids: list[int], max_tokens: int | None, rid: str,
              first: int = 0, after: tuple[int, ...] = (), thinking: ThinkingLimit | None = None) -> list[Request]:
        """One engine request per choice of one prompt (ids rid, rid-1, ... counted from `first`; choice i samples
        with seed + i); `after`: the tokens a grammar waits for (the end of thinking); `thinking`: the cap on the
        think block's tokens."""
        if max_tokens is None:
            room = self.max_model_len - len(ids)
            max_tokens = max(1, min(room, self.sampling_defaults.get("max_tokens", room)))
        requests = []
        for i in range(body.num_generated):
            params = body.sampling_params(max_tokens, i, self.sampling_defaults)
            if params.grammar is not None and after:
                params.grammar = dataclasses.replace(params.grammar, after=after)
            params.thinking = thinking
            requests.append(self.engine.make_request(ids, params, request_id=rid if first + i == 0
                                                     else f"{rid}-{first + i}"))
        return requests

    def _tokenizer(self):
        if self.tokenizer is None:
            raise RequestError("this model has no tokenizer; send prompts as token ids to /v1/completions", "prompt")
        return self.tokenizer

    # ---- shared flow ----------------------------------------------------------------------------------------------
    async def _serve(self, body: p._SamplingRequest, requests: list[Request], http: HTTPRequest, fmt: Any):
        slo_class = self._slo_class(body, http)
        for request in requests:
            request.slo_class = slo_class
        each = body.num_generated  # choices generated per prompt
        if self.log_requests:
            for request in requests[::each]:
                self._log_request(request)
        if body.use_beam_search:
            return await self._beam_search(body, requests[::each], http, fmt)
        choices = Choices(self.engine, requests, self.metrics, share_prefill=self.share_prefill, group=each,
                          shown=fmt.shown, max_tokens=body.requested_max_tokens(),
                          on_done=self._log_output if self.log_outputs else None)
        await choices.start()  # the first choice is accepted (or refused: 429) before any byte is sent
        ranked = body.num_choices < each  # best_of > n
        prompt_tokens = sum(q.num_prompt_tokens for q in requests[::each])
        if body.stream and not ranked:
            return StreamingResponse(self._sse(choices, choices.n, fmt, body, prompt_tokens, group=each),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        collect = asyncio.ensure_future(self._collect(choices, keep=ranked))
        if not await _done_unless_gone(collect, http):
            return _client_gone()
        states = collect.result()  # raises what ended the request early (engine error, shutdown)
        usage = usage_of(states, each)
        if ranked:
            states = best(states, body.num_choices, each)
        if body.stream:  # best_of: the winners, streamed once every candidate is done
            return StreamingResponse(self._sse(replay(states), len(states), fmt, body, prompt_tokens, usage,
                                               group=body.num_choices),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return JSONResponse(fmt.final(states, usage).model_dump())

    async def _beam_search(self, body: p._SamplingRequest, prompts: list[Request], http: HTTPRequest, fmt: Any):
        """use_beam_search: each prompt's n best beams (server/beam_search.py) as its choices, answered once every
        prompt's search is done (a stream sends them then, as vLLM's does)."""
        width = body.num_choices
        if body.num_generated > width:
            raise RequestError("use_beam_search returns the n best beams; leave best_of out", "best_of", p.CONFLICT)
        for request in prompts:
            beam_search.check(request, width, self.logprobs_mode)
        length_penalty = 1.0 if body.length_penalty is None else body.length_penalty
        timers = [TokenTimer(self.metrics) for _ in prompts]  # (the answer's first token: when the search ends)
        run = asyncio.ensure_future(beam_search.search_all(self.engine, prompts, width, length_penalty,
                                                           set(self.engine.engine.eos_token_ids)))
        if not await _done_unless_gone(run, http):
            return _client_gone()
        states = []
        for p_index, (request, beams, timer) in enumerate(zip(prompts, run.result(), timers)):
            outs = [beam_search.output(request, beam, functools.partial(
                self._decode, skip_special_tokens=request.sampling.skip_special_tokens)) for beam in beams]
            timer.tokens(max((len(out.new_token_ids) for out in outs), default=0))
            for i, out in enumerate(outs):  # the request's metrics: each beam a finished choice, as vLLM counts
                self.metrics.request_done(out, timer, body.requested_max_tokens())
                if self.log_outputs:
                    self._log_output(out)
                choice = Choice(p_index * width + i, keep=True)
                choice.add(fmt.shown(out))
                states.append(choice)
            self.metrics.prompt_done(len(outs), max((o.num_output_tokens for o in outs), default=0))
        usage = usage_of(states, width)
        if body.stream:
            prompt_tokens = sum(len(q.prompt_token_ids) for q in prompts)
            return StreamingResponse(self._sse(replay(states), len(states), fmt, body, prompt_tokens, usage,
                                               group=width),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return JSONResponse(fmt.final(states, usage).model_dump())

    def _log_request(self, request: Request) -> None:
        ids = request.prompt_token_ids[:self.max_log_len]
        text = self._decode(ids, skip_special_tokens=False)[:self.max_log_len]
        logger.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s", request.request_id, text,
                    request.sampling, ids)

    def _log_output(self, out: RequestOutput) -> None:
        logger.info("Generated response %s: output: %r, num_output_tokens: %d, finish_reason: %s", out.request_id,
                    (out.text or "")[:self.max_log_len], out.num_output_tokens, out.finish_reason)

    def _decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        """Output tokens as text ("" for a model without a tokenizer, as its outputs read)."""
        return "" if self.tokenizer is None else self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def _slo_class(self, body: p._SamplingRequest, http: HTTPRequest) -> str | None:
        """The request's SLO class: the X-SLO-Class header or the slo_class field (400 when unknown or when the
        two disagree)."""
        header = http.headers.get("x-slo-class")
        if header is not None and body.slo_class is not None and header != body.slo_class:
            raise RequestError(f"X-SLO-Class header {header!r} and slo_class field {body.slo_class!r} disagree; "
                               "send one", "slo_class")
        return self.engine.engine.slo_class(header if header is not None else body.slo_class)

    async def _collect(self, choices: Choices, keep: bool = False) -> list[Choice]:
        states = [Choice(i, keep) for i in range(choices.n)]
        try:
            async for index, out in choices:
                states[index].add(out)
        finally:
            await choices.aclose()
        return states

    async def _sse(self, outputs: Any, n: int, fmt: Any, body: p._SamplingRequest, prompt_tokens: int,
                   usage: r.Usage | None = None, group: int | None = None) -> AsyncIterator[str]:
        """`outputs`: (choice index, output) pairs as the response shows them, live or replayed; `usage`: the total
        when it is known; `group`: the choices of one prompt (a batch of prompts; None: one prompt)."""
        states = [Choice(i) for i in range(n)]
        continuous = body.continuous_usage

        def so_far() -> r.Usage:  # every prompt counted, answered yet or not
            u = usage_of(states, group)
            return r.Usage.of(prompt_tokens, u.completion_tokens, u.prompt_tokens_details.cached_tokens)

        def own(out: RequestOutput) -> r.Usage:  # a chunk's continuous usage: its prompt and choice (as vLLM's)
            return r.Usage.of(out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens)
        try:
            for event in fmt.first(n, r.Usage.of(prompt_tokens, 0, 0) if continuous else None):
                yield _event(event)
            live = isinstance(outputs, Choices) and self.stream_interval > 1
            async for index, out in gathered(outputs, self.stream_interval) if live else outputs:
                states[index].add(out)
                usage_now = own(out) if continuous else None
                plain = fmt.plain(states[index], out, usage_now)
                if plain is not None:
                    yield f"data: {plain}\n\n"
                    continue
                for event in fmt.chunk(states[index], out, usage_now):
                    yield _event(event)
            if body.include_usage or self.force_usage:
                yield _event(fmt.usage_chunk(usage or so_far()))
        except Exception as exc:  # noqa: BLE001 - the stream has started: the error travels as an event
            yield sse_error(exc)
        finally:
            if isinstance(outputs, Choices):
                await outputs.aclose()
        yield "data: [DONE]\n\n"


def response_id(prefix: str, body: p._SamplingRequest | ResponsesRequest, http: HTTPRequest, new: str) -> str:
    """The id a response shows, as vLLM makes it: from the X-Request-Id header, else the body's request_id, after
    `prefix` (none: the id as given, as /v1/responses shows it), else `new` (the engine's ids stay muxd's own, so that
    two requests of one client id never collide)."""
    given = http.headers.get("x-request-id") or body.request_id
    if not given:
        return new
    return f"{prefix}-{given}" if prefix else given


def _event(model: BaseModel) -> str:
    kind = f"event: {model.type}\n" if isinstance(model, Event) else ""  # the Responses API names its events
    return f"{kind}data: {model.model_dump_json(exclude_none=True)}\n\n"


def _kept(ids: list[int], keep: int | None, side: str | None) -> list[int]:
    """The prompt tokens truncate_prompt_tokens keeps (`keep`; None: all): the last ones, or with truncation_side
    right the first ones."""
    if not keep:
        return ids
    return ids[:keep] if side == "right" else ids[-keep:]


async def _done_unless_gone(work: asyncio.Future, http: HTTPRequest) -> bool:
    """Wait for `work` (True), unless the client leaves first: then `work` is cancelled (the engine requests it
    holds end and free their pages) and the answer is False."""
    gone = asyncio.ensure_future(_wait_disconnect(http))
    await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    if not work.done():
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)
        return False
    gone.cancel()
    return True


def _client_gone() -> JSONResponse:
    """The answer to a request whose client left before it was done (nginx's 499)."""
    return JSONResponse(status_code=499, content={"error": {
        "message": "client disconnected", "type": "client_closed_request", "param": None, "code": None}})


async def _wait_disconnect(http: HTTPRequest) -> None:
    """Returns when the client closes the connection (the body was already read, so only a disconnect arrives)."""
    while True:
        message = await http.receive()
        if message["type"] == "http.disconnect":
            return
