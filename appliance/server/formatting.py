"""The OpenAI bodies of a request's choices: each choice's text, log-probabilities and tool calls as the engine's
outputs arrive, turned into stream chunks or a final body, for completions (`CompletionFormat`) and chat
(`ChatFormat`).
"""
from __future__ import annotations

from typing import AsyncIterator

from pydantic import BaseModel

from appliance.engine.request import RequestOutput, TokenLogprob
from appliance.model_zoo.tokenizer import Tokenizer
from appliance.server import protocol as p
from appliance.server import responses as r
from appliance.server.tools import CallStream, ToolCall, ToolChoiceValue, forced_calls, parse_calls


class Choice:
    """What one choice has produced so far."""

    def __init__(self, index: int, keep: bool = False) -> None:
        self.index = index
        self.outputs: list[RequestOutput] | None = [] if keep else None  # kept to replay them (best_of)
        self.parts: list[str] = []
        self.logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self.last: RequestOutput | None = None
        self.started = False  # its first chunk has gone out

    def add(self, out: RequestOutput) -> None:
        self.parts.append(out.new_text)
        self.logprobs += out.logprobs or []
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if self.outputs is not None:
            self.outputs.append(out)
        self.last = out

    @property
    def text(self) -> str:
        return "".join(self.parts)


def best(choices: list[Choice], n: int, group: int) -> list[Choice]:
    """Of each prompt's `group` choices (indices p * group ...), the n of highest total log-probability (best_of),
    renumbered p * n ...."""
    kept = []
    for start in range(0, len(choices), group):
        ranked = sorted(choices[start:start + group], key=lambda c: -sum(lp.logprob for lp in c.logprobs))[:n]
        for i, c in enumerate(ranked):
            c.index = start // group * n + i
        kept += ranked
    return kept


async def replay(choices: list[Choice]) -> AsyncIterator[tuple[int, RequestOutput]]:
    for c in choices:
        for out in c.outputs or []:
            yield c.index, out


def usage_of(choices: list[Choice], group: int | None = None) -> r.Usage:
    """Each prompt counted once (its choices are the indices p * group ...; None: one prompt), the outputs of every
    choice added up."""
    group = group or max(len(choices), 1)
    prompt = cached = output = 0
    for start in range(0, len(choices), group):
        outs = [c.last for c in choices[start:start + group] if c.last is not None]
        prompt += outs[0].num_prompt_tokens if outs else 0
        cached += max((o.num_cached_tokens for o in outs), default=0)
        output += sum(o.num_output_tokens for o in outs)
    return r.Usage.of(prompt, output, cached)


class _Format:
    def __init__(self, rid: str, model: str, tokenizer: Tokenizer | None) -> None:
        self.rid, self.model, self.tokenizer = rid, model, tokenizer
        self._token_text: dict[int, str] = {}

    def token(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False) if self.tokenizer else \
                f"token_id:{token_id}"
            self._token_text[token_id] = text
        return text

    def first(self, n: int, usage: r.Usage | None) -> list[BaseModel]:
        return []

    def usage_chunk(self, usage: r.Usage) -> BaseModel:
        """The last chunk of a stream with include_usage: no choice, the usage of all."""
        return r.CompletionResponse(id=self.rid, model=self.model, choices=[], usage=usage)


class CompletionFormat(_Format):
    """Choice i of a batch of prompts answers prompt i // n (n: the choices returned per prompt)."""

    def __init__(self, rid: str, model: str, tokenizer: Tokenizer | None, body: p.CompletionRequest,
                 prompt_ids: list[list[int]]) -> None:
        super().__init__(rid, model, tokenizer)
        self.logprobs = body.logprobs
        self.prompt_ids, self.per_prompt = prompt_ids, body.num_choices
        self.echoes = [("" if not body.echo else prompt if isinstance(prompt, str) else (
            tokenizer.decode(ids) if tokenizer else "")) for prompt, ids in zip(body.prompts(), prompt_ids)]
        self._offsets: dict[int, int] = {}

    def _prompt(self, index: int) -> int:
        return index // self.per_prompt

    def chunk(self, choice: Choice, out: RequestOutput, usage: r.Usage | None) -> list[BaseModel]:
        echo = self.echoes[self._prompt(choice.index)] if not choice.started else ""
        logprobs = self._logprobs(choice.index, out.prompt_logprobs if not choice.started and echo else None,
                                  out.logprobs or [])
        if not (echo or out.new_text or out.finished or logprobs or out.new_token_ids and self.tokenizer is None):
            return []
        choice.started = True
        body = r.CompletionChoice(index=choice.index, text=echo + out.new_text, finish_reason=out.finish_reason,
                                  logprobs=logprobs)
        return [r.CompletionResponse(id=self.rid, model=self.model, choices=[body], usage=usage)]

    def final(self, choices: list[Choice], usage: r.Usage) -> BaseModel:
        bodies = []
        for c in choices:
            echo = self.echoes[self._prompt(c.index)]
            bodies.append(r.CompletionChoice(index=c.index, text=echo + c.text, finish_reason=c.last.finish_reason,
                                             logprobs=self._logprobs(c.index, c.prompt_logprobs if echo else None,
                                                                     c.logprobs)))
        return r.CompletionResponse(id=self.rid, model=self.model, choices=bodies, usage=usage)

    def _logprobs(self, index: int, prompt: list[TokenLogprob | None] | None,
                  tokens: list[TokenLogprob]) -> r.CompletionLogprobs | None:
        if self.logprobs is None:
            return None
        out = r.CompletionLogprobs()
        offset = self._offsets.get(index, 0)
        entries: list[tuple[int, TokenLogprob | None]] = []
        if prompt is not None:
            entries += list(zip(self.prompt_ids[self._prompt(index)], prompt))
        entries += [(lp.token_id, lp) for lp in tokens]
        for token_id, lp in entries:
            text = self.token(token_id)
            out.tokens.append(text)
            out.token_logprobs.append(lp.logprob if lp else None)
            out.top_logprobs.append({self.token(t): v for t, v in lp.top} if lp else None)
            out.text_offset.append(offset)
            offset += len(text)
        self._offsets[index] = offset
        return out


class ChatFormat(_Format):
    def __init__(self, rid: str, model: str, tokenizer: Tokenizer | None, body: p.ChatCompletionRequest,
                 parser: str) -> None:
        super().__init__(rid, model, tokenizer)
        self.logprobs = bool(body.logprobs)
        tools = body.active_tools
        self.choice: ToolChoiceValue | None = None
        self.parser = "none"
        if tools:
            self.choice = body.tool_choice or ToolChoiceValue("auto")
            self.parser = parser if self.choice.mode == "auto" else "none"
        self._calls: dict[int, CallStream] = {}

    def usage_chunk(self, usage: r.Usage) -> BaseModel:
        return r.ChatCompletionChunk(id=self.rid, model=self.model, choices=[], usage=usage)

    def first(self, n: int, usage: r.Usage | None) -> list[BaseModel]:
        return [r.ChatCompletionChunk(id=self.rid, model=self.model, usage=usage, choices=[r.ChatChunkChoice(
            index=i, delta=r.ChatDelta(role="assistant", content=""))]) for i in range(n)]

    def chunk(self, choice: Choice, out: RequestOutput, usage: r.Usage | None) -> list[BaseModel]:
        delta = r.ChatDelta()
        mode = self.choice.mode if self.choice else "none"
        reason = out.finish_reason
        if mode == "auto" and self.parser != "none":
            stream = self._calls.setdefault(choice.index, CallStream(self.parser))
            delta.content = stream.feed(out.new_text) or None
            if out.finished:
                rest, calls = stream.finish()
                delta.content = ((delta.content or "") + rest) or None
                if calls:
                    delta.tool_calls, reason = _deltas(calls), "tool_calls"
        elif mode == "named":
            if not choice.started or out.new_text:
                delta.tool_calls = [r.ToolCallDelta(index=0, function=r.FunctionCall(arguments=out.new_text))]
                if not choice.started:
                    call = ToolCall.new(self.choice.name, "")
                    delta.tool_calls[0].id, delta.tool_calls[0].type = call.id, "function"
                    delta.tool_calls[0].function.name = call.name
        elif mode == "required":
            if out.finished:
                calls = forced_calls(choice.text, self.choice)
                if calls:
                    delta.tool_calls, reason = _deltas(calls), "tool_calls"
        else:
            delta.content = out.new_text or None
        logprobs = self._logprobs(out.logprobs or [])
        if delta.content is None and delta.tool_calls is None and not out.finished and logprobs is None and not (
                out.new_token_ids and self.tokenizer is None):
            return []
        choice.started = True
        return [r.ChatCompletionChunk(id=self.rid, model=self.model, usage=usage, choices=[r.ChatChunkChoice(
            index=choice.index, delta=delta, finish_reason=reason, logprobs=logprobs)])]

    def final(self, choices: list[Choice], usage: r.Usage) -> BaseModel:
        bodies = []
        for c in choices:
            content: str | None = c.text
            calls: list[ToolCall] = []
            reason = c.last.finish_reason
            mode = self.choice.mode if self.choice else "none"
            if mode == "auto" and self.parser != "none":
                stream = CallStream(self.parser)
                stream.feed(c.text)
                _, calls = stream.finish()
                if calls:
                    content = _content_before_calls(c.text, self.parser)
            elif mode in ("named", "required"):
                calls, content = forced_calls(c.text, self.choice), None
            if calls and mode != "named":
                reason = "tool_calls"
            message = r.ChatMessageOut(content=content, tool_calls=[
                r.ToolCallOut(id=t.id, function=r.FunctionCall(name=t.name, arguments=t.arguments)) for t in calls])
            bodies.append(r.ChatChoice(index=c.index, message=message, finish_reason=reason,
                                       logprobs=self._logprobs(c.logprobs, final=True)))
        return r.ChatCompletionResponse(id=self.rid, model=self.model, choices=bodies, usage=usage)

    def _logprobs(self, tokens: list[TokenLogprob], final: bool = False) -> r.ChatLogprobs | None:
        if not self.logprobs or (not tokens and not final):
            return None
        return r.ChatLogprobs(content=[self._entry(lp) for lp in tokens])

    def _entry(self, lp: TokenLogprob) -> r.TokenLogprobOut:
        text = self.token(lp.token_id)
        return r.TokenLogprobOut(token=text, logprob=lp.logprob, bytes=list(text.encode()), top_logprobs=[
            r.TopLogprob(token=self.token(t), logprob=v, bytes=list(self.token(t).encode())) for t, v in lp.top])


def _deltas(calls: list[ToolCall]) -> list[r.ToolCallDelta]:
    return [r.ToolCallDelta(index=i, id=c.id, type="function", function=r.FunctionCall(name=c.name,
                                                                                         arguments=c.arguments))
            for i, c in enumerate(calls)]


def _content_before_calls(text: str, parser: str) -> str | None:
    return parse_calls(text, parser)[0]
