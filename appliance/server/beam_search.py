"""Beam search as vLLM's OpenAI server runs it (`use_beam_search`, the beam width in `n`): each step asks the engine
for one token of every beam with its 2 x width likeliest continuations, keeps the width best beams by
length-penalised log-probability and sets aside those that ended (end of sequence unless ignore_eos, or one of
stop_token_ids); after max_tokens steps the width best of them all are the choices. The prompt's full pages stay in
the prefix cache between steps, so each step prefills little more than every beam's newest token.
"""
from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from typing import Callable

from appliance.engine.async_engine import AsyncEngine
from appliance.engine.request import MAX_LOGPROBS, Request, RequestOutput, SamplingParams, TokenLogprob
from appliance.errors import RequestError
from appliance.server.protocol import CONFLICT

MAX_WIDTH = MAX_LOGPROBS // 2  # a step asks for 2 x width alternatives, at most MAX_LOGPROBS
_ids = itertools.count()


@dataclass
class Beam:
    tokens: list[int] = field(default_factory=list)  # the output so far (an ending token included)
    logprob: float = 0.0  # the sum of its tokens' log-probabilities
    logprobs: list[TokenLogprob] = field(default_factory=list)  # each token's, with the step's alternatives
    ended: bool = False  # its last token is an end of sequence

    def score(self, prompt_len: int, length_penalty: float) -> float:
        """vLLM's: the log-probability over the length (prompt and output, an ending token left out) to the power
        of length_penalty."""
        return self.logprob / (prompt_len + len(self.tokens) - self.ended) ** length_penalty


def check(request: Request, width: int, logprobs_mode: str) -> None:
    """What beam search cannot honour, as a RequestError naming the field (`logprobs_mode`: the server's
    --logprobs-mode, whose values rank the beams)."""
    if logprobs_mode.endswith("_logits"):
        raise RequestError(f"use_beam_search ranks beams by log-probabilities, and this server's logprobs are logits "
                           f"(--logprobs-mode {logprobs_mode})", "use_beam_search")
    if not 1 <= width <= MAX_WIDTH:
        raise RequestError(f"use_beam_search takes n (the beam width) from 1 to {MAX_WIDTH}, got {width}", "n",
                           CONFLICT)
    if request.sampling.stop:
        raise RequestError("use_beam_search ends beams at the end of sequence only; leave stop out", "stop", CONFLICT)
    grammar = request.sampling.grammar
    if grammar is not None:
        param = getattr(grammar, "param", "response_format")
        raise RequestError(f"use_beam_search does not constrain its beams; leave {param} out", param, CONFLICT)


async def search_all(engine: AsyncEngine, requests: list[Request], width: int, length_penalty: float,
                     eos: set[int]) -> list[list[Beam]]:
    """`search` of each request at once."""
    return await _together([search(engine, q, width, length_penalty, eos) for q in requests])


async def search(engine: AsyncEngine, request: Request, width: int, length_penalty: float,
                 eos: set[int]) -> list[Beam]:
    """The `width` best beams continuing `request`'s prompt, best first, with its max_tokens, ignore_eos,
    stop_token_ids (beams end at them as at `eos`) and cache_salt."""
    prompt, sampling = request.prompt_token_ids, request.sampling
    ends = set() if sampling.ignore_eos else eos
    ends = ends | set(sampling.stop_token_ids)
    ask = min(MAX_LOGPROBS, max(2 * width, sampling.logprobs or 0))
    beams, ended = [Beam()], []
    for index in range(sampling.max_tokens):
        steps = await _together([_next(engine, request, prompt + beam.tokens, ask, continued=index > 0)
                                 for beam in beams])
        grown = []
        for beam, step in zip(beams, steps):
            candidates = {step.token_id: step.logprob, **dict(step.top)}
            for token, logprob in candidates.items():
                rank = 1 + sum(v > logprob for v in candidates.values())
                entry = TokenLogprob(token, logprob, rank, step.top)
                new = Beam(beam.tokens + [token], beam.logprob + logprob, beam.logprobs + [entry], token in ends)
                (ended if new.ended else grown).append(new)
        beams = sorted(grown, key=lambda b: b.score(len(prompt), length_penalty), reverse=True)[:width]
        if not beams:
            break
    return sorted(ended + beams, key=lambda b: b.score(len(prompt), length_penalty), reverse=True)[:width]


async def _together(coros: list) -> list:
    """The coroutines' results, run at once; when one fails (or this is cancelled) the others are cancelled too, so
    that no engine request outlives the search."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _next(engine: AsyncEngine, request: Request, ids: list[int], logprobs: int,
                continued: bool) -> TokenLogprob:
    """One greedy token after `ids` with its `logprobs` likeliest alternatives. The first step is admitted as any
    request is (a busy server refuses the search with a 429); later ones are `continued`: load never cuts a search
    off midway."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=logprobs,
                            cache_salt=request.sampling.cache_salt)
    step = engine.make_request(ids, params, request_id=f"{request.request_id}-beam-{next(_ids)}")
    step.slo_class = request.slo_class
    step.continued = continued
    last = None
    async for out in engine.stream(step):
        last = out
    if last is None or not last.logprobs:
        raise RuntimeError(f"a beam search step of {request.request_id} returned no token")
    return last.logprobs[0]


def output(request: Request, beam: Beam, decode: Callable[[list[int]], str]) -> RequestOutput:
    """A beam as a finished choice's one output, its text from `decode`; its ending token only with
    include_stop_str_in_output, each token's log-probability and alternatives where the request asked for them."""
    kept = beam.tokens if request.sampling.include_stop_str or not beam.ended else beam.tokens[:-1]
    k = request.sampling.logprobs
    shown = None if k is None else [TokenLogprob(e.token_id, e.logprob, e.rank, e.top[:k])
                                    for e in beam.logprobs[:len(kept)]]
    text = decode(kept)
    return RequestOutput(request.request_id, kept, text, True, "stop" if beam.ended else "length",
                         len(request.prompt_token_ids), 0, len(kept), text=text, logprobs=shown)
