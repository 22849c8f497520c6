"""What rank 0 of a tensor-parallel engine sends the other ranks: every step as one flat int64 array (no pickling on
the hot path) holding the plan, the decisions it runs on (engine/launched.py `Decisions`), and what the other ranks do
not know yet of its requests: new requests, the tokens sampled since, the pages added since. Requests that leave
(finished, aborted, preempted) go in a release message; a preempted one that comes back is sent again as new.

The other ranks rebuild each request (its tokens and pages, as the runner reads them) from these messages alone,
under a number rank 0 gave it. A step message is a header of `HEADER` ints, then sections in this order: released
numbers; new requests (number, prompt length, wants prompt log-probabilities); token counts (number, count); page
updates (number, restart, count); decode numbers; prefill works (number, token start, token end, layer start,
layer end); the rows of each prefill launch (-1: its tokens); then the tokens and the pages themselves.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from appliance.engine.batch import span_tokens
from appliance.engine.plan import PrefillWork, StepPlan
from appliance.engine.request import Request, SamplingParams

STEP, RELEASE, IDLE = 1, 2, 3
MIXED, MIXED_GRAPHS, USE_GRAPHS, PREFILL_AFTER_DECODE, HOLD_SAMPLING = 1, 2, 4, 8, 16
HEADER = 10  # kind, flags, partition, released, new, token counts, page updates, decode rows, prefill works, launches


@dataclass
class _Sent:
    """What the other ranks know of a request: its number, its first `tokens` tokens, `num_pages` pages of `pages`
    (the pool's list object; another object means the table was rebuilt)."""

    number: int
    tokens: int = 0
    pages: list[int] | None = None
    num_pages: int = 0


@dataclass(frozen=True)
class Step:
    """A message as the other ranks read it (released requests only, for a release message)."""

    kind: int
    plan: StepPlan
    partition: int = -1
    mixed_graphs: bool = False
    use_graphs: bool = True
    prefill_rows: tuple[int | None, ...] = ()
    hold_sampling: bool = False  # rank 0 samples the forward's rows after the step's prefill launches


class WireEncoder:
    """Rank 0's side: turns plans into messages, remembering what it sent of each request."""

    def __init__(self) -> None:
        self._sent: dict[str, _Sent] = {}
        self._numbers = itertools.count()

    def release(self, request_ids: tuple[str, ...]) -> bytes | None:
        """The message that drops these requests' state (None: the other ranks never saw any of them)."""
        gone = [self._sent.pop(rid).number for rid in request_ids if rid in self._sent]
        if not gone:
            return None
        return np.asarray([RELEASE, 0, -1, len(gone), 0, 0, 0, 0, 0, 0, *gone], dtype=np.int64).tobytes()

    @staticmethod
    def idle() -> bytes:
        """The message that says rank 0's engine has no request left (each rank tidies its memory then)."""
        return np.asarray([IDLE, 0, -1, 0, 0, 0, 0, 0, 0, 0], dtype=np.int64).tobytes()

    def step(self, plan: StepPlan, requests: dict[str, Request], partition: int, mixed_graphs: bool,
             use_graphs: bool, prefill_rows: tuple[int | None, ...], hold_sampling: bool = False) -> bytes:
        new: list[int] = []
        counts: list[int] = []
        pages: list[int] = []
        tokens: list[int] = []
        page_ids: list[int] = []
        for rid in dict.fromkeys([*plan.decode, *(w.request_id for w in plan.prefill)]):
            r = requests[rid]
            sent = self._sent.get(rid)
            if sent is None:
                sent = self._sent[rid] = _Sent(next(self._numbers))
                new += (sent.number, r.num_prompt_tokens, int(r.wants_prompt_logprobs))
            if r.num_tokens > sent.tokens:
                counts += (sent.number, r.num_tokens - sent.tokens)
                tokens += span_tokens(r, sent.tokens, r.num_tokens)
                sent.tokens = r.num_tokens
            table = r.page_table.pages
            restart = table is not sent.pages or len(table) < sent.num_pages
            start = 0 if restart else sent.num_pages
            if restart or len(table) > start:
                pages += (sent.number, int(restart), len(table) - start)
                page_ids += table[start:]
                sent.pages, sent.num_pages = table, len(table)
        sent_ = self._sent
        works = [x for w in plan.prefill for x in (sent_[w.request_id].number, w.token_start, w.token_end,
                                                   w.layer_start, w.layer_end)]
        flags = (MIXED * plan.mixed | MIXED_GRAPHS * mixed_graphs | USE_GRAPHS * use_graphs
                 | PREFILL_AFTER_DECODE * plan.prefill_after_decode | HOLD_SAMPLING * hold_sampling)
        header = [STEP, flags, partition, 0, len(new) // 3, len(counts) // 2, len(pages) // 3, len(plan.decode),
                  len(plan.prefill), len(prefill_rows)]
        rows = [-1 if r is None else r for r in prefill_rows]
        return np.asarray([*header, *new, *counts, *pages, *(sent_[i].number for i in plan.decode), *works, *rows,
                           *tokens, *page_ids], dtype=np.int64).tobytes()


class WireDecoder:
    """The other ranks' side: reads messages and keeps every live request's copy in `requests`."""

    def __init__(self) -> None:
        self.requests: dict[str, Request] = {}
        self._prompt_len: dict[str, int] = {}

    def read(self, payload: bytes) -> Step:
        data = np.frombuffer(payload, dtype=np.int64).tolist()
        kind, flags, partition, n_gone, n_new, n_counts, n_pages, n_decode, n_works, n_rows = data[:HEADER]
        at = HEADER

        def take(n: int) -> list[int]:
            nonlocal at
            at += n
            return data[at - n:at]

        gone = tuple(str(x) for x in take(n_gone))
        for rid in gone:
            self.requests.pop(rid, None)
            self._prompt_len.pop(rid, None)
        new, counts, pages = take(3 * n_new), take(2 * n_counts), take(3 * n_pages)
        decode = tuple(str(x) for x in take(n_decode))
        works = take(5 * n_works)
        rows = tuple(None if x < 0 else x for x in take(n_rows))
        for number, prompt_len, wants in zip(new[::3], new[1::3], new[2::3]):
            rid = str(number)
            self.requests[rid] = Request(rid, [], SamplingParams(prompt_logprobs=0 if wants else None))
            self._prompt_len[rid] = prompt_len
        for number, count in zip(counts[::2], counts[1::2]):
            r, chunk = self.requests[str(number)], take(count)
            room = self._prompt_len[r.request_id] - len(r.prompt_token_ids)
            r.prompt_token_ids += chunk[:room]
            r.output_token_ids += chunk[room:]
        for number, restart, count in zip(pages[::3], pages[1::3], pages[2::3]):
            table, chunk = self.requests[str(number)].page_table, take(count)
            if restart:
                table.pages = chunk  # a new list: the batch builder's mirror starts again
            else:
                table.pages += chunk
        prefill = tuple(PrefillWork(str(works[i]), *works[i + 1:i + 5]) for i in range(0, len(works), 5))
        plan = StepPlan(decode=decode, prefill=prefill, mixed=bool(flags & MIXED), finished=gone,
                        prefill_after_decode=bool(flags & PREFILL_AFTER_DECODE))
        return Step(kind, plan, partition, bool(flags & MIXED_GRAPHS), bool(flags & USE_GRAPHS), rows,
                    bool(flags & HOLD_SAMPLING))
