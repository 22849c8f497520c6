"""OpenAI's Responses API (`POST /v1/responses`) for text, as vLLM serves it: a request of messages (or one string)
becomes a chat request, runs as one, and its output comes back as a response object, or streamed as the Responses
events (response.created ... response.completed). Reasoning (with --reasoning-parser) is a reasoning item before the
message. Stored responses (previous_response_id, store-then-retrieve) and tools are not served: a request that needs
them gets a 400 naming the field.
"""
from __future__ import annotations

import re
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from appliance.engine.request import RequestOutput
from appliance.errors import RequestError
from appliance.server import protocol as p
from appliance.server import responses as r
from appliance.server.formatting import ChatFormat, Choice
from appliance.server.reasoning import ReasoningStream, split


class InputText(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["input_text", "output_text"]
    text: p.Text
    annotations: list[Any] | None = None  # output_text parts echoed back from an earlier response


class InputMessage(BaseModel):
    """A message of the input (OpenAI's EasyInputMessage, or an earlier response's output message echoed back)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: p.Text | list[InputText]
    id: str | None = None
    status: str | None = None

    def for_chat(self) -> dict[str, Any]:
        text = self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)
        return {"role": self.role, "content": text}


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    name: p.Text | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: p.Text | None = None
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    effort: Literal["minimal", "low", "medium", "high"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(BaseModel):
    """The text subset of OpenAI's Responses request."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: p.Text | None = None
    input: p.Text | Annotated[list[InputMessage], Field(min_length=1)]
    instructions: p.Text | None = Field(None, description="A system message before the input.")
    max_output_tokens: p.Count | None = None
    temperature: Annotated[p.Finite, Field(ge=0)] | None = None
    top_p: Annotated[p.Finite, Field(gt=0, le=1)] | None = None
    stream: bool | None = False
    text: TextConfig | None = Field(None, description="format: text, json_object or json_schema (constrained "
                                                      "decoding); verbosity is accepted and ignored.")
    reasoning: ReasoningConfig | None = Field(None, description="effort: the chat template's reasoning_effort.")
    slo_class: p.Text | None = Field(None, description="Extension: the request class of the SLO contract.")
    previous_response_id: p.Text | None = Field(None, json_schema_extra={"enum": [None]},
                                                description="Not served: muxd stores no responses.")
    tools: list[Any] | None = Field(None, json_schema_extra={"enum": [[], None]}, description="Only [].")
    tool_choice: Literal["none", "auto"] | None = None
    parallel_tool_calls: bool | None = None
    truncation: Literal["disabled"] | None = Field(None, description="Only disabled: a prompt over the context is a "
                                                                     "400.")
    include: list[Any] | None = Field(None, json_schema_extra={"enum": [[], None]}, description="Only [].")
    store: bool | None = Field(None, description="Accepted; nothing is stored.")
    background: Literal[False] | None = None
    metadata: Annotated[dict[str, p.Text], Field(max_length=16)] | None = Field(None, description="Accepted and "
                                                                                                "ignored.")
    user: p.Text | None = Field(None, description="Accepted and ignored.")
    safety_identifier: p.Text | None = Field(None, description="Accepted and ignored.")
    prompt_cache_key: p.Text | None = Field(None, description="Accepted and ignored.")
    service_tier: p.Text | None = Field(None, description="Accepted and ignored.")

    @field_validator("input", mode="before")
    @classmethod
    def _messages_only(cls, value: Any) -> Any:
        """One clear message for an item that is not a message (a function call, its output, an image, ...)."""
        for i, item in enumerate(value if isinstance(value, list) else []):
            kind = item.get("type") if isinstance(item, dict) else None
            if kind not in (None, "message"):
                raise RequestError(f"input items of type {kind!r} are not served on /v1/responses, which takes "
                                   "messages of text (send tools and their results to /v1/chat/completions)",
                                   f"input.{i}")
        return value

    def to_chat(self, chat_body: type[p.ChatCompletionRequest]) -> p.ChatCompletionRequest:
        """The chat request this one runs as."""
        if self.previous_response_id is not None:
            raise RequestError("previous_response_id: muxd stores no responses; send the whole conversation in "
                               "input", "previous_response_id")
        if self.tools:
            raise RequestError("tools are not served on /v1/responses; use /v1/chat/completions with tools", "tools")
        if self.include:
            raise RequestError("include: no extra output is served; leave it out or send []", "include")
        items = [InputMessage(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        messages = ([{"role": "system", "content": self.instructions}] if self.instructions is not None else []) + \
            [m.for_chat() for m in items]
        body: dict[str, Any] = {"model": self.model, "messages": messages, "stream": bool(self.stream)}
        for name, value in (("max_completion_tokens", self.max_output_tokens), ("temperature", self.temperature),
                            ("top_p", self.top_p), ("slo_class", self.slo_class)):
            if value is not None:
                body[name] = value
        if self.reasoning is not None and self.reasoning.effort is not None:
            body["reasoning_effort"] = self.reasoning.effort
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_schema":
            if fmt.schema_ is None or fmt.name is None:
                raise RequestError("text.format json_schema needs a name and a schema", "text.format")
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}}
        elif fmt is not None and fmt.type == "json_object":
            body["response_format"] = {"type": "json_object"}
        try:
            return chat_body.model_validate(body)
        except ValidationError as exc:  # a value the chat request refuses, named as this request names it
            error = exc.errors()[0]
            where = ".".join(map(str, error["loc"]))
            raise renamed(RequestError(f"{where}: {error['msg']}", str(error["loc"][0]))) from None
        except RequestError as exc:
            raise renamed(exc) from None


# the chat request's fields -> the fields of this request they come from
_NAMES = {"messages": "input", "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
          "response_format": "text.format", "reasoning_effort": "reasoning.effort"}


def renamed(exc: RequestError) -> RequestError:
    """A chat request's error about a field, naming the field of the Responses request it came from."""
    name = _NAMES.get(exc.param or "")
    if name is None:
        return exc
    message = re.sub(rf"\b{re.escape(exc.param)}\b", name, str(exc))
    return RequestError(message, name, exc.code)


class Event(BaseModel):
    """One streamed event of the Responses API; its other fields depend on its type."""

    model_config = ConfigDict(extra="allow")

    type: str
    sequence_number: int


class ResponseObject(BaseModel):
    """A response (its `output`: a reasoning item, when there is reasoning, then the message)."""

    model_config = ConfigDict(extra="allow")

    id: str
    object: Literal["response"] = "response"
    created_at: int
    model: str
    status: Literal["in_progress", "completed", "incomplete"]
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None = None


class ResponsesFormat(ChatFormat):
    """The chat output of one response as a response object, or as Responses events: a reasoning item (with
    reasoning) opened at its first text and closed at the message's, then the message, then the finished response."""

    def __init__(self, rid: str, model: str, chat: p.ChatCompletionRequest, request: ResponsesRequest,
                 thinking: bool | None) -> None:
        super().__init__(rid, model, None, chat, "none", thinking)
        self.request = request
        self.created = int(time.time())
        self.sequence = 0
        self.kinds: list[str] = []  # the output items opened so far: "reasoning", then "message"
        self.texts: list[str] = []
        self.closed = 0  # items whose done events went out
        self._split = ReasoningStream(thinking) if thinking is not None else None

    def first(self, n: int, usage: r.Usage | None) -> list[BaseModel]:
        pending = self._response("in_progress", [])
        return [self._event("response.created", response=pending),
                self._event("response.in_progress", response=pending)]

    def chunk(self, choice: Choice, out: RequestOutput, usage: r.Usage | None) -> list[BaseModel]:
        reasoning, content = "", out.new_text
        if self._split is not None:
            reasoning, content = self._split.feed(content)
            if out.finished:
                more_reasoning, more_content = self._split.finish()
                reasoning, content = reasoning + more_reasoning, content + more_content
        events: list[BaseModel] = []
        if reasoning and self.show_reasoning:
            if not self.kinds:
                events += self._open("reasoning")
            events.append(self._event("response.reasoning_text.delta", **self._where(), delta=reasoning))
            self.texts[-1] += reasoning
        if content or out.finished:
            if not self.kinds or self.kinds[-1] != "message":
                events += self._close() + self._open("message")
            if content:
                events.append(self._event("response.output_text.delta", **self._where(), delta=content,
                                          logprobs=[]))
                self.texts[-1] += content
        if out.finished:
            events += self._close()
            length = out.finish_reason == "length"
            done = self._response("incomplete" if length else "completed",
                                  [self._item(i, "completed") for i in range(len(self.kinds))],
                                  r.Usage.of(out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens),
                                  length)
            events.append(self._event("response.incomplete" if length else "response.completed", response=done))
        return events

    def final(self, choices: list[Choice], usage: r.Usage) -> BaseModel:
        choice = choices[0]
        reasoning, content = split(choice.text, self.thinking) if self.thinking is not None else ("", choice.text)
        self.kinds, self.texts = [], []
        if reasoning and self.show_reasoning:
            self.kinds.append("reasoning")
            self.texts.append(reasoning)
        self.kinds.append("message")
        self.texts.append(content)
        length = choice.last.finish_reason == "length"
        return self._response("incomplete" if length else "completed",
                              [self._item(i, "completed") for i in range(len(self.kinds))], usage, length)

    # ---- pieces ---------------------------------------------------------------------------------------------------
    def _event(self, kind: str, **fields: Any) -> Event:
        self.sequence += 1
        return Event(type=kind, sequence_number=self.sequence - 1, **fields)

    def _where(self) -> dict[str, Any]:
        """The last item's place, as its delta and done events name it."""
        index = len(self.kinds) - 1
        return {"item_id": self._id(index), "output_index": index, "content_index": 0}

    def _id(self, index: int) -> str:
        return f"{'rs' if self.kinds[index] == 'reasoning' else 'msg'}_{self.rid}"

    def _item(self, index: int, status: str) -> dict[str, Any]:
        text, item = self.texts[index], {"id": self._id(index), "status": status}
        if self.kinds[index] == "reasoning":
            parts = [{"type": "reasoning_text", "text": text}] if status == "completed" else []
            return {**item, "type": "reasoning", "summary": [], "content": parts}
        parts = [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []
        return {**item, "type": "message", "role": "assistant", "content": parts}

    def _open(self, kind: str) -> list[BaseModel]:
        self.kinds.append(kind)
        self.texts.append("")
        index = len(self.kinds) - 1
        events = [self._event("response.output_item.added", output_index=index, item=self._item(index, "in_progress"))]
        if kind == "message":
            events.append(self._event("response.content_part.added", **self._where(),
                                      part={"type": "output_text", "text": "", "annotations": []}))
        return events

    def _close(self) -> list[BaseModel]:
        """The done events of the last item opened, unless they went out already."""
        index = len(self.kinds) - 1
        if index < self.closed:
            return []
        self.closed = index + 1
        text = self.texts[index]
        if self.kinds[index] == "reasoning":
            events = [self._event("response.reasoning_text.done", **self._where(), text=text)]
        else:
            events = [self._event("response.output_text.done", **self._where(), text=text, logprobs=[]),
                      self._event("response.content_part.done", **self._where(),
                                  part={"type": "output_text", "text": text, "annotations": []})]
        return events + [self._event("response.output_item.done", output_index=index,
                                     item=self._item(index, "completed"))]

    def _response(self, status: str, output: list[dict[str, Any]], usage: r.Usage | None = None,
                  length: bool = False) -> ResponseObject:
        q = self.request
        fields: dict[str, Any] = {
            "parallel_tool_calls": q.parallel_tool_calls is not False, "tool_choice": q.tool_choice or "auto",
            "tools": [], "temperature": q.temperature, "top_p": q.top_p, "max_output_tokens": q.max_output_tokens,
            "instructions": q.instructions, "metadata": q.metadata or {},
            "incomplete_details": {"reason": "max_output_tokens"} if length else None}
        if usage is not None:  # reasoning tokens are not counted apart from the output's
            fields["usage"] = {"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
                               "total_tokens": usage.total_tokens, "input_tokens_details": {
                                   "cached_tokens": usage.prompt_tokens_details.cached_tokens,
                                   "cache_write_tokens": 0},  # no explicit cache writes (the prefix cache is automatic)
                               "output_tokens_details": {"reasoning_tokens": 0}}
        return ResponseObject(id=self.rid, created_at=self.created, model=self.model, status=status, output=output,
                              **fields)
