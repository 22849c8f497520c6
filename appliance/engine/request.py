"""A request's sampling parameters, lifecycle state and what the engine reports about it after each step."""
from __future__ import annotations

import enum
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from appliance.engine.kv_cache import PageTable
from appliance.errors import RequestError

GREEDY_BELOW = 1e-5
MAX_TOP_K = 2**31 - 1  # any k >= the vocabulary cuts nothing; the bound keeps k a valid tensor index
MAX_LOGPROBS = 20  # alternatives per token at most, as OpenAI allows
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2] (OpenAI)
MAX_BIAS = 100.0  # logit_bias values lie in [-100, 100] (OpenAI)
# Every generated token is checked against each stop string and stop token: caps keep one request from costing the
# engine (and every other request in its batch) time per token in proportion to a list it may make as long as its body
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # entries of a logit_bias map
MAX_BAD_WORDS = 128  # each one's prefixes are looked up after every token
MAX_BAD_WORD_CHARS = 128


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _preview(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no top-k cut
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    include_stop_str: bool = False  # a matched stop string stays at the end of the output
    skip_special_tokens: bool = True  # special tokens are left out of the output text
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one
    min_tokens: int = 0  # end-of-sequence and stop_token_ids are masked until this many tokens are out
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # divides positive logits (multiplies negative) of prompt and output tokens
    logit_bias: dict[int, float] = field(default_factory=dict)
    allowed_token_ids: list[int] | None = None  # sample only among these (vLLM's); None: the whole vocabulary
    bad_words: list[str] = field(default_factory=list)  # words the output never contains (vLLM's)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)  # as tokens (admission spells bad_words)
    cache_salt: str | None = None  # the prefix cache shares this request's pages only with requests of the same salt
    logprobs: int | None = None  # the sampled token's log-probability and this many alternatives (0: none)
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    grammar: object | None = None  # a GrammarSpec (engine/grammar.py): constrains the output to it
    thinking: ThinkingLimit | None = None  # a cap on the tokens of the output's think block (vLLM's budget)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.bad_words = list(self.bad_words or [])
        self.bad_words_token_ids = list(self.bad_words_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1

    def validate(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}", "max_tokens")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise RequestError(f"temperature must be a finite number >= 0, got {self.temperature!r}", "temperature")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be a number in (0, 1], got {self.top_p!r}", "top_p")
        if not _is_int(self.top_k) or not -1 <= self.top_k <= MAX_TOP_K:
            raise RequestError(f"top_k must be -1 (off) or an integer in [1, {MAX_TOP_K}], got {self.top_k!r}",
                               "top_k")
        if self.seed is not None and not _is_int(self.seed):
            raise RequestError(f"seed must be an integer, got {self.seed!r}", "seed")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise RequestError(f"stop holds {len(self.stop)} strings; at most {MAX_STOP_STRINGS} are allowed", "stop")
        if any(not isinstance(s, str) or not s or len(s) > MAX_STOP_CHARS for s in self.stop):
            raise RequestError(f"stop must be non-empty strings of at most {MAX_STOP_CHARS} characters, got "
                               f"{_preview(self.stop)}", "stop")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise RequestError(f"stop_token_ids holds {len(self.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS} "
                               "are allowed", "stop_token_ids")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise RequestError(f"stop_token_ids must be integers >= 0, got {_preview(self.stop_token_ids)}",
                               "stop_token_ids")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise RequestError(f"min_p must be a number in [0, 1], got {self.min_p!r}", "min_p")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise RequestError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got "
                               f"{self.min_tokens!r}", "min_tokens")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or abs(value) > MAX_PENALTY:
                raise RequestError(f"{name} must be a number in [-2, 2], got {value!r}", name)
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise RequestError(f"repetition_penalty must be a number > 0, got {self.repetition_penalty!r}",
                               "repetition_penalty")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise RequestError(f"logit_bias holds {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS} are allowed",
                               "logit_bias")
        for token, bias in self.logit_bias.items():
            if not _is_int(token) or token < 0 or not _is_number(bias) or abs(bias) > MAX_BIAS:
                raise RequestError(f"logit_bias maps token ids (integers >= 0) to numbers in [-100, 100]; got "
                                   f"{token!r}: {bias!r}", "logit_bias")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise RequestError(f"cache_salt must be a non-empty string, got {self.cache_salt!r}", "cache_salt")
        if self.allowed_token_ids is not None and (not self.allowed_token_ids or any(
                not _is_int(t) or t < 0 for t in self.allowed_token_ids)):
            raise RequestError(f"allowed_token_ids must be a non-empty list of token ids (integers >= 0), got "
                               f"{_preview(self.allowed_token_ids)}", "allowed_token_ids")
        if len(self.bad_words) > MAX_BAD_WORDS or any(
                not isinstance(w, str) or not w.strip() or len(w) > MAX_BAD_WORD_CHARS for w in self.bad_words):
            raise RequestError(f"bad_words must be at most {MAX_BAD_WORDS} strings of 1 to {MAX_BAD_WORD_CHARS} "
                               f"characters, not all whitespace; got {_preview(self.bad_words)}", "bad_words")
        if any(not isinstance(ids, list) or not ids or any(not _is_int(t) or t < 0 for t in ids)
               for ids in self.bad_words_token_ids):
            raise RequestError(f"bad_words_token_ids must be non-empty lists of token ids (integers >= 0), got "
                               f"{_preview(self.bad_words_token_ids)}", "bad_words_token_ids")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise RequestError(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {value!r}", name)

    @property
    def penalised(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def greedy(self) -> bool:
        # below 1e-5 the logits / temperature division overflows float32; such a temperature means greedy (as vLLM).
        # A top_p under 1e-6 keeps only the most likely token in any vocabulary under a million (its probability is
        # at least 1/vocab): greedy too, and spared a float32 underflow that would keep no token at all.
        return self.temperature < GREEDY_BELOW or self.top_k == 1 or self.top_p < 1e-6


@dataclass(frozen=True)
class ThinkingLimit:
    """At most `budget` tokens inside a think block (vLLM's thinking_token_budget): a block opens where the output
    writes `start` (or at once, `inside`) and ends where it writes `end`; once the budget is spent, `end` is forced
    token by token."""

    budget: int
    start: tuple[int, ...]
    end: tuple[int, ...]
    inside: bool = False


class ThinkingBudget:
    """A request's progress through its think block (ThinkingLimit), read from its output as it grows."""

    def __init__(self, limit: ThinkingLimit) -> None:
        self.limit = limit
        self.inside, self.done = limit.inside, False
        self.spent = 0  # tokens written inside the block
        self._seen = 0  # output tokens read so far

    @property
    def active(self) -> bool:
        """The block has not ended: a later token may be forced (`may_force` says when)."""
        return not self.done

    def may_force(self, num_output: int) -> bool:
        """Whether the sample after the first `num_output` output tokens may be forced, counting the tokens `forced`
        has not read yet as any tokens: inside the block each adds at most one to what it spent, outside one of them
        may open it. Only then is the request sampled with its output on the host."""
        unread = num_output - self._seen
        if self.done:
            return False
        return self.spent + unread >= self.limit.budget if self.inside else self.limit.budget <= unread

    def forced(self, output: list[int]) -> int | None:
        """The token the output must write next (the block's end, once its budget is spent), or None."""
        lim = self.limit
        for n in range(self._seen + 1, len(output) + 1):  # each new token, with the output up to it
            if not self.inside and not self.done and tuple(output[max(0, n - len(lim.start)):n]) == lim.start:
                self.inside = True
            elif self.inside:
                self.spent += 1
                if tuple(output[max(0, n - len(lim.end)):n]) == lim.end:
                    self.inside, self.done = False, True
        self._seen = len(output)
        if not self.inside or self.spent < lim.budget:
            return None
        # the budget is spent: the longest start of `end` the output ends with is continued (none: end[0])
        return lim.end[_continued(output, lim.end)]


def _continued(output: list[int], end: tuple[int, ...]) -> int:
    """How many of `end`'s first tokens the output ends with (fewer than all of them)."""
    return next((k for k in range(min(len(end) - 1, len(output)), 0, -1) if tuple(output[-k:]) == end[:k]), 0)


class BadWords:
    """A request's bad words as token-id sequences, as vLLM applies them: a word's last token is masked wherever the
    output so far ends with the rest of the word (the prompt does not count); a word of one token is always masked."""

    def __init__(self, words: list[list[int]]) -> None:
        self.always = sorted({w[0] for w in words if len(w) == 1})
        self._after: dict[int, dict[tuple[int, ...], list[int]]] = {}  # prefix length -> prefix -> last tokens
        for w in words:
            if len(w) > 1:
                self._after.setdefault(len(w) - 1, {}).setdefault(tuple(w[:-1]), []).append(w[-1])

    @property
    def reads_output(self) -> bool:
        """Some word has several tokens: what is masked depends on the output so far."""
        return bool(self._after)

    def banned(self, output: list[int]) -> list[int]:
        """The token ids masked for the token that follows `output`."""
        ids = list(self.always)
        for n, prefixes in self._after.items():
            if len(output) >= n:
                ids += prefixes.get(tuple(output[-n:]), ())
        return ids


def joined_slice(prompt: list[int], output: list[int], start: int, stop: int) -> list[int]:
    """(prompt + output)[start:stop], 0 <= start and stop <= the total, copying only the slice's tokens."""
    n = len(prompt)
    if stop <= n:
        return prompt[start:stop]
    if start >= n:
        return output[start - n:stop - n]
    return prompt[start:] + output[:stop - n]


class TokenView(Sequence):
    """prompt + output, read in place: its length and slices (of step 1) without concatenating the two lists."""

    __slots__ = ("prompt", "output")

    def __init__(self, prompt: list[int], output: list[int]) -> None:
        self.prompt, self.output = prompt, output

    def __len__(self) -> int:
        return len(self.prompt) + len(self.output)

    def __getitem__(self, index):
        n = len(self.prompt)
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            return joined_slice(self.prompt, self.output, start, stop) if step == 1 else list(self)[index]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError("token index out of range")
        return self.prompt[index] if index < n else self.output[index - n]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"
    ABORTED = "aborted"

    @property
    def done(self) -> bool:
        return self in (RequestStatus.FINISHED, RequestStatus.ABORTED)


class Request:
    """One generation: prompt, generated tokens, KV pages, progress of its (possibly layer-split) prefill."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                 arrival_time: float | None = None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.sampling = sampling
        self.status = RequestStatus.WAITING
        self.page_table = PageTable()
        self.num_computed_tokens = 0   # tokens whose KV is in the cache for every layer
        self.prefill_layer = 0         # first layer the current prefill chunk has not run yet
        self.num_cached_tokens: int | None = None  # prefix reused from the cache at first admission
        self.num_preemptions = 0
        self.start_seq = -1            # admission order; the youngest request is preempted first
        self.finish_reason: str | None = None
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.last_token_time: float | None = None  # when the engine emitted its latest token (scheduler clock)
        self.scheduled_time: float | None = None  # when it was first admitted (scheduler clock)
        self.slo_class: str | None = None  # request class of the SLO contract; None: the contract's default
        # work already admitted (a beam search's next tokens, the other choices of n > 1): the waiting queue's limit
        # and the planner's load shedding do not refuse it, so an accepted request is never cut off with a 429 midway
        self.continued = False
        self.min_tokens_blocked: list[int] = []  # ids masked while fewer than sampling.min_tokens are out
        self.bad_words = BadWords(sampling.bad_words_token_ids) if sampling.bad_words_token_ids else None
        self.thinking = ThinkingBudget(sampling.thinking) if sampling.thinking is not None else None
        self.matcher = None  # the grammar's state (engine/grammar.py) when the output is constrained
        # tokens sampled by launched steps that the host has not read yet (overlapped loop, engine/engine.py); the
        # latest sits at `pending_row` of the token buffer its step wrote (engine/launched.py)
        self.num_pending = 0
        self.pending_row = -1

    @property
    def all_token_ids(self) -> TokenView:
        """Prompt and output tokens known on the host (pending tokens are not among them), as a view: a slice
        copies only its tokens (the prefix cache hashes a long context's pages a page at a time)."""
        return TokenView(self.prompt_token_ids, self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt and output tokens, pending ones included: the length the next step computes from."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending

    @property
    def num_output_tokens(self) -> int:
        """Output tokens sampled so far, pending ones included (the index of the next one)."""
        return len(self.output_token_ids) + self.num_pending

    @property
    def exhausted(self) -> bool:
        """It has sampled max_tokens tokens (some may still be pending): it finishes once they are read, so no
        step is planned for it."""
        return self.num_output_tokens >= self.sampling.max_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_uncached_prompt_tokens(self) -> int:
        """Prompt tokens not served from the prefix cache at admission (what its TTFT target grows with)."""
        return self.num_prompt_tokens - min(self.num_cached_tokens or 0, self.num_prompt_tokens)

    @property
    def reads_output(self) -> bool:
        """Its tokens' logits may depend on its output so far as the host reads it (a grammar's mask, a bad word of
        several tokens, a think block's budget): such a row is sampled once its latest token is on the host where
        `needs_output_now` says so. (A penalty's counts are kept on the device: engine/logits.py.)"""
        return self.matcher is not None or (
            self.bad_words is not None and self.bad_words.reads_output) or (
            self.thinking is not None and self.thinking.active)

    @property
    def needs_output_now(self) -> bool:
        """Its next sample needs every output token so far on the host: a grammar's mask and a bad word of several
        tokens always; a think block's budget only where that sample may be forced (near the budget's end)."""
        return self.matcher is not None or (
            self.bad_words is not None and self.bad_words.reads_output) or (
            self.thinking is not None and self.thinking.may_force(self.num_output_tokens))

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Its prompt's log-probabilities are still to compute: its first prefill runs every prompt token (no
        prefix-cache reuse)."""
        return self.sampling.prompt_logprobs is not None and not self.num_output_tokens

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, prompt={self.num_prompt_tokens}, "
                f"out={len(self.output_token_ids)}, pending={self.num_pending}, computed={self.num_computed_tokens})")


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability (or logit) as `--logprobs-mode` says (engine/logprobs.py: by default the model's own
    distribution), its rank there (1: the most likely) and the `top` alternatives, most likely first."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()
    likelihood: float | None = None  # the token's log-probability where `logprob` is a logit (the `_logits` modes)

    @property
    def log_probability(self) -> float:
        """The token's log-probability in every mode (best_of ranks candidates by their sum)."""
        return self.logprob if self.likelihood is None else self.likelihood


@dataclass
class RequestOutput:
    """What one step produced for one request (deltas), plus its running totals for usage reporting."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    text: str | None = None  # the whole output text so far (set on the final output)
    logprobs: list[TokenLogprob] | None = None  # one per new token, when asked for
    prompt_logprobs: list[TokenLogprob | None] | None = None  # on the first output, when asked for (None first)
    stop_reason: int | str | None = None  # (finished by "stop") the stop token id or stop string; None for EOS
    queued_s: float | None = None  # (on the final output) seconds from its arrival to its first admission

    def then(self, later: RequestOutput) -> RequestOutput:
        """This output and the request's next one as a single output: their deltas joined, the later totals."""
        logprobs = None if self.logprobs is None and later.logprobs is None else \
            [*(self.logprobs or ()), *(later.logprobs or ())]
        return replace(later, new_token_ids=self.new_token_ids + later.new_token_ids,
                       new_text=self.new_text + later.new_text, logprobs=logprobs,
                       prompt_logprobs=self.prompt_logprobs if later.prompt_logprobs is None else later.prompt_logprobs,
                       queued_s=self.queued_s if later.queued_s is None else later.queued_s)
