"""The OpenAI bodies of a request's choices: each choice's text, log-probabilities and tool calls as the engine's
outputs arrive, turned into stream chunks or a final body, for completions (`CompletionFormat`) and chat
(`ChatFormat`).
"""
from __future__ import annotations

import dataclasses
import time
from typing import AsyncIterator

from pydantic import BaseModel
from pydantic_core import to_json

from appliance.engine.request import RequestOutput, TokenLogprob
from appliance.model_zoo.tokenizer import Tokenizer
from appliance.server import protocol as p
from appliance.server import responses as r
from appliance.server.reasoning import ReasoningStream, split
from appliance.server.tools import CallStream, ForcedCalls, ToolCall, ToolChoiceValue, forced_calls, parse_calls


class Choice:
    """What one choice has produced so far."""

    def __init__(self, index: int, keep: bool = False) -> None:
        self.index = index
        self.outputs: list[RequestOutput] | None = [] if keep else None  # kept to replay them (best_of)
        self.parts: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self.last: RequestOutput | None = None
        self.started = False  # its first chunk has gone out

    def add(self, out: RequestOutput) -> None:
        self.parts.append(out.new_text)
        self.token_ids += out.new_token_ids
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
        ranked = sorted(choices[start:start + group], key=lambda c: -sum(lp.log_probability for lp in c.logprobs))[:n]
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
    def __init__(self, rid: str, model: str, tokenizer: Tokenizer | None, body: p._SamplingRequest) -> None:
        self.rid, self.model, self.tokenizer = rid, model, tokenizer
        self.created = int(time.time())  # every chunk of a stream shows the same (as OpenAI and vLLM)
        self.as_ids = bool(body.return_tokens_as_token_ids)
        self.with_ids = bool(body.return_token_ids)  # token ids beside the text (vLLM's return_token_ids)
        self.prompt_top = body.prompt_logprobs if body.returns_prompt_logprobs else None
        self._token_text: dict[int, str] = {}
        self._plain_head: str | None = None

    def text(self, token_id: int) -> str:
        """The token's text ('token_id:<id>' without a tokenizer)."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False) if self.tokenizer else \
                f"token_id:{token_id}"
            self._token_text[token_id] = text
        return text

    def token(self, token_id: int) -> str:
        """The token as log-probabilities name it: its text, or 'token_id:<id>' (return_tokens_as_token_ids)."""
        return f"token_id:{token_id}" if self.as_ids else self.text(token_id)

    def prompt_logprobs(self, choice: Choice) -> list[dict[str, r.PromptLogprob] | None] | None:
        """vLLM's `prompt_logprobs` of a choice (when asked for): null for the first prompt token, then for each token
        its id (as a string) and the top alternatives' -> {logprob, rank, decoded_token}."""
        if self.prompt_top is None or choice.last is None:
            return None
        entries = _prompt_entries(choice.prompt_logprobs, choice.last.num_prompt_tokens)
        decoded = self.text if self.tokenizer else (lambda _: None)
        out: list[dict[str, r.PromptLogprob] | None] = []
        for lp in entries:
            if lp is None:
                out.append(None)
                continue
            entry = {str(lp.token_id): r.PromptLogprob(logprob=lp.logprob, rank=lp.rank,
                                                        decoded_token=decoded(lp.token_id))}
            for rank, (t, v) in enumerate(lp.top[:self.prompt_top], start=1):
                entry.setdefault(str(t), r.PromptLogprob(logprob=v, rank=rank, decoded_token=decoded(t)))
            out.append(entry)
        return out

    def shown(self, out: RequestOutput) -> RequestOutput:
        """The engine's output as the response counts and shows it."""
        return out

    def first(self, n: int, usage: r.Usage | None) -> list[BaseModel]:
        return []

    def plain(self, choice: Choice, out: RequestOutput, usage: r.Usage | None) -> str | None:
        """Most chunks of a stream carry new text and nothing else: such a chunk's JSON, the bytes `chunk`'s model
        would serialize to, written from a head made once per response (building and dumping the models cost about
        five times as much, on the event loop's thread, for every token); None where `chunk` must build it."""
        return None

    def _head(self, kind: str) -> str:
        """The JSON of a plain chunk up to its choice's index (made at the response's first plain chunk)."""
        if self._plain_head is None:
            self._plain_head = (f'{{"id":{to_json(self.rid).decode()},"object":"{kind}","created":{self.created},'
                                f'"model":{to_json(self.model).decode()},"choices":[{{"index":')
        return self._plain_head

    def usage_chunk(self, usage: r.Usage) -> BaseModel:
        """The last chunk of a stream with include_usage: no choice, the usage of all."""
        return r.CompletionResponse(id=self.rid, created=self.created, model=self.model, choices=[], usage=usage)


class CompletionFormat(_Format):
    """Choice i of a batch of prompts answers prompt i // n (n: the choices returned per prompt)."""

    def __init__(self, rid: str, model: str, tokenizer: Tokenizer | None, body: p.CompletionRequest,
                 prompt_ids: list[list[int]], cut: list[bool] | None = None) -> None:
        """`cut`: which prompts truncate_prompt_tokens shortened (their echo is the text of the tokens kept)."""
        super().__init__(rid, model, tokenizer, body)
        self.logprobs, self.echo, self.echo_only = body.logprobs, bool(body.echo), body.echo_only
        self.prompt_ids, self.per_prompt = prompt_ids, body.num_choices
        cut = cut or [False] * len(prompt_ids)
        self.echoes = [self._echo_text(prompt, ids, shortened) if self.echo else ""
                       for prompt, ids, shortened in zip(body.prompts(), prompt_ids, cut)]
        self._offsets: dict[int, int] = {}

    def _echo_text(self, prompt: str | list[int], ids: list[int], shortened: bool) -> str:
        """The prompt as sent, or the text of the tokens it was given as or cut to."""
        if isinstance(prompt, str) and not shortened:
            return prompt
        return self.tokenizer.decode(ids) if self.tokenizer else ""

    def _prompt(self, index: int) -> int:
        return index // self.per_prompt

    def shown(self, out: RequestOutput) -> RequestOutput:
        """Echo without generation: the token sampled to score the prompt is dropped (text, ids, log-probabilities,
        usage); the choice ends as vLLM's does, at its length."""
        if not self.echo_only:
            return out
        return dataclasses.replace(out, new_token_ids=[], new_text="", text="" if out.text is not None else None,
                                   logprobs=None, num_output_tokens=0,
                                   finish_reason="length" if out.finished else None, stop_reason=None)

    def plain(self, choice: Choice, out: RequestOutput, usage: r.Usage | None) -> str | None:
        if (usage is not None or out.finished or not out.new_text or self.logprobs is not None or self.with_ids
                or self.tokenizer is None or (self.echo and not choice.started)):
            return None
        choice.started = True
        return f'{self._head("text_completion")}{choice.index},"text":{to_json(out.new_text).decode()}}}]}}'

    def chunk(self, choice: Choice, out: RequestOutput, usage: r.Usage | None) -> list[BaseModel]:
        echoed = self.echo and not choice.started
        echo = self.echoes[self._prompt(choice.index)] if echoed else ""
        logprobs = self._logprobs(choice.index, out.prompt_logprobs if echoed else None, out.logprobs or [], echoed)
        ids = out.new_token_ids and (self.with_ids or self.tokenizer is None)
        if not (echo or out.new_text or out.finished or logprobs or ids):
            return []
        first = not choice.started
        choice.started = True
        body = r.CompletionChoice(index=choice.index, text=echo + out.new_text, finish_reason=out.finish_reason,
                                  stop_reason=out.stop_reason, logprobs=logprobs,
                                  token_ids=out.new_token_ids if self.with_ids else None,
                                  prompt_token_ids=self.prompt_ids[self._prompt(choice.index)]
                                  if self.with_ids and first else None)
        return [r.CompletionResponse(id=self.rid, created=self.created, model=self.model, choices=[body],
                                     usage=usage)]

    def final(self, choices: list[Choice], usage: r.Usage) -> BaseModel:
        bodies = []
        for c in choices:
            echo = self.echoes[self._prompt(c.index)]
            bodies.append(r.CompletionChoice(index=c.index, text=echo + c.text, finish_reason=c.last.finish_reason,
                                             stop_reason=c.last.stop_reason,
                                             token_ids=c.token_ids if self.with_ids else None,
                                             prompt_token_ids=self.prompt_ids[self._prompt(c.index)]
                                             if self.with_ids else None,
                                             logprobs=self._logprobs(c.index, c.prompt_logprobs if self.echo else None,
                                                                     c.logprobs, self.echo),
                                             prompt_logprobs=self.prompt_logprobs(c)))
        return r.CompletionResponse(id=self.rid, created=self.created, model=self.model, choices=bodies, usage=usage)

    def _logprobs(self, index: int, prompt: list[TokenLogprob | None] | None, tokens: list[TokenLogprob],
                  echoed: bool = False) -> r.CompletionLogprobs | None:
        """`echoed`: the prompt's tokens come first (with `prompt`, their log-probabilities)."""
        if self.logprobs is None:
            return None
        out = r.CompletionLogprobs()
        offset = self._offsets.get(index, 0)
        entries: list[tuple[int, TokenLogprob | None]] = []
        if echoed:
            ids = self.prompt_ids[self._prompt(index)]
            entries += list(zip(ids, _prompt_entries(prompt, len(ids))))
        entries += [(lp.token_id, lp) for lp in tokens]
        for token_id, lp in entries:
            out.tokens.append(self.token(token_id))
            out.token_logprobs.append(lp.logprob if lp else None)
            out.top_logprobs.append(self._top(lp) if lp else None)
            out.text_offset.append(offset)  # offsets in the text, whatever names the tokens
            offset += len(self.text(token_id))
        self._offsets[index] = offset
        return out

    def _top(self, lp: TokenLogprob) -> dict[str, float]:
        """The token itself, then the `logprobs` likeliest (as OpenAI and vLLM: up to logprobs + 1 entries)."""
        top = {self.token(lp.token_id): lp.logprob}
        for t, v in lp.top[:self.logprobs]:
            top.setdefault(self.token(t), v)
        return top


class ChatFormat(_Format):
    def __init__(self, rid: str, model: str, tokenizer: Tokenizer | None, body: p.ChatCompletionRequest,
                 parser: str, thinking: bool | None = None, prompt_ids: list[int] | None = None) -> None:
        """`thinking`: None without a reasoning parser (or where a grammar constrains the output from its first
        token), else whether the output begins inside a think block (reasoning.opens_thinking); `prompt_ids`: the
        prompt's tokens (for return_token_ids)."""
        super().__init__(rid, model, tokenizer, body)
        self.prompt_ids = prompt_ids if self.with_ids else None
        self.logprobs = bool(body.logprobs)
        tools = body.active_tools
        self.choice: ToolChoiceValue | None = None
        self.parser = "none"
        if tools:
            self.choice = body.tool_choice or ToolChoiceValue("auto")
            self.parser = parser if self.choice.mode == "auto" else "none"
        self.thinking, self.show_reasoning = thinking, body.include_reasoning is not False
        self._calls: dict[int, CallStream] = {}
        self._forced: dict[int, ForcedCalls] = {}  # tool_choice "required": each choice's calls as they stream
        self._reasoning: dict[int, ReasoningStream] = {}
        self.echo = body.echoed()  # the last (assistant) message, before each answer

    def usage_chunk(self, usage: r.Usage) -> BaseModel:
        return r.ChatCompletionChunk(id=self.rid, created=self.created, model=self.model, choices=[], usage=usage)

    def first(self, n: int, usage: r.Usage | None) -> list[BaseModel]:
        chunks = [r.ChatCompletionChunk(id=self.rid, created=self.created, model=self.model, usage=usage, choices=[
            r.ChatChunkChoice(index=i, delta=r.ChatDelta(role="assistant", content=""))],
            prompt_token_ids=self.prompt_ids if i == 0 else None) for i in range(n)]
        if self.echo:  # as vLLM's: each choice's echo in a chunk of its own, after the roles
            chunks += [r.ChatCompletionChunk(id=self.rid, created=self.created, model=self.model, usage=usage,
                                             choices=[r.ChatChunkChoice(index=i, delta=r.ChatDelta(content=self.echo))])
                       for i in range(n)]
        return chunks

    def plain(self, choice: Choice, out: RequestOutput, usage: r.Usage | None) -> str | None:
        mode = self.choice.mode if self.choice else "none"
        if (usage is not None or out.finished or not out.new_text or self.logprobs or self.with_ids
                or self.tokenizer is None or self.thinking is not None or mode in ("named", "required")
                or (mode == "auto" and self.parser != "none")):
            return None
        choice.started = True
        text = to_json(out.new_text).decode()
        return f'{self._head("chat.completion.chunk")}{choice.index},"delta":{{"content":{text}}}}}]}}'

    def chunk(self, choice: Choice, out: RequestOutput, usage: r.Usage | None) -> list[BaseModel]:
        delta = r.ChatDelta()
        mode = self.choice.mode if self.choice else "none"
        reason = out.finish_reason
        text = out.new_text
        if self.thinking is not None:
            thoughts = self._reasoning.setdefault(choice.index, ReasoningStream(self.thinking))
            reasoning, text = thoughts.feed(text)
            if out.finished:
                more_reasoning, more_text = thoughts.finish()
                reasoning, text = reasoning + more_reasoning, text + more_text
            delta.reasoning = (reasoning or None) if self.show_reasoning else None
        if mode == "auto" and self.parser != "none":  # content until the calls begin, then each call as it comes
            stream = self._calls.setdefault(choice.index, CallStream(self.parser))
            delta.content = stream.feed(text) or None
            delta.tool_calls = _call_deltas(stream.call_deltas())
            if out.finished:
                rest, calls = stream.finish()
                delta.content = ((delta.content or "") + rest) or None
                if calls:
                    reason = "tool_calls"
                    if not stream.announced:  # calls the streaming scan did not see: whole, at the end
                        delta.tool_calls = _deltas(calls)
        elif mode == "named":
            if not choice.started or out.new_text:
                delta.tool_calls = [r.ToolCallDelta(index=0, function=r.FunctionCall(arguments=out.new_text))]
                if not choice.started:
                    call = ToolCall.new(self.choice.name, "")
                    delta.tool_calls[0].id, delta.tool_calls[0].type = call.id, "function"
                    delta.tool_calls[0].function.name = call.name
        elif mode == "required":  # each call once its name is written, then its arguments as they come
            forced = self._forced.setdefault(choice.index, ForcedCalls())
            delta.tool_calls = _call_deltas(forced.feed(out.new_text))
            if out.finished and forced.complete:
                reason = "tool_calls"
        else:
            delta.content = text or None
        logprobs = self._logprobs(out.logprobs or [])
        if delta.content is None and delta.tool_calls is None and delta.reasoning is None and not out.finished and \
                logprobs is None and not (out.new_token_ids and (self.with_ids or self.tokenizer is None)):
            return []
        choice.started = True
        return [r.ChatCompletionChunk(id=self.rid, created=self.created, model=self.model, usage=usage, choices=[
            r.ChatChunkChoice(index=choice.index, delta=delta, finish_reason=reason, stop_reason=out.stop_reason,
                              logprobs=logprobs, token_ids=out.new_token_ids if self.with_ids else None)])]

    def final(self, choices: list[Choice], usage: r.Usage) -> BaseModel:
        bodies = []
        for c in choices:
            content: str | None = c.text
            reasoning: str | None = None
            if self.thinking is not None:
                reasoning, content = split(c.text, self.thinking)
                reasoning, content = (reasoning or None) if self.show_reasoning else None, content or None
            calls: list[ToolCall] = []
            reason = c.last.finish_reason
            mode = self.choice.mode if self.choice else "none"
            if mode == "auto" and self.parser != "none" and content:
                stream = CallStream(self.parser)
                stream.feed(content)
                _, calls = stream.finish()
                if calls:
                    content = _content_before_calls(content, self.parser)
            elif mode == "named":
                calls, content = forced_calls(c.text, self.choice), None
            elif mode == "required":  # calls cut short by max_tokens are returned as written, ending as "length"
                forced = ForcedCalls()
                forced.feed(c.text)
                calls, content = forced.calls(), None
                reason = "tool_calls" if forced.complete else reason
            if calls and mode == "auto":
                reason = "tool_calls"
            if self.echo:
                content = self.echo + (content or "")
            message = r.ChatMessageOut(content=content, reasoning=reasoning, tool_calls=[
                r.ToolCallOut(id=t.id, function=r.FunctionCall(name=t.name, arguments=t.arguments)) for t in calls])
            bodies.append(r.ChatChoice(index=c.index, message=message, finish_reason=reason,
                                       stop_reason=c.last.stop_reason, logprobs=self._logprobs(c.logprobs, final=True),
                                       token_ids=c.token_ids if self.with_ids else None))
        first = next((c for c in choices if c.last is not None), None)  # every choice has the same prompt
        return r.ChatCompletionResponse(id=self.rid, created=self.created, model=self.model, choices=bodies,
                                        usage=usage, prompt_logprobs=self.prompt_logprobs(first) if first else None,
                                        prompt_token_ids=self.prompt_ids)

    def _logprobs(self, tokens: list[TokenLogprob], final: bool = False) -> r.ChatLogprobs | None:
        if not self.logprobs or (not tokens and not final):
            return None
        return r.ChatLogprobs(content=[self._entry(lp) for lp in tokens])

    def _entry(self, lp: TokenLogprob) -> r.TokenLogprobOut:
        """`bytes` are the token text's UTF-8 bytes, also when `token` is 'token_id:<id>'."""
        return r.TokenLogprobOut(token=self.token(lp.token_id), logprob=lp.logprob,
                                 bytes=list(self.text(lp.token_id).encode()), top_logprobs=[
            r.TopLogprob(token=self.token(t), logprob=v, bytes=list(self.text(t).encode())) for t, v in lp.top])


def _prompt_entries(prompt: list[TokenLogprob | None] | None, n: int) -> list[TokenLogprob | None]:
    """A prompt's log-probabilities, or n nulls when the engine reported none (a prompt of one token has none)."""
    return prompt if prompt is not None else [None] * n


def _call_deltas(news: list[tuple[int, str | None, str | None, str]]) -> list[r.ToolCallDelta] | None:
    """Chunks' tool call deltas from ForcedCalls.feed's news: a call's id, type and name once, then its arguments."""
    return [r.ToolCallDelta(index=k, id=call_id, type="function" if call_id else None,
                            function=r.FunctionCall(name=name, arguments=args))
            for k, call_id, name, args in news] or None


def _deltas(calls: list[ToolCall]) -> list[r.ToolCallDelta]:
    return [r.ToolCallDelta(index=i, id=c.id, type="function", function=r.FunctionCall(name=c.name,
                                                                                         arguments=c.arguments))
            for i, c in enumerate(calls)]


def _content_before_calls(text: str, parser: str) -> str | None:
    return parse_calls(text, parser)[0]
