"""Pydantic models of the OpenAI-compatible request bodies. Types are strict (a string is not a number, a bool is not
a token id, NaN is not a temperature), unknown fields are refused, and options muxd does not implement are accepted
only at the value that leaves them off, which is what OpenAI clients send by default; anything else is a 400.
"""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    create_model,
    field_validator,
    model_validator,
)

from appliance.engine.request import MAX_TOP_K, SamplingParams
from appliance.errors import RequestError


def valid_unicode(text: str) -> str:
    """JSON can carry lone UTF-16 surrogates ("\\ud800"); no tokenizer can encode them, so they are refused here."""
    if text.isascii():  # the common case, checked without copying a multi-megabyte prompt
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"contains a lone surrogate U+{ord(text[exc.start]):04X} at character {exc.start}; text must "
                         "be valid Unicode") from None
    return text


def _integral(value: Any) -> Any:
    """5.0 is the integer 5 in JSON (and in JSON Schema); "5", true and 5.5 stay refused."""
    if type(value) is float and value.is_integer():
        return int(value)
    return value


Text = Annotated[str, AfterValidator(valid_unicode)]
Finite = Annotated[float, Field(allow_inf_nan=False)]
Int = Annotated[int, BeforeValidator(_integral)]


def bounded_int(ge: int | None = None, le: int | None = None) -> Any:
    # the bounds must come before the validator, or pydantic writes them into the JSON schema as "ge"/"le"
    return Annotated[int, Field(ge=ge, le=le), BeforeValidator(_integral)]


TokenId = bounded_int(ge=0)
Count = bounded_int(ge=1)
TopK = bounded_int(ge=-1, le=MAX_TOP_K)

# Options muxd does not implement, with the values that leave them off (null is always accepted too). Clients send
# these by default (the openai SDK's optional fields, LangChain's n=1, ...), so they must not be refused.
OFF_VALUES: dict[str, tuple[Any, ...]] = {
    "n": (1,), "best_of": (1,), "echo": (False,), "suffix": ("",),
    "presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (1,), "logit_bias": ({},),
    "logprobs": (False, 0), "top_logprobs": (0,),
    "response_format": ({"type": "text"},), "tools": ([],), "tool_choice": ("none", "auto"), "functions": ([],),
    "function_call": ("none", "auto"),
}
_WHY = {"n": "muxd returns one choice per request", "best_of": "muxd returns one choice per request",
        "response_format": "structured output is not implemented", "tools": "tool calling is not implemented",
        "functions": "function calling is not implemented"}


def _same(value: Any, off: Any) -> bool:
    """Equality in which a boolean never equals a number (1 == True in Python, not in JSON)."""
    if isinstance(value, bool) or isinstance(off, bool):
        return type(value) is type(off) and value == off
    return value == off


def _off_enum(name: str) -> dict[str, Any]:
    return {"enum": [*OFF_VALUES[name], None]}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool | None = Field(None, description="Send a last chunk with the token usage of the request "
                                                         "(ignored without streaming).")
    continuous_usage_stats: bool | None = Field(None, description="Extension (vLLM): the usage so far on every "
                                                                  "chunk.")


class _SamplingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: Text | None = Field(None, description="The served model's name (GET /v1/models); may be omitted.")
    max_tokens: Count | None = None
    temperature: Annotated[Finite, Field(ge=0)] | None = Field(None, description="0 for greedy decoding; default 1.")
    top_p: Annotated[Finite, Field(gt=0, le=1)] | None = None
    top_k: TopK | None = Field(None, description="-1 or 0: no top-k cut.")
    seed: Int | None = Field(None, description="Seed of this request's sampling (same seed, same output).")
    stop: Annotated[Text, Field(min_length=1)] | list[Annotated[Text, Field(min_length=1)]] | None = None
    stop_token_ids: list[TokenId] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = Field(False, description="Extension: keep generating after the end-of-sequence token.")
    user: Text | None = Field(None, description="Accepted and ignored.")
    slo_class: Text | None = Field(None, description="Extension: the request class of the SLO contract (or the "
                                                     "X-SLO-Class header).")
    n: Int | None = Field(None, json_schema_extra=_off_enum("n"), description="Choices per request: only 1.")
    presence_penalty: Finite | None = Field(None, json_schema_extra=_off_enum("presence_penalty"),
                                            description="Not implemented: only 0.")
    frequency_penalty: Finite | None = Field(None, json_schema_extra=_off_enum("frequency_penalty"),
                                             description="Not implemented: only 0.")
    repetition_penalty: Finite | None = Field(None, json_schema_extra=_off_enum("repetition_penalty"),
                                              description="Not implemented: only 1.")
    logit_bias: dict[str, Finite] | None = Field(None, json_schema_extra=_off_enum("logit_bias"),
                                                 description="Not implemented: only {}.")

    @model_validator(mode="after")
    def _refuse_what_is_not_implemented(self) -> "_SamplingRequest":
        for name, off in OFF_VALUES.items():
            value = getattr(self, name, None)
            if value is not None and not any(_same(value, v) for v in off):
                why = _WHY.get(name, "muxd does not implement it")
                allowed = " or ".join(repr(v) for v in off)
                raise RequestError(f"{name}={value!r} is not supported ({why}); leave it out or send {allowed}", name)
        return self

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_tokens=max_tokens, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=-1 if self.top_k is None else self.top_k,
            seed=self.seed, stop=stop, stop_token_ids=list(self.stop_token_ids or []), ignore_eos=bool(self.ignore_eos))

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


def _prompt_type(token_id: Any) -> Any:
    one_text = Annotated[Text, Field(min_length=1)]
    ids = Annotated[list[token_id], Field(min_length=1)]
    return (one_text | ids | Annotated[list[one_text], Field(min_length=1, max_length=1)]
            | Annotated[list[ids], Field(min_length=1, max_length=1)])


Prompt = _prompt_type(TokenId)


def _as_token_id(x: Any) -> int | None:
    x = _integral(x)
    return x if type(x) is int and x >= 0 else None


class CompletionRequest(_SamplingRequest):
    vocab_size: ClassVar[int | None] = None  # set by bodies_for: token ids must be below it

    prompt: Prompt
    max_tokens: Count | None = 16
    echo: bool | None = Field(None, json_schema_extra=_off_enum("echo"), description="Not implemented: only false.")
    best_of: Int | None = Field(None, json_schema_extra=_off_enum("best_of"), description="Only 1.")
    suffix: str | None = Field(None, json_schema_extra=_off_enum("suffix"), description="Not implemented.")
    logprobs: Int | None = Field(None, json_schema_extra=_off_enum("logprobs"), description="Not implemented: only 0.")

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        """One clear message for every wrong shape (a union's per-branch errors would be four obscure ones)."""
        if isinstance(value, str):
            return value
        if isinstance(value, list) and value and all(isinstance(x, str) for x in value):
            return cls._one(value)
        if isinstance(value, list) and value and all(isinstance(x, list) for x in value):
            return cls._one([cls._ids(x) for x in value])
        return cls._ids(value)

    @staticmethod
    def _one(prompts: list[Any]) -> list[Any]:
        if len(prompts) != 1:
            raise ValueError(f"holds {len(prompts)} prompts; send one prompt per request")
        return prompts

    @classmethod
    def _ids(cls, value: Any) -> list[int]:
        ids = [_as_token_id(x) for x in value] if isinstance(value, list) and value else [None]
        if None in ids:
            raise ValueError("must be a non-empty string, a non-empty list of token ids (integers >= 0, not "
                             f"booleans), or a list holding one of those; got {_preview(value)}")
        if cls.vocab_size is not None and max(ids) >= cls.vocab_size:
            raise ValueError(f"token id {max(ids)} is outside the vocabulary [0, {cls.vocab_size})")
        return ids

    def single_prompt(self) -> str | list[int]:
        """The one prompt of the request, unwrapped from a batch of one."""
        p = self.prompt
        return p[0] if isinstance(p, list) and isinstance(p[0], (str, list)) else p


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    """One message. The fields OpenAI clients echo back from earlier turns are accepted and passed to the template."""

    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    tool_call_id: Text | None = None
    tool_calls: list[dict[str, Any]] | None = None
    function_call: dict[str, Any] | None = None
    refusal: Text | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        if isinstance(value, list):
            for i, part in enumerate(value):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise ValueError(f"part {i}: only text content parts are supported, got type {kind!r}")
        return value

    def for_template(self) -> dict[str, Any]:
        out = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            out["content"] = "".join(part.text for part in self.content)
        return out


class ChatCompletionRequest(_SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Count | None = None
    add_generation_prompt: bool | None = Field(True, description="Extension: end the prompt with the assistant's "
                                                                 "turn header.")
    logprobs: bool | None = Field(None, json_schema_extra=_off_enum("logprobs"), description="Only false.")
    top_logprobs: Int | None = Field(None, json_schema_extra=_off_enum("top_logprobs"), description="Only 0.")
    response_format: dict[str, Any] | None = Field(None, json_schema_extra=_off_enum("response_format"),
                                                   description='Only {"type": "text"}.')
    tools: list[dict[str, Any]] | None = Field(None, json_schema_extra=_off_enum("tools"), description="Only [].")
    tool_choice: str | dict[str, Any] | None = Field(None, json_schema_extra=_off_enum("tool_choice"),
                                                     description='Only "none" or "auto" (without tools).')
    parallel_tool_calls: bool | None = Field(None, description="Accepted (no tools are called).")
    functions: list[dict[str, Any]] | None = Field(None, json_schema_extra=_off_enum("functions"),
                                                   description="Only [].")
    function_call: str | dict[str, Any] | None = Field(None, json_schema_extra=_off_enum("function_call"),
                                                       description='Only "none" or "auto".')

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def _preview(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def bodies_for(vocab_size: int, slo_classes: list[str]) -> tuple[type[CompletionRequest], type[ChatCompletionRequest]]:
    """The request bodies of one served model, in validation and in the schema: token ids below its vocabulary,
    `slo_class` one of its SLO contract's classes."""
    # the engine checks the class (and the X-SLO-Class header) with its own message; the schema names the classes
    slo_class = (Text | None, Field(None, json_schema_extra={"enum": [*slo_classes, None]}, description=(
        "Extension: the request class of the SLO contract (or the X-SLO-Class header).")))
    completion = create_model("CompletionRequest", __base__=CompletionRequest, __doc__=CompletionRequest.__doc__,
                              prompt=(_prompt_type(bounded_int(ge=0, le=vocab_size - 1)), ...), slo_class=slo_class)
    completion.vocab_size = vocab_size
    chat = create_model("ChatCompletionRequest", __base__=ChatCompletionRequest,
                        __doc__=ChatCompletionRequest.__doc__, slo_class=slo_class)
    return completion, chat
