"""The Scheduler: queues (waiting -> prefilling -> decoding), KV page ownership, admission and preemption (the
mechanisms a planner calls), and the bookkeeping of a step's results. It asks its planner (policy,
`engine/planners/`) for every step and never touches tensors. Prefill work may complete after the step that
launched it (an asynchronous executor runs it on its own stream): it stays in flight until `complete_prefill`, and
planners read `launched_layer` to plan around it; a synchronous executor completes everything in `update`.
A launched step's tokens may stay on the device while the next step is planned (the overlapped loop): `launched`
counts each of them as pending in its request's length, `accept` appends it once read.
"""
from __future__ import annotations

import dataclasses
import time
from collections import deque
from typing import TYPE_CHECKING, Callable, Sequence

from appliance.engine.kv_cache import PagePool
from appliance.engine.plan import PrefillWork, StepPlan
from appliance.engine.request import Request, RequestStatus

if TYPE_CHECKING:  # the planners import the scheduler's type for their hints
    from appliance.engine.planners.base import Planner


class Scheduler:
    """Queues (waiting -> prefilling -> decoding), KV page ownership and preemption."""

    def __init__(self, pool: PagePool, num_layers: int, planner: Planner, max_num_seqs: int) -> None:
        self.pool, self.num_layers, self.planner = pool, num_layers, planner
        self.max_num_seqs = max_num_seqs
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []
        self.decoding: list[Request] = []
        self._admissions = 0
        self._reserved: set[str] = set()
        self._preempted: list[str] = []  # since the last plan: the next plan carries them
        self._finished: list[str] = []
        self.inflight: dict[str, list[PrefillWork]] = {}  # launched prefill work not completed yet, per request
        self.clock: Callable[[], float] = time.monotonic  # a simulator replaces it with virtual time

    # ---- queue state ------------------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    @property
    def num_running(self) -> int:
        return len(self.prefilling) + len(self.decoding)

    def has_work(self) -> bool:
        return bool(self.requests)

    def launched_layer(self, request: Request) -> int:
        """First layer of the request's current prefill chunk not launched yet (in-flight work included)."""
        works = self.inflight.get(request.request_id)
        return works[-1].layer_end if works else request.prefill_layer

    def pass_layer(self, request: Request) -> int:
        """First layer to launch of the request's current prefill pass (chunk), where a pass with every layer
        launched and prompt tokens left after it opens the next at layer 0 (launched at once: the executor orders
        its layers after the last pass's on the GPU)."""
        works = self.inflight.get(request.request_id)
        if works and works[-1].layer_end >= self.num_layers and works[-1].token_end < request.num_tokens:
            return 0
        return self.launched_layer(request)

    def pass_start(self, request: Request) -> int:
        """First token of the request's current prefill pass: of the pass in flight with layers left to launch, else
        after the last pass launched, else the first token not computed."""
        works = self.inflight.get(request.request_id)
        if not works:
            return request.num_computed_tokens
        last = works[-1]
        return last.token_start if last.layer_end < self.num_layers else last.token_end

    def has_inflight(self) -> bool:
        return bool(self.inflight)

    def pending_prefills(self) -> list[tuple[Request, int]]:
        """(request, first layer to launch) of every prefilling request whose current chunk has layers not
        launched yet, oldest admission first."""
        out = []
        for r in sorted(self.prefilling, key=lambda r: r.start_seq):
            layer = self.launched_layer(r)
            if layer < self.num_layers:
                out.append((r, layer))
        return out

    # ---- mechanisms for planners ------------------------------------------------------------------------------
    def admit(self, request: Request) -> bool:
        """Move a waiting request to prefilling with pages for all its tokens (cached prefix reused).

        Its prefill computes every token it has: the prompt, and after a preemption the output so far (not before
        the host has read all of it: a request preempted with a token pending waits a step).
        """
        assert request.status is RequestStatus.WAITING
        if self.num_running >= self.max_num_seqs or request.num_pending:
            return False
        cached = self.pool.allocate(request.page_table, request.all_token_ids, request.num_tokens,
                                    reuse=not request.wants_prompt_logprobs)
        if cached is None:
            return False
        self.waiting.remove(request)
        request.status = RequestStatus.PREFILLING
        request.num_computed_tokens = cached
        request.prefill_layer = 0
        if request.num_cached_tokens is None:
            request.num_cached_tokens = cached
        if request.scheduled_time is None:
            request.scheduled_time = self.clock()
        request.start_seq = self._admissions
        self._admissions += 1
        self.prefilling.append(request)
        return True

    def seat_decoding(self, request: Request) -> bool:
        """Admit a waiting request straight into decoding, taking its prompt's KV as computed (the pages hold
        whatever they hold). For benchmarks and profiling: decode at a given context without paying its prefill."""
        if not self.admit(request):
            return False
        self.prefilling.remove(request)
        request.num_computed_tokens = request.num_tokens
        request.status = RequestStatus.DECODING
        self.decoding.append(request)
        return True

    def reserve_decode(self, request: Request) -> bool:
        """Make room for the request's next token, preempting the youngest running request while the pool is empty.

        Returns False when the request itself was the youngest and got preempted.
        """
        assert request.status is RequestStatus.DECODING
        while not self.pool.grow(request.page_table, request.num_tokens):
            candidates = [r for r in self.prefilling + self.decoding
                          if r.request_id not in self._reserved and r.request_id not in self.inflight]
            victim = max(candidates, key=lambda r: r.start_seq)
            self.preempt(victim)
            if victim is request:
                return False
        self._reserved.add(request.request_id)
        return True

    def preempt(self, request: Request) -> None:
        """Free every page of a running request and requeue it (first in line) to recompute its tokens. A token it
        still has pending is appended when read (`accept`); the executor orders the next launch after the step that
        may still write its pages."""
        self.pool.free(request.page_table)
        (self.decoding if request.status is RequestStatus.DECODING else self.prefilling).remove(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.appendleft(request)
        self._preempted.append(request.request_id)

    # ---- one step ---------------------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """Ask the planner for the next step; its prefill works count as in flight until completed. The plan also
        carries the ids preempted while planning it and those finished or aborted since the last plan."""
        self._reserved.clear()
        plan = self.planner.plan(self)
        for work in plan.prefill:
            self.inflight.setdefault(work.request_id, []).append(work)
        # the plan names who left since the last one, so the executor drops their state from the plan itself
        plan = dataclasses.replace(plan, preempted=tuple(self._preempted), finished=tuple(self._finished))
        self._preempted, self._finished = [], []
        return plan

    def released(self) -> StepPlan:
        """A plan that runs nothing and carries the requests preempted or finished since the last plan (for an engine
        going idle: their executor state goes now rather than at the next step)."""
        plan = StepPlan(preempted=tuple(self._preempted), finished=tuple(self._finished))
        self._preempted, self._finished = [], []
        return plan

    def update(self, plan: StepPlan, sampled: dict[str, int]) -> list[tuple[Request, int]]:
        """Record a whole step's progress (synchronous executors); returns (request, new token) for every request
        that got a token."""
        out = self.update_decode(plan, sampled)
        for work in plan.prefill:
            out += self.complete_prefill(work, sampled.get(work.request_id))
        return out

    def launched(self, plan: StepPlan, completed: Sequence[PrefillWork], rows: dict[str, int]) -> None:
        """A plan was launched and its sampled tokens are still on the device, at `rows` of its token buffer: each
        decoding request, and each prompt that a work run in order with the step (`completed`) finishes, gets a
        pending token there; `accept` appends them once the host has read them."""
        for rid in plan.decode:
            r = self.requests[rid]
            r.num_pending += 1
            r.pending_row = rows[rid]
        for work in completed:
            self.complete_prefill(work, None, rows.get(work.request_id))

    def accept(self, rows: Sequence[tuple[Request, int, int | None]]) -> None:
        """The tokens of a launched step as read back, in row order: (request, token, the context its decode step
        computed; None for a prompt's first token). Requests that left since are not given."""
        for r, token, end in rows:
            r.num_pending -= 1
            if end is not None and r.status is RequestStatus.DECODING:
                r.num_computed_tokens = end
                self._register(r)
            r.output_token_ids.append(token)
        self._emitted([(r, token) for r, token, _ in rows])

    def update_decode(self, plan: StepPlan, sampled: dict[str, int]) -> list[tuple[Request, int]]:
        """Record the plan's decode step."""
        out = []
        for rid in plan.decode:
            r = self.requests[rid]
            r.num_computed_tokens = r.num_tokens
            self._register(r)
            r.output_token_ids.append(sampled[rid])
            out.append((r, sampled[rid]))
        self._emitted(out)
        return out

    def complete_prefill(self, work: PrefillWork, token: int | None,
                         row: int | None = None) -> list[tuple[Request, int]]:
        """Record one prefill work whose layers have all run (`token`: sampled when it ends the request's prompt;
        None with `row`: sampled at that row of a launched step's token buffer, pending until `accept`)."""
        works = self.inflight.get(work.request_id)
        if works:
            works.remove(work)
            if not works:
                del self.inflight[work.request_id]
        r = self.requests.get(work.request_id)
        if r is None or r.status is not RequestStatus.PREFILLING:
            return []  # aborted or preempted while its work was in flight
        if work.layer_end < self.num_layers:
            r.prefill_layer = work.layer_end
            return []
        r.prefill_layer = 0
        r.num_computed_tokens = work.token_end
        self._register(r)
        if work.token_end < r.num_tokens:
            return []
        assert token is not None or row is not None, f"prefill of {r.request_id} ended its prompt without a token"
        self.prefilling.remove(r)
        self.decoding.append(r)
        r.status = RequestStatus.DECODING
        if token is None:
            r.num_pending += 1
            r.pending_row = row
            return []
        r.output_token_ids.append(token)
        self._emitted([(r, token)])
        return [(r, token)]

    def _emitted(self, produced: list[tuple[Request, int]]) -> None:
        """Time the tokens just produced as clients see them, gap by gap (a first token: its TTFT), and hand the
        measurements to the planner (closed-loop control)."""
        if not produced:
            return
        now = self.clock()
        gaps, firsts = [], []
        for r, _ in produced:
            if r.last_token_time is None:
                firsts.append((r, now - r.arrival_time))
            else:
                gaps.append((r, now - r.last_token_time))
            r.last_token_time = now
        self.planner.observe_tokens(gaps, firsts)

    def _register(self, r: Request) -> None:
        # only when a page has filled up (all_token_ids is a view: hashing reads the new pages only)
        if r.num_computed_tokens // self.pool.page_size > r.page_table.num_registered:
            self.pool.register(r.page_table, r.all_token_ids, r.num_computed_tokens)

    def finish(self, request: Request, reason: str | None, aborted: bool = False) -> None:
        """Take a request out of the engine and free its pages at once."""
        if request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        elif request.status is RequestStatus.PREFILLING:
            self.prefilling.remove(request)
        elif request.status is RequestStatus.DECODING:
            self.decoding.remove(request)
        self.pool.free(request.page_table)
        self.inflight.pop(request.request_id, None)
        request.status = RequestStatus.ABORTED if aborted else RequestStatus.FINISHED
        request.finish_reason = reason
        del self.requests[request.request_id]
        self._finished.append(request.request_id)
