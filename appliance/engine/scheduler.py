"""Step planning: the StepPlan data type, the Scheduler that owns queues and KV pages, and the built-in planners.

A planner is policy: it looks at the queues and returns a StepPlan (which requests decode, which prefill over which
token and layer range). The Scheduler supplies the mechanisms a planner calls (admit a request, reserve a decode slot,
preempting the youngest request when the pool is exhausted) and applies a step's results. Neither touches tensors.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Iterable, Protocol

from appliance.engine.kv_cache import PagePool
from appliance.engine.request import Request, RequestStatus


@dataclass(frozen=True)
class PrefillWork:
    """Compute KV for tokens [token_start, token_end) of a request through layers [layer_start, layer_end)."""

    request_id: str
    token_start: int
    token_end: int
    layer_start: int
    layer_end: int

    @property
    def num_tokens(self) -> int:
        return self.token_end - self.token_start


@dataclass(frozen=True)
class StepPlan:
    """One step's work. With `mixed`, the decode rows and the prefill works (each over all layers) run as one
    forward over one flat token batch (Sarathi-style chunked prefill); otherwise decode and each layer range of
    prefill run as separate forwards."""

    decode: tuple[str, ...] = ()
    prefill: tuple[PrefillWork, ...] = ()
    mixed: bool = False

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill


class Planner(Protocol):
    name: str

    def plan(self, sched: "Scheduler") -> StepPlan:
        """Decide this step; may call sched.admit / sched.reserve_decode, must not touch tensors."""


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
        self._preempted: list[str] = []

    # ---- queue state ------------------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    @property
    def num_running(self) -> int:
        return len(self.prefilling) + len(self.decoding)

    def has_work(self) -> bool:
        return bool(self.requests)

    def drain_preempted(self) -> list[str]:
        """Ids preempted since the last call (their executor state must be dropped)."""
        out, self._preempted = self._preempted, []
        return out

    # ---- mechanisms for planners ------------------------------------------------------------------------------
    def admit(self, request: Request) -> bool:
        """Move a waiting request to prefilling with pages for all its tokens (cached prefix reused).

        Its prefill computes every token it has: the prompt, and after a preemption the output so far.
        """
        assert request.status is RequestStatus.WAITING
        if self.num_running >= self.max_num_seqs:
            return False
        cached = self.pool.allocate(request.page_table, request.all_token_ids, request.num_tokens)
        if cached is None:
            return False
        self.waiting.remove(request)
        request.status = RequestStatus.PREFILLING
        request.num_computed_tokens = cached
        request.prefill_layer = 0
        if request.num_cached_tokens is None:
            request.num_cached_tokens = cached
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
            candidates = [r for r in self.prefilling + self.decoding if r.request_id not in self._reserved]
            victim = max(candidates, key=lambda r: r.start_seq)
            self.preempt(victim)
            if victim is request:
                return False
        self._reserved.add(request.request_id)
        return True

    def preempt(self, request: Request) -> None:
        """Free every page of a running request and requeue it (first in line) to recompute its tokens."""
        self.pool.free(request.page_table)
        (self.decoding if request.status is RequestStatus.DECODING else self.prefilling).remove(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.appendleft(request)
        self._preempted.append(request.request_id)

    # ---- one step ---------------------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        self._reserved.clear()
        return self.planner.plan(self)

    def update(self, plan: StepPlan, sampled: dict[str, int]) -> list[tuple[Request, int]]:
        """Record a step's progress; returns (request, new token) for every request that got a token."""
        out = []
        page_size = self.pool.page_size
        for rid in plan.decode:
            r = self.requests[rid]
            r.num_computed_tokens = r.num_tokens
            if r.num_computed_tokens // page_size > r.page_table.num_registered:  # a page just filled up
                self.pool.register(r.page_table, r.all_token_ids, r.num_computed_tokens)
            r.output_token_ids.append(sampled[rid])
            out.append((r, sampled[rid]))
        for work in plan.prefill:
            r = self.requests[work.request_id]
            if work.layer_end < self.num_layers:
                r.prefill_layer = work.layer_end
                continue
            r.prefill_layer = 0
            r.num_computed_tokens = work.token_end
            self.pool.register(r.page_table, r.all_token_ids, r.num_computed_tokens)
            if work.token_end == r.num_tokens:
                self.prefilling.remove(r)
                self.decoding.append(r)
                r.status = RequestStatus.DECODING
                r.output_token_ids.append(sampled[r.request_id])
                out.append((r, sampled[r.request_id]))
        return out

    def finish(self, request: Request, reason: str | None, aborted: bool = False) -> None:
        """Take a request out of the engine and free its pages at once."""
        if request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        elif request.status is RequestStatus.PREFILLING:
            self.prefilling.remove(request)
        elif request.status is RequestStatus.DECODING:
            self.decoding.remove(request)
        self.pool.free(request.page_table)
        request.status = RequestStatus.ABORTED if aborted else RequestStatus.FINISHED
        request.finish_reason = reason
        del self.requests[request.request_id]


# ---- built-in planners ------------------------------------------------------------------------------------------
def _admit_fcfs(sched: Scheduler, token_budget: int) -> list[Request]:
    """Admit waiting requests in arrival order while pages, seats and the prompt-token budget allow (at least one)."""
    admitted: list[Request] = []
    while sched.waiting:
        r = sched.waiting[0]
        if admitted and r.num_tokens > token_budget:
            break
        if not sched.admit(r):
            break
        token_budget -= r.num_tokens - r.num_computed_tokens
        admitted.append(r)
    return admitted


def _reserve_all(sched: Scheduler, requests: Iterable[Request]) -> tuple[str, ...]:
    """Reserve a decode slot for each request, oldest first, skipping those preempted on the way."""
    batch = []
    for r in sorted(requests, key=lambda r: r.start_seq):
        if r.status is RequestStatus.DECODING and sched.reserve_decode(r):
            batch.append(r.request_id)
    return tuple(batch)


class SerialPlanner:
    """Prefill first: whole prompts through all layers before any decode step (vLLM's classic default)."""

    name = "serial"

    def __init__(self, max_prefill_tokens: int = 8192) -> None:
        self.max_prefill_tokens = max_prefill_tokens

    def plan(self, sched: Scheduler) -> StepPlan:
        _admit_fcfs(sched, self.max_prefill_tokens)
        if sched.prefilling:
            return StepPlan(prefill=tuple(
                PrefillWork(r.request_id, r.num_computed_tokens, r.num_tokens, r.prefill_layer, sched.num_layers)
                for r in sched.prefilling))
        return StepPlan(decode=_reserve_all(sched, list(sched.decoding)))


class LayerwisePlanner:
    """Every step decodes all decoding requests and advances the prefills by `layers_per_step` layers.

    On one GPU the two halves run concurrently on disjoint SM partitions; a long prompt then never stalls decoding
    for more than a few layers' time. New prompts are admitted only when no prefill is in progress.
    """

    name = "layerwise"

    def __init__(self, layers_per_step: int = 1, max_prefill_tokens: int = 8192) -> None:
        if layers_per_step < 1:
            raise ValueError(f"layers_per_step must be >= 1, got {layers_per_step}")
        self.layers_per_step = layers_per_step
        self.max_prefill_tokens = max_prefill_tokens

    def plan(self, sched: Scheduler) -> StepPlan:
        decode = _reserve_all(sched, list(sched.decoding))
        if not sched.prefilling:
            _admit_fcfs(sched, self.max_prefill_tokens)
        works = tuple(
            PrefillWork(r.request_id, r.num_computed_tokens, r.num_tokens, r.prefill_layer,
                        min(r.prefill_layer + self.layers_per_step, sched.num_layers))
            for r in sched.prefilling)
        return StepPlan(decode=decode, prefill=works)


PLANNERS = {"serial": SerialPlanner, "layerwise": LayerwisePlanner}
