"""OpenAI's Responses API (`POST /v1/responses`) for text and function tools, as vLLM serves it: the request becomes
the chat request it amounts to (instructions a system message; input messages, function calls and their outputs the
conversation; function tools the chat tools) and runs as one; what the chat request answers (reasoning, content,
tool calls) comes back as the response's output items (a reasoning item, the message, function calls), whole or
streamed as the Responses events (response.created ... response.completed). Stored responses (previous_response_id)
and hosted tools (web search, files, ...) are not served: a request that needs them gets a 400 naming the field.
"""
from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    create_model,
    field_validator,
)

from appliance.engine.request import RequestOutput
from appliance.errors import RequestError
from appliance.server import protocol as p
from appliance.server import responses as r
from appliance.server.formatting import ChatFormat, Choice
from appliance.server.tools import FunctionDef, FunctionName


class InputText(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["input_text", "output_text"]
    text: p.Text
    annotations: list[Any] | None = None  # output_text parts echoed back from an earlier response
    logprobs: list[Any] | None = None


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


class _CallItem(BaseModel):
    """An input item about one function call (`call_id`), with the id and status a response gave it."""

    model_config = ConfigDict(extra="forbid", strict=True)

    call_id: p.Text
    id: str | None = None
    status: str | None = None


class FunctionCallItem(_CallItem):
    """A function call of an earlier response, echoed back."""

    type: Literal["function_call"]
    name: p.Text
    arguments: p.Text


class FunctionCallOutputItem(_CallItem):
    """What a function call returned."""

    type: Literal["function_call_output"]
    output: p.Text


class ReasoningInputItem(BaseModel):
    """The reasoning item of an earlier response, echoed back (templates drop earlier turns' reasoning: ignored)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[Any] = Field(default_factory=list)
    content: list[Any] | None = None
    status: str | None = None
    encrypted_content: str | None = None


def _item_kind(value: Any) -> str:
    return (value.get("type") or "message") if isinstance(value, dict) else "message"


InputItem = Annotated[Union[Annotated[InputMessage, Tag("message")], Annotated[FunctionCallItem, Tag("function_call")],
                            Annotated[FunctionCallOutputItem, Tag("function_call_output")],
                            Annotated[ReasoningInputItem, Tag("reasoning")]], Discriminator(_item_kind)]
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


class FunctionTool(FunctionDef):
    """A function tool: chat's function definition, flat, with its type."""

    type: Literal["function"]


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function"]
    name: FunctionName


class TextFormat(BaseModel):
    # the schema says it too: json_schema needs a name and a schema
    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={
        "if": {"properties": {"type": {"const": "json_schema"}}, "required": ["type"]},
        "then": {"required": ["name", "schema"], "properties": {"name": {"type": "string"},
                                                                "schema": {"type": "object"}}}})

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

    effort: p.ReasoningEffort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(BaseModel):
    """The text and function-tool subset of OpenAI's Responses request."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: p.Text | None = None
    input: p.Text | Annotated[list[InputItem], Field(min_length=1)]
    instructions: p.Text | None = Field(None, description="A system message before the input.")
    max_output_tokens: p.Count | None = None
    temperature: Annotated[p.Finite, Field(ge=0)] | None = None
    top_p: Annotated[p.Finite, Field(gt=0, le=1)] | None = None
    stream: bool | None = False
    text: TextConfig | None = Field(None, description="format: text, json_object or json_schema (constrained "
                                                      "decoding); verbosity is accepted and ignored.")
    reasoning: ReasoningConfig | None = Field(None, description="effort: the chat template's reasoning_effort.")
    tools: list[FunctionTool] | None = Field(None, description="Function tools (hosted tools are not served).")
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    slo_class: p.Text | None = Field(None, description="Extension: the request class of the SLO contract.")
    previous_response_id: p.Text | None = Field(None, json_schema_extra={"enum": [None]},
                                                description="Not served: muxd stores no responses.")
    truncation: Literal["disabled"] | None = Field(None, description="Only disabled: a prompt over the context is a "
                                                                     "400.")
    include: list[Literal["reasoning.encrypted_content"]] | None = Field(
        None, description="Only reasoning.encrypted_content, which needs nothing: reasoning items carry their text "
                          "(clients that keep no stored responses send it).")
    store: bool | None = Field(None, description="Accepted; nothing is stored.")
    background: bool | None = Field(None, json_schema_extra={"enum": [False, None]},
                                    description="Only false: responses are not run in the background.")
    metadata: Annotated[dict[str, p.Text], Field(max_length=16)] | None = Field(None, description="Accepted and "
                                                                                                "ignored.")
    user: p.Text | None = Field(None, description="Accepted and ignored.")
    safety_identifier: p.Text | None = Field(None, description="Accepted and ignored.")
    prompt_cache_key: p.Text | None = Field(None, description="Accepted and ignored.")
    service_tier: p.Text | None = Field(None, description="Accepted and ignored.")
    request_id: Annotated[p.Text, Field(min_length=1, max_length=256)] | None = Field(
        None, description="Extension (vLLM): the response's id (an X-Request-Id header wins).")

    @field_validator("input", mode="before")
    @classmethod
    def _served_items(cls, value: Any) -> Any:
        """One clear message for an item muxd does not serve (an image, a hosted tool's call, ...)."""
        for i, item in enumerate(value if isinstance(value, list) else []):
            if _item_kind(item) not in ITEM_TYPES:
                raise RequestError(f"input items of type {_item_kind(item)!r} are not served; muxd takes "
                                   f"{', '.join(ITEM_TYPES)}", f"input.{i}")
        return value

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, value: Any) -> Any:
        for i, tool in enumerate(value if isinstance(value, list) else []):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise RequestError(f"tools of type {kind!r} are not served; muxd takes function tools",
                                   f"tools.{i}")
        return value

    def to_chat(self, chat_body: type[p.ChatCompletionRequest]) -> p.ChatCompletionRequest:
        """The chat request this one runs as."""
        if self.background:  # (a bool field: strict, unlike Literal[False], which takes 0)
            raise RequestError("background: muxd runs no responses in the background (nothing is stored to fetch "
                               "later); send false or leave it out", "background")
        if self.previous_response_id is not None:
            raise RequestError("previous_response_id: muxd stores no responses; send the whole conversation in "
                               "input", "previous_response_id")
        body: dict[str, Any] = {"model": self.model, "messages": self._messages(), "stream": bool(self.stream)}
        for name, value in (("max_completion_tokens", self.max_output_tokens), ("temperature", self.temperature),
                            ("top_p", self.top_p), ("slo_class", self.slo_class),
                            ("parallel_tool_calls", self.parallel_tool_calls)):
            if value is not None:
                body[name] = value
        if self.tools:
            body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                             for t in self.tools]
        if isinstance(self.tool_choice, NamedFunction):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
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

    def _messages(self) -> list[dict[str, Any]]:
        """The chat conversation: instructions, then the input's messages; a run of function calls is one assistant
        message with those tool calls, and each call's output a tool message."""
        items = [InputMessage(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        out: list[dict[str, Any]] = [{"role": "system", "content": self.instructions}] \
            if self.instructions is not None else []
        for item in items:
            if isinstance(item, InputMessage):
                out.append(item.for_chat())
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                    out[-1]["tool_calls"].append(call)
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        if not out:  # (no schema can say "an item that is not reasoning")
            raise RequestError("input holds only reasoning items and there are no instructions: nothing to answer",
                               "input", p.CONFLICT)
        return out


def responses_body(chat_body: type[p.ChatCompletionRequest]) -> type[ResponsesRequest]:
    """The Responses body of one served model: `slo_class` as its chat body's (one of the contract's classes)."""
    slo_class = chat_body.model_fields["slo_class"]
    return create_model("ResponsesRequest", __base__=ResponsesRequest, __doc__=ResponsesRequest.__doc__,
                        slo_class=(slo_class.annotation, Field(None, description=slo_class.description,
                                                               json_schema_extra=slo_class.json_schema_extra)))


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
    """A response: its output items (reasoning, the message, function calls) and usage."""

    model_config = ConfigDict(extra="allow")

    id: str
    object: Literal["response"] = "response"
    created_at: int
    model: str
    status: Literal["in_progress", "completed", "incomplete"]
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None = None


class _Item:
    """One output item as it streams: its kind, its id, and its text (a call: its arguments)."""

    def __init__(self, kind: str, item_id: str, text: str = "", name: str | None = None,
                 call_id: str | None = None) -> None:
        self.kind, self.id, self.text, self.name, self.call_id = kind, item_id, text, name, call_id
        self.done = False

    def body(self, status: str) -> dict[str, Any]:
        finished = status == "completed"
        if self.kind == "reasoning":
            return {"type": "reasoning", "id": self.id, "status": status, "summary": [],
                    "content": [{"type": "reasoning_text", "text": self.text}] if finished else []}
        if self.kind == "message":
            return {"type": "message", "id": self.id, "role": "assistant", "status": status,
                    "content": [_text_part(self.text)] if finished else []}
        return {"type": "function_call", "id": self.id, "call_id": self.call_id, "name": self.name,
                "arguments": self.text if finished else "", "status": status}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}


class ResponsesFormat(ChatFormat):
    """The chat output of one response, as a response object or as Responses events: each chat delta's reasoning,
    content and tool calls go to the item of their kind, opened at its first text and closed when the next opens."""

    def __init__(self, rid: str, model: str, chat: p.ChatCompletionRequest, request: ResponsesRequest,
                 parser: str, thinking: bool | None) -> None:
        super().__init__(rid, model, None, chat, parser, thinking)
        self.request = request
        self.sequence = 0
        self.items: list[_Item] = []
        self.calls: dict[int, _Item] = {}  # a chat tool-call index -> its item
        self._blank = ""  # content of only whitespace, not sent yet

    def first(self, n: int, usage: r.Usage | None) -> list[BaseModel]:
        pending = self._response("in_progress", [])
        return [self._event("response.created", response=pending),
                self._event("response.in_progress", response=pending)]

    def plain(self, choice: Choice, out: RequestOutput, usage: r.Usage | None) -> str | None:
        return None  # its events are not chat chunks

    def chunk(self, choice: Choice, out: RequestOutput, usage: r.Usage | None) -> list[BaseModel]:
        events: list[BaseModel] = []
        for chunk in super().chunk(choice, out, None):
            delta = chunk.choices[0].delta
            if delta.reasoning:
                events += self._add("reasoning", delta.reasoning)
            if delta.content:  # (blank text before a call is held: the whole answer has no message then)
                self._blank += delta.content
                if self._blank.strip():
                    events += self._add("message", self._blank)
                    self._blank = ""
            for call in delta.tool_calls or []:
                if call.index not in self.calls:
                    events += self._close()
                    self.calls[call.index] = _Item("function_call", f"fc_{self.rid}_{call.index}", "",
                                                   call.function.name, call.id)
                    events += self._open(self.calls[call.index])
                item = self.calls[call.index]
                if call.function.arguments:
                    item.text += call.function.arguments
                    events.append(self._event("response.function_call_arguments.delta", item_id=item.id,
                                              output_index=self.items.index(item), delta=call.function.arguments))
        if out.finished:
            if all(item.kind == "reasoning" for item in self.items):  # no answer is an empty message
                events += self._add("message", self._blank)
            elif self._blank and self.items[-1].kind == "message":
                events += self._add("message", self._blank)
            events += self._close()
            length = out.finish_reason == "length"
            done = self._response("incomplete" if length else "completed",
                                  [item.body("completed") for item in self.items],
                                  r.Usage.of(out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens),
                                  length)
            events.append(self._event("response.incomplete" if length else "response.completed", response=done))
        return events

    def final(self, choices: list[Choice], usage: r.Usage) -> BaseModel:
        chat = super().final(choices, usage).choices[0]
        message = chat.message
        items = [_Item("reasoning", f"rs_{self.rid}", message.reasoning)] if message.reasoning else []
        if message.content is not None or not message.tool_calls:
            items.append(_Item("message", f"msg_{self.rid}", message.content or ""))
        items += [_Item("function_call", f"fc_{self.rid}_{i}", call.function.arguments or "", call.function.name,
                        call.id) for i, call in enumerate(message.tool_calls)]
        length = choices[0].last.finish_reason == "length"
        return self._response("incomplete" if length else "completed", [i.body("completed") for i in items], usage,
                              length)

    # ---- pieces ---------------------------------------------------------------------------------------------------
    def _event(self, kind: str, **fields: Any) -> Event:
        self.sequence += 1
        return Event(type=kind, sequence_number=self.sequence - 1, **fields)

    def _add(self, kind: str, text: str) -> list[BaseModel]:
        """Text of a reasoning or message item: into the last item when it is of that kind, else a new one."""
        events: list[BaseModel] = []
        if not self.items or self.items[-1].kind != kind:
            events += self._close()
            events += self._open(_Item(kind, f"{'rs' if kind == 'reasoning' else 'msg'}_{self.rid}"))
        item = self.items[-1]
        item.text += text
        if text:
            where = {"item_id": item.id, "output_index": len(self.items) - 1, "content_index": 0}
            if kind == "reasoning":
                events.append(self._event("response.reasoning_text.delta", **where, delta=text))
            else:
                events.append(self._event("response.output_text.delta", **where, delta=text, logprobs=[]))
        return events

    def _open(self, item: _Item) -> list[BaseModel]:
        self.items.append(item)
        index = len(self.items) - 1
        events = [self._event("response.output_item.added", output_index=index, item=item.body("in_progress"))]
        if item.kind == "message":
            events.append(self._event("response.content_part.added", item_id=item.id, output_index=index,
                                      content_index=0, part=_text_part("")))
        return events

    def _close(self) -> list[BaseModel]:
        """The done events of the last item opened, unless they went out already."""
        if not self.items or self.items[-1].done:
            return []
        item, index = self.items[-1], len(self.items) - 1
        item.done = True
        where = {"item_id": item.id, "output_index": index}
        if item.kind == "reasoning":
            events = [self._event("response.reasoning_text.done", **where, content_index=0, text=item.text)]
        elif item.kind == "message":
            events = [self._event("response.output_text.done", **where, content_index=0, text=item.text,
                                  logprobs=[]),
                      self._event("response.content_part.done", **where, content_index=0, part=_text_part(item.text))]
        else:
            events = [self._event("response.function_call_arguments.done", **where, name=item.name,
                                  arguments=item.text)]
        return events + [self._event("response.output_item.done", output_index=index, item=item.body("completed"))]

    def _response(self, status: str, output: list[dict[str, Any]], usage: r.Usage | None = None,
                  length: bool = False) -> ResponseObject:
        q = self.request
        choice = q.tool_choice.model_dump() if isinstance(q.tool_choice, NamedFunction) else q.tool_choice or "auto"
        fields: dict[str, Any] = {
            "parallel_tool_calls": q.parallel_tool_calls is not False, "tool_choice": choice,
            "tools": [t.model_dump(exclude_none=True) for t in q.tools or []], "temperature": q.temperature,
            "top_p": q.top_p, "max_output_tokens": q.max_output_tokens, "instructions": q.instructions,
            "metadata": q.metadata or {}, "incomplete_details": {"reason": "max_output_tokens"} if length else None}
        if usage is not None:  # reasoning tokens are not counted apart from the output's
            fields["usage"] = {"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
                               "total_tokens": usage.total_tokens, "input_tokens_details": {
                                   "cached_tokens": usage.prompt_tokens_details.cached_tokens,
                                   "cache_write_tokens": 0},  # no explicit cache writes (the prefix cache is automatic)
                               "output_tokens_details": {"reasoning_tokens": 0}}
        return ResponseObject(id=self.rid, created_at=self.created, model=self.model, status=status, output=output,
                              **fields)
