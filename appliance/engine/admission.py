"""Every check a request passes before it joins the waiting queue, in the order it meets them.

Before the engine, the server refuses at the door (`server/gate.py`, `server/lifecycle.py`): a missing API key
(401), a body over --max-request-bytes (413), a draining or still-loading server (503), more requests in flight than
--max-num-seqs + --max-waiting (429). Then, here: the request itself (sampling parameters, prompt tokens inside the
vocabulary, not empty, stop strings and bad words need a tokenizer, which spells the bad words in tokens), the context
length (prompt + max_tokens), its id and SLO class, the waiting queue's limit (--max-waiting and the contract's queue
limit), and last the planner's own admission test (a contract that sheds load refuses a request whose TTFT it cannot
meet, with a Retry-After). Work admitted before (a beam search's next tokens, the other choices of n > 1) skips those
last two.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from appliance.engine.request import Request, SamplingParams
from appliance.errors import CapacityError, RequestError
from appliance.model_zoo.tokenizer import Tokenizer

if TYPE_CHECKING:  # the engine owns its admission
    from appliance.engine.engine import Engine

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # OpenAI's error code for prompt + max_tokens over the context


class Admission:
    def __init__(self, engine: "Engine") -> None:
        self.engine = engine

    def make_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                     request_id: str | None = None, add_special_tokens: bool = True) -> Request:
        """Tokenize and validate; raises RequestError naming the bad field. Touches no engine state."""
        engine = self.engine
        params = params or SamplingParams()
        params.validate()
        if isinstance(prompt, str):
            if engine.tokenizer is None:
                raise RequestError("this model has no tokenizer; send token ids", "prompt")
            ids = engine.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        else:
            ids = list(prompt)
            vocab = engine.model.config.vocab_size
            bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < vocab), None)
            if bad is not None:
                raise RequestError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})", "prompt")
        if not ids:
            raise RequestError("prompt is empty", "prompt")
        if params.stop and engine.tokenizer is None:
            raise RequestError("stop strings need a tokenizer; this model has none", "stop")
        vocab = engine.model.config.vocab_size
        if params.bad_words:
            if engine.tokenizer is None:
                raise RequestError("bad_words need a tokenizer; this model has none", "bad_words")
            params.bad_words_token_ids = bad_word_ids(engine.tokenizer, params.bad_words)
        outside = [t for ids in params.bad_words_token_ids for t in ids if t >= vocab]
        if outside:
            raise RequestError(f"bad_words: token id {outside[0]} is outside the vocabulary [0, {vocab})", "bad_words")
        outside = [t for t in params.logit_bias if t >= vocab]
        if outside:
            raise RequestError(f"logit_bias: token id {outside[0]} is outside the vocabulary [0, {vocab})",
                               "logit_bias")
        allowed = params.allowed_token_ids
        if allowed is not None:
            if any(t >= vocab for t in allowed):
                raise RequestError(f"allowed_token_ids: token id {max(allowed)} is outside the vocabulary [0, "
                                   f"{vocab})", "allowed_token_ids")
            if params.grammar is not None:  # their intersection may be empty: no token left to sample
                raise RequestError(f"allowed_token_ids and {params.grammar.param} both constrain the output; send "
                                   "one", "allowed_token_ids", "conflicting_fields")
        limit = engine.max_model_len
        if len(ids) >= limit:
            raise RequestError(f"prompt has {len(ids)} tokens; this model's context is {limit} tokens "
                               "and at least one must be left to generate", "prompt", CONTEXT_LENGTH_EXCEEDED)
        if len(ids) + params.max_tokens > limit:
            raise RequestError(f"max_tokens={params.max_tokens} plus the prompt's {len(ids)} tokens exceeds the "
                               f"context of {limit} tokens", "max_tokens", CONTEXT_LENGTH_EXCEEDED)
        rid = request_id if request_id is not None else engine.next_request_id()
        request = Request(rid, ids, params)
        if params.cache_salt is not None:
            request.page_table.salt(params.cache_salt)
        if params.min_tokens:  # (ids outside the vocabulary are never sampled: nothing to mask)
            request.min_tokens_blocked = sorted(t for t in set(params.stop_token_ids) | (
                set() if params.ignore_eos else engine.eos_token_ids) if t < vocab)
        banned = set(request.bad_words.always if request.bad_words is not None else ())
        if allowed is not None and set(allowed) <= banned | set(request.min_tokens_blocked):
            raise RequestError("allowed_token_ids holds only tokens that bad_words bans or min_tokens holds back "
                               "(end-of-sequence and stop tokens): no token is left to sample", "allowed_token_ids",
                               "conflicting_fields")
        if params.grammar is not None:
            if engine.grammars is None:
                raise RequestError("structured output needs a tokenizer; this model has none", params.grammar.param)
            request.matcher = engine.grammars.matcher(params.grammar)
        return request

    def slo_class(self, name: str | None) -> str | None:
        """Check a request's SLO class against the contract (RequestError naming the classes when unknown)."""
        contract = self.engine.contract
        if name is not None and name not in contract.classes:
            raise RequestError(f"SLO class {name!r} is not in contract {contract.name!r}; classes: "
                               f"{', '.join(contract.classes)}", "slo_class")
        return name

    def check(self, request: Request) -> None:
        """May this validated request join the queue now? RequestError or CapacityError (429) when not."""
        engine = self.engine
        sched = engine.scheduler
        if request.request_id in sched.requests:
            raise RequestError(f"request id {request.request_id!r} is already in use", "request_id")
        self.slo_class(request.slo_class)
        if request.continued:
            return  # work admitted before (Request.continued): no limit of the queue or the contract cuts it off
        limit = engine.config.scheduler.max_waiting
        if engine.config.scheduler.slo:
            limit = min(limit, engine.contract.overload.queue_limit)
        # requests that the next step starts at once (free seats) are not queued: a burst that arrives between two
        # steps fills the seats and then the queue, as it would one request at a time
        queued = len(sched.waiting) - max(0, sched.max_num_seqs - sched.num_running)
        if queued >= limit:
            raise CapacityError(f"{max(queued, 0)} requests are waiting (limit {limit}); retry later")
        retry = sched.planner.admission_check(sched, request)
        if retry is not None:
            raise CapacityError(f"the server is too busy to meet this request's TTFT target (SLO contract "
                                f"{engine.contract.name!r} sheds load); retry after {retry:.0f} s", retry_after=retry)


def bad_word_ids(tokenizer: Tokenizer, words: list[str]) -> list[list[int]]:
    """Each bad word's spellings in tokens, as vLLM finds them: the word without its leading whitespace, and the word
    after one space where that is another token sequence of the same length (the word inside a text)."""
    out = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not plain:
            raise RequestError(f"bad_words: {word!r} makes no token with this model's tokenizer", "bad_words")
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        out += [plain, spaced] if spaced[0] != plain[0] and len(spaced) == len(plain) else [plain]
    return out
