"""Step planning: the StepPlan data type, the Scheduler that owns queues and KV pages, and the built-in planners.

A planner is policy: it looks at the queues and returns a StepPlan (which requests decode, which prefill over which
token and layer range, on which SM partition). The Scheduler supplies the mechanisms a planner calls (admit a request,
reserve a decode slot, preempting the youngest request when the pool is exhausted) and applies a step's results.
Neither touches tensors. Prefill work may complete after the step that launched it (an asynchronous executor runs
it on its own stream): the Scheduler tracks it as in flight until `complete_prefill`, and planners read
`launched_layer` to plan around it; a synchronous executor completes everything in `update`.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable, Protocol

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
    prefill run as separate forwards.

    `decode_sms` / `prefill_sms` choose the SM partition of each phase (None: all SMs). With both set the phases run
    concurrently on disjoint partitions; executors without partitions (the CPU runner) ignore them.
    """

    decode: tuple[str, ...] = ()
    prefill: tuple[PrefillWork, ...] = ()
    mixed: bool = False
    decode_sms: int | None = None
    prefill_sms: int | None = None

    @property
    def spatial(self) -> bool:
        """Decode and prefill on disjoint partitions (the multiplexed mode)."""
        return self.decode_sms is not None or self.prefill_sms is not None

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
            candidates = [r for r in self.prefilling + self.decoding
                          if r.request_id not in self._reserved and r.request_id not in self.inflight]
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
        """Ask the planner for the next step; its prefill works count as in flight until completed."""
        self._reserved.clear()
        plan = self.planner.plan(self)
        for work in plan.prefill:
            self.inflight.setdefault(work.request_id, []).append(work)
        return plan

    def update(self, plan: StepPlan, sampled: dict[str, int]) -> list[tuple[Request, int]]:
        """Record a whole step's progress (synchronous executors); returns (request, new token) for every request
        that got a token."""
        out = self.update_decode(plan, sampled)
        for work in plan.prefill:
            out += self.complete_prefill(work, sampled.get(work.request_id))
        return out

    def update_decode(self, plan: StepPlan, sampled: dict[str, int]) -> list[tuple[Request, int]]:
        """Record the plan's decode step."""
        out = []
        for rid in plan.decode:
            r = self.requests[rid]
            r.num_computed_tokens = r.num_tokens
            self._register(r)
            r.output_token_ids.append(sampled[rid])
            out.append((r, sampled[rid]))
        return out

    def complete_prefill(self, work: PrefillWork, token: int | None) -> list[tuple[Request, int]]:
        """Record one prefill work whose layers have all run (`token`: sampled when it ends the request's prompt)."""
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
        assert token is not None, f"prefill of {r.request_id} ended its prompt without a sampled token"
        self.prefilling.remove(r)
        self.decoding.append(r)
        r.status = RequestStatus.DECODING
        r.output_token_ids.append(token)
        return [(r, token)]

    def _register(self, r: Request) -> None:
        # only when a page has filled up: building all_token_ids for every decoded token costs O(context)
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


def chunk_end(r: Request, max_tokens: int) -> int:
    """End of the request's next prefill chunk: at most max_tokens new tokens, so that a long prompt's activations
    stay within what the engine sized its memory for (the chunk's end stays fixed while its layers run)."""
    return min(r.num_tokens, r.num_computed_tokens + max_tokens)


def _reserve_all(sched: Scheduler, requests: Iterable[Request]) -> tuple[str, ...]:
    """Reserve a decode slot for each request, oldest first, skipping those preempted on the way."""
    batch = []
    for r in sorted(requests, key=lambda r: r.start_seq):
        if r.status is RequestStatus.DECODING and sched.reserve_decode(r):
            batch.append(r.request_id)
    return tuple(batch)


class SerialPlanner:
    """Prefill first: prompts through all layers before any decode step (vLLM's classic default), in chunks of at
    most max_prefill_tokens new tokens per step."""

    name = "serial"

    def __init__(self, max_prefill_tokens: int = 8192) -> None:
        self.max_prefill_tokens = max_prefill_tokens

    def plan(self, sched: Scheduler) -> StepPlan:
        _admit_fcfs(sched, self.max_prefill_tokens)
        works, budget = [], self.max_prefill_tokens
        for r, layer in sched.pending_prefills():  # oldest first, within the step's token budget (one at least)
            if works and budget <= 0:
                break
            end = chunk_end(r, max(budget, 1))
            works.append(PrefillWork(r.request_id, r.num_computed_tokens, end, layer, sched.num_layers))
            budget -= end - r.num_computed_tokens
        if works:
            return StepPlan(prefill=tuple(works))
        return StepPlan(decode=_reserve_all(sched, list(sched.decoding)))


class LayerwisePlanner:
    """Every step decodes all decoding requests and advances the prefills by `layers_per_step` layers.

    On one GPU the two halves run concurrently on disjoint SM partitions; a long prompt then never stalls decoding
    for more than a few layers' time. New prompts are admitted only when no prefill is in progress.
    """

    name = "layerwise"
    MAX_QUEUED = 2

    def __init__(self, layers_per_step: int = 1, max_prefill_tokens: int = 8192, decode_sms: int = 64) -> None:
        if layers_per_step < 1:
            raise ValueError(f"layers_per_step must be >= 1, got {layers_per_step}")
        self.layers_per_step = layers_per_step
        self.max_prefill_tokens = max_prefill_tokens
        self.decode_sms = decode_sms

    def plan(self, sched: Scheduler) -> StepPlan:
        decode = _reserve_all(sched, list(sched.decoding))
        if not sched.prefilling:
            _admit_fcfs(sched, self.max_prefill_tokens)
        # at most MAX_QUEUED launches in flight per request: the prefill stream stays busy, and when decode moves
        # back onto a partition only a few layers are still queued on the all-SM stream
        works = tuple(
            PrefillWork(r.request_id, r.num_computed_tokens, chunk_end(r, self.max_prefill_tokens), layer,
                        min(layer + self.layers_per_step, sched.num_layers))
            for r, layer in sched.pending_prefills() if len(sched.inflight.get(r.request_id, ())) < self.MAX_QUEUED)
        # a fixed split while both phases run; executors without partitions ignore it
        return StepPlan(decode=decode, prefill=works,
                        decode_sms=self.decode_sms if decode and (works or sched.has_inflight()) else None)


class ChunkedPlanner:
    """Chunked prefill (Sarathi-Serve; the vLLM and SGLang default): every step decodes every running request, then
    fills what is left of a token budget with prefill chunks, oldest request first, and runs it all as one forward
    on all SMs. A smaller budget shortens the steps that carry prefill (lower TBT) and slows prefill (higher TTFT).
    """

    name = "chunked"

    def __init__(self, token_budget: int = 2048, max_prefill_tokens: int = 8192) -> None:
        if token_budget < 1:
            raise ValueError(f"token_budget must be >= 1, got {token_budget}")
        self.token_budget = token_budget
        self.max_prefill_tokens = max_prefill_tokens

    def plan(self, sched: Scheduler) -> StepPlan:
        decode = _reserve_all(sched, list(sched.decoding))
        budget = self.token_budget - len(decode)
        works: list[PrefillWork] = []

        def chunk(r: Request) -> None:
            nonlocal budget
            n = min(budget, r.num_tokens - r.num_computed_tokens)
            works.append(PrefillWork(r.request_id, r.num_computed_tokens, r.num_computed_tokens + n, 0,
                                     sched.num_layers))
            budget -= n

        for r, layer in sched.pending_prefills():
            if budget <= 0:
                break
            if layer == 0:  # a chunk still in flight on another executor stream is not cut again
                chunk(r)
        while budget > 0 and sched.waiting and sched.admit(sched.waiting[0]):
            chunk(sched.prefilling[-1])
        return StepPlan(decode=decode, prefill=tuple(works), mixed=bool(works))


PLANNERS = {"serial": SerialPlanner, "layerwise": LayerwisePlanner, "chunked": ChunkedPlanner}
