"""Pydantic models of the OpenAI-compatible request bodies, with vLLM's extensions where OpenAI has none (top_k,
min_p, repetition_penalty, min_tokens, ignore_eos, ...). Types are strict (a string is not a number, a bool is not a
token id, NaN is not a temperature), unknown fields are refused, and the few options muxd does not implement are
accepted only at the value that leaves them off (what clients send by default); anything else is a 400.
"""
from __future__ import annotations

import json
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

from appliance.engine.grammar import GrammarSpec
from appliance.engine.request import (
    MAX_BAD_WORD_CHARS,
    MAX_BAD_WORDS,
    MAX_BIAS,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_PENALTY,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_K,
    SamplingParams,
)
from appliance.errors import RequestError
from appliance.server.structured import (CONFLICT, GuidedChoice, GuidedJson, ResponseFormat, StructuredOutputs,
                                         guided_grammar)
from appliance.server.tools import ToolChoice, ToolsRequest


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
StopText = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS), AfterValidator(valid_unicode)]
BadWord = Annotated[str, Field(min_length=1, max_length=MAX_BAD_WORD_CHARS, pattern=r"\S"),
                    AfterValidator(valid_unicode)]
Count = bounded_int(ge=1)
TopK = bounded_int(ge=-1, le=MAX_TOP_K)
Seed = bounded_int(ge=-2**63, le=2**63 - 1)  # int64, as vLLM: wider seeds would alias (the key is 64 bits)
MAX_N = 64  # choices per request
MAX_PROMPTS = 256  # prompts in one completions request
MAX_SEQUENCES = 1024  # prompts x choices generated for one request
Penalty = Annotated[Finite, Field(ge=-MAX_PENALTY, le=MAX_PENALTY)]
TopLogprobs = bounded_int(ge=0, le=MAX_LOGPROBS)
TemplateKwargs = dict[str, Any]
# OpenAI's values (and vLLM's): the chat template's variable reasoning_effort, as sent
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]
TEMPLATE_KWARGS_DOC = ('Extension (vLLM): more variables for the chat template, e.g. {"enable_thinking": false} '
                       "for Qwen3; they may not replace messages, tools, add_generation_prompt, bos_token, eos_token.")

# Options muxd does not implement, with the values that leave them off (null is always accepted too). Clients send
# these by default, so they must not be refused.
OFF_VALUES: dict[str, tuple[Any, ...]] = {"suffix": ("",), "functions": ([],), "function_call": ("none", "auto"),
                                           "priority": (0,), "kv_transfer_params": (), "logits_processors": ([],),
                                           "vllm_xargs": ({},), "guided_decoding_backend": ("xgrammar", "auto"),
                                           "guided_whitespace_pattern": ()}
_WHY = {"suffix": "fill-in-the-middle is not implemented",
        "functions": "the deprecated functions API is not implemented; send tools",
        "function_call": "the deprecated functions API is not implemented; send tool_choice",
        "priority": "muxd schedules first come, first served within each SLO class, as vLLM's default policy; "
                    "slo_class sets the class",
        "kv_transfer_params": "disaggregated prefill and decode (KV transfer) is not implemented",
        "logits_processors": "custom logits processors are not implemented",
        "vllm_xargs": "they are arguments of custom logits processors, which are not implemented",
        "guided_decoding_backend": "structured outputs run on xgrammar",
        "guided_whitespace_pattern": "JSON outputs take xgrammar's whitespace"}


def _same(value: Any, off: Any) -> bool:
    """Equality in which a boolean never equals a number (1 == True in Python, not in JSON)."""
    if isinstance(value, bool) or isinstance(off, bool):
        return type(value) is type(off) and value == off
    return value == off


def _off_enum(name: str) -> dict[str, Any]:
    off = OFF_VALUES[name]
    return {"enum": [*off, None]} if off else {"type": "null"}


def refuse_unimplemented(request: BaseModel, off_values: dict[str, tuple[Any, ...]]) -> None:
    """A 400 naming the first field of `off_values` sent at a value that would turn its option on."""
    for name, off in off_values.items():
        value = getattr(request, name, None)
        if value is not None and not any(_same(value, v) for v in off):
            why = _WHY.get(name, "muxd does not implement it")
            allowed = " or send " + " or ".join(repr(v) for v in off) if off else ""
            raise RequestError(f"{name}={_preview(value)} is not supported ({why}); leave it out{allowed}", name)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool | None = Field(None, description="Send a last chunk with the token usage of the request; "
                                                         "unset: true, as vLLM.")
    continuous_usage_stats: bool | None = Field(None, description="Extension (vLLM): the usage so far on every "
                                                                  "chunk (with include_usage).")


class _SamplingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: Text | None = Field(None, description="The served model's name (GET /v1/models); may be omitted.")
    max_tokens: Count | None = None
    temperature: Annotated[Finite, Field(ge=0)] | None = Field(None, description="0 for greedy decoding; default 1.")
    top_p: Annotated[Finite, Field(gt=0, le=1)] | None = None
    top_k: TopK | None = Field(None, description="-1 or 0: no top-k cut.")
    seed: Seed | None = Field(None, description="Seed of this request's sampling (same seed, same output).")
    stop: StopText | Annotated[list[StopText], Field(max_length=MAX_STOP_STRINGS)] | None = Field(
        None, description=f"Up to {MAX_STOP_STRINGS} strings of up to {MAX_STOP_CHARS} characters.")
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = Field(False, description="Extension: keep generating after the end-of-sequence token.")
    user: Text | None = Field(None, description="Accepted and ignored.")
    slo_class: Text | None = Field(None, description="Extension: the request class of the SLO contract (or the "
                                                     "X-SLO-Class header).")
    n: bounded_int(ge=1, le=MAX_N) | None = Field(None, description="Choices to generate (each with its own seed "
                                                                     "stream; the prompt is prefilled once).")
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[Finite, Field(gt=0)] | None = Field(None, description="Extension: > 1 discourages "
                                                                                        "prompt and output tokens.")
    logit_bias: Annotated[dict[str, Annotated[Finite, Field(ge=-MAX_BIAS, le=MAX_BIAS)]],
                          Field(max_length=MAX_LOGIT_BIAS)] | None = Field(
        None, description=f"Token id (as a string) -> bias added to its logit, in [-100, 100]; at most "
                          f"{MAX_LOGIT_BIAS} entries.",
        json_schema_extra={"propertyNames": {"pattern": r"^(0|[1-9][0-9]*)$"}})
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = Field(
        None, description="Extension (vLLM): sample only among these token ids.")
    cache_salt: Annotated[Text, Field(min_length=1, max_length=1024)] | None = Field(
        None, description="Extension (vLLM): the prefix cache shares this request's pages only with requests of the "
                          "same salt (other tenants can neither reuse nor time them).")
    min_p: Annotated[Finite, Field(ge=0, le=1)] | None = Field(None, description="Extension: drop tokens less likely "
                                                                                 "than min_p times the likeliest.")
    min_tokens: bounded_int(ge=0) | None = Field(None, description="Extension: no end-of-sequence or stop token "
                                                                   "before this many tokens.")
    include_stop_str_in_output: bool | None = Field(False, description="Extension (vLLM): keep the stop string "
                                                                       "that ended the output at its end.")
    skip_special_tokens: bool | None = Field(True, description="Extension (vLLM): leave special tokens out of the "
                                                               "text.")
    guided_json: GuidedJson | None = Field(None, description="Extension (vLLM): the output is JSON following this "
                                                             "schema.")
    guided_regex: str | None = Field(None, description="Extension (vLLM): the output matches this regular "
                                                       "expression.")
    guided_choice: GuidedChoice | None = Field(None, description="Extension (vLLM): the output is one of these "
                                                                 "strings.")
    guided_grammar: str | None = Field(None, description="Extension (vLLM): the output follows this grammar (EBNF "
                                                          "as xgrammar reads it, e.g. 'root ::= \"yes\" | \"no\"').")
    structured_outputs: StructuredOutputs | None = Field(None, description="Extension (vLLM): one of json, regex, "
                                                                           "choice, grammar, structural_tag, as "
                                                                           "the guided_ fields.")
    response_format: ResponseFormat | None = Field(None, description="text, json_object, json_schema (strict: "
                                                                     "the output follows the schema), or vLLM's "
                                                                     "structural_tag.")
    truncate_prompt_tokens: Literal[-1] | Count | None = Field(
        None, description="Extension (vLLM): keep only the prompt's last k tokens (after the chat template); -1: as "
                          "many as the context leaves room for beside max_tokens.")
    truncation_side: Literal["left", "right"] | None = Field(
        None, description="Extension (vLLM): where truncate_prompt_tokens cuts: left (the default) keeps the last "
                          "tokens, right the first.")
    prompt_logprobs: TopLogprobs | None = Field(None, description="Extension (vLLM): each prompt token's "
                                                                  "log-probability, its rank and this many "
                                                                  "alternatives (not with stream, except 0).")
    return_tokens_as_token_ids: bool | None = Field(
        None, description="Extension (vLLM): tokens in log-probabilities written as 'token_id:<id>'.")
    priority: Int | None = Field(0, json_schema_extra=_off_enum("priority"),
                                 description="Extension (vLLM): only 0 (first come, first served).")
    return_token_ids: bool | None = Field(None, description="Extension (vLLM): the output's token ids beside its "
                                                            "text, and the prompt's (streaming: new ids on each "
                                                            "chunk, the prompt's on the first).")
    request_id: Annotated[Text, Field(min_length=1, max_length=256)] | None = Field(
        None, description="Extension (vLLM): the response's id is made from it (an X-Request-Id header wins).")
    use_beam_search: bool | None = Field(False, description="Extension (vLLM): the n best beams of a beam search "
                                                            "(beam width n, at most 10) instead of sampled choices; "
                                                            "beams end at the end of sequence or max_tokens.")
    length_penalty: Finite | None = Field(1.0, description="Extension (vLLM, for beam search): beams are ranked by "
                                                           "log-probability / length ** length_penalty.")
    kv_transfer_params: dict[str, Any] | None = Field(None, json_schema_extra=_off_enum("kv_transfer_params"),
                                                      description="Extension (vLLM): only null.")
    logits_processors: list[Any] | None = Field(None, json_schema_extra=_off_enum("logits_processors"),
                                                description="Extension (vLLM): only null or [].")
    vllm_xargs: dict[str, Any] | None = Field(None, json_schema_extra=_off_enum("vllm_xargs"),
                                              description="Extension (vLLM): only null or {}.")
    structural_tag: str | None = Field(None, description="Extension (vLLM): a structural tag as JSON text, as "
                                                         "response_format's structural_tag (format, or structures "
                                                         "and triggers).")
    guided_decoding_backend: str | None = Field(None, json_schema_extra=_off_enum("guided_decoding_backend"),
                                                description="Extension (vLLM): only xgrammar or auto (what muxd "
                                                            "uses).")
    guided_whitespace_pattern: str | None = Field(None, json_schema_extra=_off_enum("guided_whitespace_pattern"),
                                                  description="Extension (vLLM): only null.")
    bad_words: Annotated[list[BadWord], Field(max_length=MAX_BAD_WORDS)] | None = Field(
        None, description=f"Extension (vLLM): up to {MAX_BAD_WORDS} words of up to {MAX_BAD_WORD_CHARS} characters "
                          "that the output never contains: a word's last token is masked wherever the output ends "
                          "with the rest of it (the word spelled without its leading whitespace, and after a space).")
    spaces_between_special_tokens: bool | None = Field(
        True, description="Extension (vLLM): accepted either way; vLLM reads it for slow tokenizers only, and "
                          "muxd's is a fast one.")

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_count(cls, value: Any) -> Any:
        """The count first, in words (a union would answer a long list with 'should be a valid string')."""
        if isinstance(value, list) and len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"holds {len(value)} strings; at most {MAX_STOP_STRINGS} are allowed")
        return value

    @field_validator("bad_words", mode="before")
    @classmethod
    def _bad_words_have_text(cls, value: Any) -> Any:
        """A word of only whitespace bans nothing (its leading whitespace is dropped, as vLLM does): said in words."""
        for i, word in enumerate(value if isinstance(value, list) else []):
            if isinstance(word, str) and not word.strip():
                raise ValueError(f"word {i} is {'empty' if not word else 'only whitespace'}; each bad word needs "
                                 "text to ban")
        return value

    @field_validator("truncate_prompt_tokens", mode="before")
    @classmethod
    def _truncation(cls, value: Any) -> Any:
        """One message for every wrong value (the union would answer 0 with 'should be -1')."""
        value = _integral(value)
        if value is not None and (type(value) is not int or value < 1 and value != -1):
            raise ValueError("must be an integer >= 1 (keep the prompt's last k tokens) or -1 (as many as the context "
                             "allows)")
        return value

    @model_validator(mode="after")
    def _refuse_what_is_not_implemented(self) -> "_SamplingRequest":
        refuse_unimplemented(self, OFF_VALUES)
        if self.stream and self.prompt_logprobs:  # as vLLM: no stream chunk carries them
            raise RequestError("prompt_logprobs are not returned when streaming; send stream: false, or "
                               "prompt_logprobs 0 or null", "prompt_logprobs", CONFLICT)
        if self.stream_options is not None and not self.stream:  # as OpenAI and vLLM
            raise RequestError("stream_options apply only when streaming; send stream: true, or leave them out",
                               "stream_options", CONFLICT)
        return self

    def sampling_params(self, max_tokens: int, choice: int = 0,
                        defaults: dict[str, float | int] | None = None) -> SamplingParams:
        """The engine's parameters for one choice (choice i of a seeded request samples with seed + i, as vLLM);
        `defaults` (request field -> value: the model's recommended sampling) stand in for the fields left unset."""
        if (self.min_tokens or 0) > max_tokens:  # as vLLM
            most = (f"max_tokens={max_tokens}" if self.requested_max_tokens() is not None
                    else f"the {max_tokens} tokens a request without max_tokens may generate here")
            raise RequestError(f"min_tokens={self.min_tokens} is more than {most}", "min_tokens", CONFLICT)

        def unset_or(name: str, neutral: float) -> Any:
            value = getattr(self, name)
            return (defaults or {}).get(name, neutral) if value is None else value

        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_tokens=max_tokens, temperature=unset_or("temperature", 1.0), top_p=unset_or("top_p", 1.0),
            top_k=unset_or("top_k", -1), min_p=unset_or("min_p", 0.0),
            repetition_penalty=unset_or("repetition_penalty", 1.0),
            seed=None if self.seed is None else self.seed + choice, stop=stop,
            stop_token_ids=list(self.stop_token_ids or []), ignore_eos=bool(self.ignore_eos),
            include_stop_str=bool(self.include_stop_str_in_output), skip_special_tokens=self.skip_special_tokens
            is not False, min_tokens=self.min_tokens or 0,
            presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
            logit_bias=self._bias(), logprobs=self.token_logprobs(), prompt_logprobs=self.engine_prompt_logprobs(),
            allowed_token_ids=list(self.allowed_token_ids) if self.allowed_token_ids is not None else None,
            bad_words=list(self.bad_words or []), cache_salt=self.cache_salt,
            grammar=self.grammar())

    @property
    def num_choices(self) -> int:
        return self.n or 1

    @property
    def num_generated(self) -> int:
        return self.num_choices

    def _bias(self) -> dict[int, float]:
        out = {}
        for key, value in (self.logit_bias or {}).items():
            token = _as_token_id(int(key)) if key.strip().lstrip("-").isdigit() else None
            if token is None:
                raise RequestError(f"logit_bias keys are token ids (integers >= 0 written as strings), got {key!r}",
                                   "logit_bias")
            out[token] = value
        return out

    def token_logprobs(self) -> int | None:
        return None

    @property
    def returns_prompt_logprobs(self) -> bool:
        """The response carries `prompt_logprobs` (never a stream, as vLLM)."""
        return self.prompt_logprobs is not None and not self.stream

    def engine_prompt_logprobs(self) -> int | None:
        """Alternatives per prompt token the engine computes (None: no prompt log-probabilities)."""
        return self.prompt_logprobs if self.returns_prompt_logprobs else None

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def grammar(self) -> GrammarSpec | None:
        guided = guided_grammar(self.guided_json, self.guided_regex, self.guided_choice, self.structured_outputs,
                                self.guided_grammar, self.structural_tag)
        spec = self.response_format.grammar() if self.response_format is not None else None
        if guided is not None and spec is not None:
            raise RequestError(f"{guided.param} and response_format both constrain the output; send one",
                               guided.param, CONFLICT)
        return guided or spec

    @property
    def include_usage(self) -> bool:
        """As vLLM: stream_options that leave include_usage out ask for the usage (vLLM's default there is true)."""
        return self.stream_options is not None and self.stream_options.include_usage is not False

    @property
    def continuous_usage(self) -> bool:
        """As vLLM: the usage on every chunk only along with the last chunk's (include_usage)."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)


def _prompt_type(token_id: Any) -> Any:
    one_text = Annotated[Text, Field(min_length=1)]
    ids = Annotated[list[token_id], Field(min_length=1)]
    return (one_text | ids | Annotated[list[one_text], Field(min_length=1, max_length=MAX_PROMPTS)]
            | Annotated[list[ids], Field(min_length=1, max_length=MAX_PROMPTS)])


Prompt = _prompt_type(TokenId)


def _as_token_id(x: Any) -> int | None:
    x = _integral(x)
    return x if type(x) is int and x >= 0 else None


class CompletionRequest(_SamplingRequest):
    vocab_size: ClassVar[int | None] = None  # set by bodies_for: token ids must be below it

    prompt: Prompt
    max_tokens: bounded_int(ge=0) | None = Field(16, description="0 only with echo: the prompt scored, nothing "
                                                                 "generated (as vLLM).")
    echo: bool | None = Field(None, description="Return the prompt before the completion (with logprobs: the "
                                                "prompt tokens' log-probabilities too).")
    best_of: bounded_int(ge=1, le=MAX_N) | None = Field(None, description="Generate this many choices and return "
                                                                          "the n with the highest log-probability "
                                                                          "(streamed once all are done).")
    suffix: str | None = Field(None, json_schema_extra=_off_enum("suffix"), description="Not implemented.")
    add_special_tokens: bool | None = Field(True, description="Extension (vLLM): add the tokenizer's special tokens "
                                                              "(e.g. BOS) to a text prompt.")
    logprobs: TopLogprobs | None = Field(None, description="Log-probability of each sampled token and this many "
                                                            "alternatives (at most 20).")

    @property
    def echo_only(self) -> bool:
        """Echo without generation (max_tokens 0): each choice is the prompt alone, its text, tokens and
        log-probabilities."""
        return bool(self.echo) and self.max_tokens == 0

    def sampling_params(self, max_tokens: int, choice: int = 0,
                        defaults: dict[str, float | int] | None = None) -> SamplingParams:
        """Echo without generation samples one token, as vLLM does, which the response leaves out."""
        if not self.echo_only:
            return super().sampling_params(max_tokens, choice, defaults)
        if self.min_tokens:
            raise RequestError(f"min_tokens={self.min_tokens} is more than max_tokens=0", "min_tokens", CONFLICT)
        return super().sampling_params(1, choice, defaults)

    @property
    def num_generated(self) -> int:
        """Choices generated: best_of when it exceeds n (the n likeliest are returned)."""
        return max(self.best_of or 1, self.num_choices)

    def token_logprobs(self) -> int | None:
        if self.logprobs is None and self.num_generated > self.num_choices:
            return 0  # ranking needs each token's log-probability
        return self.logprobs

    def engine_prompt_logprobs(self) -> int | None:
        """Echo with logprobs shows the prompt tokens' too: the more alternatives of the two."""
        wanted = [k for k in (super().engine_prompt_logprobs(), self.logprobs if self.echo else None) if k is not None]
        return max(wanted, default=None)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        """One clear message for every wrong shape (a union's per-branch errors would be four obscure ones)."""
        if isinstance(value, str):
            return value
        if isinstance(value, list) and value and all(isinstance(x, str) for x in value):
            return [cls._text(i, x) for i, x in enumerate(cls._batch(value))]
        if isinstance(value, list) and value and all(isinstance(x, list) for x in value):
            return [cls._ids(x) for x in cls._batch(value)]
        return cls._ids(value)

    @staticmethod
    def _batch(prompts: list[Any]) -> list[Any]:
        if len(prompts) > MAX_PROMPTS:
            raise ValueError(f"holds {len(prompts)} prompts; at most {MAX_PROMPTS} a request")
        return prompts

    @staticmethod
    def _text(index: int, text: str) -> str:
        """One prompt of a batch of strings, named by its index (the union's own errors would call it an integer)."""
        if not text:
            raise ValueError(f"prompt {index} of the batch is empty; each prompt must be a non-empty string")
        try:
            return valid_unicode(text)
        except ValueError as exc:
            raise ValueError(f"prompt {index} of the batch {exc}") from None

    @classmethod
    def _ids(cls, value: Any) -> list[int]:
        ids = [_as_token_id(x) for x in value] if isinstance(value, list) and value else [None]
        if None in ids:
            raise ValueError("must be a non-empty string, a non-empty list of token ids (integers >= 0, not "
                             f"booleans), or a list of those; got {_preview(value)}")
        if cls.vocab_size is not None and max(ids) >= cls.vocab_size:
            raise ValueError(f"token id {max(ids)} is outside the vocabulary [0, {cls.vocab_size})")
        return ids

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one, or a batch (a list of strings or of token-id lists)."""
        p = self.prompt
        return list(p) if isinstance(p, list) and isinstance(p[0], (str, list)) else [p]

    @model_validator(mode="after")
    def _max_tokens_zero_only_with_echo(self) -> "CompletionRequest":
        if self.max_tokens == 0 and not self.echo:  # as vLLM
            raise RequestError("max_tokens must be >= 1; 0 is taken only with echo: true (the prompt returned, "
                               "nothing generated)", "max_tokens", CONFLICT)
        return self

    @model_validator(mode="after")
    def _best_of_at_least_n(self) -> "CompletionRequest":
        if self.best_of is not None and self.best_of < self.num_choices:  # as vLLM
            raise RequestError(f"best_of={self.best_of} is less than n={self.num_choices}; best_of choices are "
                               "generated and the n likeliest returned", "best_of", CONFLICT)
        return self

    @model_validator(mode="after")
    def _bounded_batch(self) -> "CompletionRequest":
        prompts, each = len(self.prompts()), self.num_generated
        if prompts * each > MAX_SEQUENCES:
            raise RequestError(f"{prompts} prompts x {each} choices make {prompts * each} sequences; at most "
                               f"{MAX_SEQUENCES} a request", "prompt", CONFLICT)
        return self


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
    reasoning: Text | None = None  # an earlier answer's, as --reasoning-parser returned it
    reasoning_content: Text | None = None  # the same by its older name, which templates read (Qwen3's)

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
        if self.reasoning is not None:
            out.setdefault("reasoning_content", self.reasoning)
        if isinstance(self.content, list):
            out["content"] = "".join(part.text for part in self.content)
        for call in out.get("tool_calls") or []:  # templates write the arguments as JSON themselves (as vLLM)
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                try:
                    function["arguments"] = json.loads(function["arguments"])
                except json.JSONDecodeError:
                    pass  # the template gets the text as it came
        return out


def check_continue_final(continue_final: bool | None, add_generation_prompt: bool | None,
                         messages: list[ChatMessage]) -> None:
    """continue_final_message needs add_generation_prompt false and a final message with text (as vLLM)."""
    if continue_final and add_generation_prompt is not False:
        raise RequestError("continue_final_message needs add_generation_prompt: false (the model continues the "
                           "final message instead of starting a turn)", "continue_final_message", CONFLICT)
    if continue_final and not messages[-1].for_template().get("content"):
        raise RequestError("continue_final_message: the final message has no text to continue",
                           "continue_final_message", CONFLICT)


class ChatCompletionRequest(_SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Count | None = None
    add_generation_prompt: bool | None = Field(True, description="Extension: end the prompt with the assistant's "
                                                                 "turn header.")
    continue_final_message: bool | None = Field(False, description="Extension: leave the final message open (no "
                                                                   "end of turn after it) for the model to continue "
                                                                   "it; needs add_generation_prompt false.")
    logprobs: bool | None = Field(None, description="Log-probability of each output token.")
    top_logprobs: TopLogprobs | None = Field(None, description="Alternatives per token (needs logprobs).")
    tools: ToolsRequest | None = None
    tool_choice: ToolChoice | None = Field(None, description='"none", "auto" (the default with tools), '
                                                             '"required", or {"type": "function", "function": '
                                                             '{"name": ...}}.')
    parallel_tool_calls: bool | None = Field(None, description="Accepted; the model may call several tools.")
    chat_template_kwargs: TemplateKwargs | None = Field(None, description=TEMPLATE_KWARGS_DOC)
    include_reasoning: bool | None = Field(True, description="Extension (vLLM): false leaves the reasoning out "
                                                             "(with --reasoning-parser).")
    reasoning_effort: ReasoningEffort | None = Field(
        None, description="The chat template's variable reasoning_effort (templates that do not read it ignore it).")
    store: bool | None = Field(None, description="Accepted and ignored (nothing is stored).")
    metadata: Annotated[dict[str, Text], Field(max_length=16)] | None = Field(None, description="Accepted and "
                                                                                                "ignored.")
    service_tier: Text | None = Field(None, description="Accepted and ignored.")
    prompt_cache_key: Text | None = Field(None, description="Accepted and ignored (the prefix cache needs no key).")
    safety_identifier: Text | None = Field(None, description="Accepted and ignored.")
    functions: list[dict[str, Any]] | None = Field(None, json_schema_extra=_off_enum("functions"),
                                                   description="Only [].")
    function_call: str | dict[str, Any] | None = Field(None, json_schema_extra=_off_enum("function_call"),
                                                       description='Only "none" or "auto".')
    add_special_tokens: bool | None = Field(False, description="Extension (vLLM): add the tokenizer's special tokens "
                                                               "(e.g. BOS) on top of those the chat template writes.")
    documents: list[dict[str, Text]] | None = Field(None, description="Extension (vLLM): documents for the chat "
                                                                      "template (RAG templates read them; others "
                                                                      "ignore them).")
    thinking_token_budget: bounded_int(ge=0) | None = Field(
        None, description="Extension (vLLM): at most this many tokens inside the answer's think block; then its end "
                          "(</think>) is written and the answer goes on (needs --reasoning-parser).")
    echo: bool | None = Field(False, description="Extension (vLLM): the last message's content, where it is the "
                                                 "assistant's, opens the answer (with continue_final_message: the "
                                                 "message and its continuation as one).")
    chat_template: Text | None = Field(None, description="Extension (vLLM): a chat template (Jinja) for this request "
                                                         "instead of the server's; taken only by a server started "
                                                         "with --trust-request-chat-template (else HTTP 400).")

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def echoed(self) -> str:
        """What echo puts before the answer (vLLM's): the last message's content where it is the assistant's."""
        if not self.echo or not self.messages or self.messages[-1].role != "assistant":
            return ""
        return self.messages[-1].for_template().get("content") or ""

    @model_validator(mode="after")
    def _consistent(self) -> "ChatCompletionRequest":
        check_continue_final(self.continue_final_message, self.add_generation_prompt, self.messages)
        if self.top_logprobs and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs: true", "top_logprobs", CONFLICT)
        if self.tool_choice is not None and self.tool_choice.constrains and not self.tools:
            raise RequestError(f"tool_choice {self.tool_choice.describe()} needs tools", "tool_choice", CONFLICT)
        if self.tools and self.tool_choice is not None and self.tool_choice.name is not None:
            names = [t.function.name for t in self.tools]
            if self.tool_choice.name not in names:
                raise RequestError(f"tool_choice names {self.tool_choice.name!r}, which is not among the tools "
                                   f"({', '.join(names)})", "tool_choice", CONFLICT)
        if self.response_format is not None and self.response_format.type != "text" and self.tool_choice is not None \
                and self.tool_choice.constrains:
            raise RequestError("response_format and a tool_choice that forces a tool call both constrain the "
                               "output; send one", "response_format", CONFLICT)
        return self

    def token_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_variables(self) -> dict[str, Any]:
        """The request's own chat template variables: chat_template_kwargs, and reasoning_effort and documents
        where sent."""
        variables = dict(self.chat_template_kwargs or {})
        variables.pop("chat_template", None)  # (a template, not a variable: `own_template`)
        for name in ("reasoning_effort", "documents"):
            value = getattr(self, name)
            if value is not None and variables.setdefault(name, value) != value:
                raise RequestError(f"{name} and chat_template_kwargs.{name} differ; send one", name, CONFLICT)
        return variables

    def own_template(self) -> str | None:
        """The request's own chat template: chat_template, or vLLM's chat_template_kwargs.chat_template."""
        return own_template(self.chat_template, self.chat_template_kwargs)

    def grammar(self) -> GrammarSpec | None:
        spec = super().grammar()
        if not (self.tools and self.tool_choice is not None and self.tool_choice.constrains):
            return spec
        if spec is not None:  # (response_format with a forcing tool_choice is refused by the validator)
            raise RequestError(f"{spec.param} and tool_choice both constrain the output; send one", spec.param,
                               CONFLICT)
        return self.tool_choice.grammar(self.tools, self.parallel_tool_calls is not False)

    @property
    def active_tools(self) -> ToolsRequest | None:
        """The tools the output may call (none with tool_choice "none")."""
        if not self.tools or (self.tool_choice is not None and self.tool_choice.mode == "none"):
            return None
        return self.tools

    def template_tools(self, exclude_when_none: bool = False) -> ToolsRequest | None:
        """The tools the chat template sees: every tool given, as OpenAI and vLLM render them, even with tool_choice
        "none" unless `exclude_when_none` (--exclude-tools-when-tool-choice-none)."""
        return self.active_tools if exclude_when_none else (self.tools or None)


def own_template(chat_template: str | None, kwargs: dict[str, Any] | None) -> str | None:
    """A request's own chat template: its chat_template, or vLLM's chat_template_kwargs.chat_template."""
    other = (kwargs or {}).get("chat_template")
    if other is not None and not isinstance(other, str):
        raise RequestError("chat_template_kwargs.chat_template must be a string (a Jinja template)",
                           "chat_template_kwargs")
    if other is not None and chat_template is not None and other != chat_template:
        raise RequestError("chat_template and chat_template_kwargs.chat_template differ; send one", "chat_template",
                           CONFLICT)
    return chat_template if chat_template is not None else other


def below_pattern(n: int) -> str:
    """A regular expression matching the decimal integers 0 .. n-1 (no leading zeros): token ids of a vocabulary."""
    top = str(n - 1)
    alts = ["0"] if n - 1 >= 0 else []
    if len(top) > 1:
        alts.append(f"[1-9][0-9]{{0,{len(top) - 2}}}")  # fewer digits than the largest id
    for i, digit in enumerate(top):  # as many digits: equal up to i, smaller at i, anything after
        low = 1 if i == 0 else 0
        if int(digit) > low:
            rest = f"[0-9]{{{len(top) - i - 1}}}" if i < len(top) - 1 else ""
            alts.append(f"{top[:i]}[{low}-{int(digit) - 1}]{rest}")
    alts.append(top)
    return "^(" + "|".join(dict.fromkeys(alts)) + ")$"


def _preview(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def bodies_for(vocab_size: int, slo_classes: list[str],
               reasoning: bool = False) -> tuple[type[CompletionRequest], type[ChatCompletionRequest]]:
    """The request bodies of one served model, in validation and in the schema: token ids below its vocabulary,
    `slo_class` one of its SLO contract's classes, and (the schema) thinking_token_budget only null on a server
    without a reasoning parser, which refuses it."""
    # the engine checks the class (and the X-SLO-Class header) with its own message; the schema names the classes
    slo_class = (Text | None, Field(None, json_schema_extra={"enum": [*slo_classes, None]}, description=(
        "Extension: the request class of the SLO contract (or the X-SLO-Class header).")))
    bias_field = _SamplingRequest.model_fields["logit_bias"]
    logit_bias = (bias_field.annotation, Field(None, description=bias_field.description, json_schema_extra={
        "propertyNames": {"pattern": below_pattern(vocab_size)}}))
    allowed_field = _SamplingRequest.model_fields["allowed_token_ids"]
    allowed = (Annotated[list[bounded_int(ge=0, le=vocab_size - 1)], Field(min_length=1)] | None,
               Field(None, description=allowed_field.description))
    completion = create_model("CompletionRequest", __base__=CompletionRequest, __doc__=CompletionRequest.__doc__,
                              prompt=(_prompt_type(bounded_int(ge=0, le=vocab_size - 1)), ...), slo_class=slo_class,
                              logit_bias=logit_bias, allowed_token_ids=allowed)
    completion.vocab_size = vocab_size
    budget_field = ChatCompletionRequest.model_fields["thinking_token_budget"]
    budget = (budget_field.annotation, Field(None, description=budget_field.description,
                                             json_schema_extra=None if reasoning else {"type": "null"}))
    chat = create_model("ChatCompletionRequest", __base__=ChatCompletionRequest,
                        __doc__=ChatCompletionRequest.__doc__, slo_class=slo_class, logit_bias=logit_bias,
                        allowed_token_ids=allowed, thinking_token_budget=budget)
    return completion, chat

