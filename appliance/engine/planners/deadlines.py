"""TTFT deadlines and the order in which waiting prompts are prefilled: each request's deadline from its class and
its uncached prompt, reordering by predicted prefill time when that breaks no one's deadline (Bullet), the fewest
requests moved to the back when not every deadline can be met (Moore-Hodgson), and the admission test that sheds a
request whose deadline cannot be met.
"""
from __future__ import annotations

import heapq
from itertools import groupby
from typing import Callable, Sequence

from appliance.engine.kv_cache import PagePool
from appliance.engine.request import Request
from appliance.predictor.shapes import PrefillItem
from appliance.slo.contract import ClassSLO, Contract

REORDER_WINDOW = 32  # waiting requests considered for reordering; the rest keep their order


class Deadlines:
    """Per-request class targets, prefill work and TTFT deadline (seconds on the scheduler's clock)."""

    def __init__(self, contract: Contract, pool: PagePool,
                 headroom: Callable[[str], float] | None = None) -> None:
        self.contract, self.pool = contract, pool
        self.headroom = headroom or (lambda name: 1.0)  # TTFT deadlines are planned at headroom x the target
        self._slos = {name: contract.slo_for(name) for name in contract.class_names()}
        self._slos[None] = self._slos[contract.default_class_name]  # a request of no class
        self._cached: dict[str, int] = {}  # prefix-cache hits estimated while a request waits

    def slo(self, r: Request) -> ClassSLO:
        return self._slos[r.slo_class or None]

    def _lookup(self, r: Request) -> int:
        """Tokens of a waiting request the prefix cache holds, as found on first sight."""
        if r.request_id not in self._cached:
            pages = self.pool.cached_prefix(r.all_token_ids, r.num_tokens, r.page_table)
            self._cached[r.request_id] = len(pages) * self.pool.page_size
        return self._cached[r.request_id]

    def item(self, r: Request) -> PrefillItem:
        """The request's remaining prefill work."""
        done = r.num_computed_tokens if r.page_table.pages else self._lookup(r)
        return PrefillItem(r.num_tokens - done, done)

    def deadline(self, r: Request, planned: bool = True) -> float:
        """When its first token is due: planned at the controller's headroom x the target, or (`planned=False`) the
        contract's own deadline; -inf for a request that already has output (a recomputation after a preemption: it
        is late by nature and goes first)."""
        if r.output_token_ids:
            return float("-inf")
        cached = r.num_cached_tokens if r.num_cached_tokens is not None else self._lookup(r)
        uncached = r.num_prompt_tokens - min(cached, r.num_prompt_tokens)
        slo = self.slo(r)
        return r.arrival_time + (self.headroom(slo.name) if planned else 1.0) * slo.ttft_target_ms(uncached) / 1000.0

    def forget(self, live: set[str]) -> None:
        """Drop estimates of requests that left the engine."""
        for rid in [rid for rid in self._cached if rid not in live]:
            del self._cached[rid]


def reorder(waiting: Sequence[Request], start: float, cost: Callable[[Request], float],
            deadline: Callable[[Request], float], priority: Callable[[Request], int],
            due: Callable[[Request], float] | None = None) -> list[Request]:
    """Serve order for waiting prefills, the first starting at `start` (seconds), by priority. Within a priority, when
    not every deadline can be met, the fewest requests that let the others meet theirs go last (`_moved_back`: served
    after the others, never dropped; judged by `due`, the contract's deadlines, where `deadline` is the planned one);
    the others go in arrival order, except that each next pick is the shortest (predicted `cost`, seconds) whose
    moving ahead makes no request it jumps over miss a deadline that request would have met in arrival order."""
    order = sorted(waiting, key=priority)  # stable: arrival order within a priority
    head, tail = order[:REORDER_WINDOW], order[REORDER_WINDOW:]
    out: list[Request] = []
    t = start
    for _, group in groupby(head, key=priority):
        group = list(group)
        late = _moved_back(group, t, cost, due or deadline)
        moved = {id(r) for r in late}
        for r in _shortest_safe([r for r in group if id(r) not in moved], t, cost, deadline) + late:
            out.append(r)
            t += cost(r)
    return out + tail


def _moved_back(group: list[Request], start: float, cost: Callable[[Request], float],
                deadline: Callable[[Request], float]) -> list[Request]:
    """Moore-Hodgson: in deadline order, whenever a request would finish after its deadline, the longest one so far
    moves back; what is left meets every deadline, and no smaller set moved back would do (one machine, the requests'
    predicted times). A preempted request (deadline -inf) is never moved. Returned in deadline order."""
    movable: list[tuple[float, int, Request]] = []  # the kept requests that may move, longest first (a heap)
    late: list[Request] = []
    t = start
    for i, r in enumerate(sorted(group, key=deadline)):
        t += cost(r)
        if deadline(r) != float("-inf"):
            heapq.heappush(movable, (-cost(r), i, r))  # ties: the earliest deadline moves
        if t > deadline(r) and movable:
            minus, _, longest = heapq.heappop(movable)
            late.append(longest)
            t += minus
    return sorted(late, key=deadline)


def _shortest_safe(queue: list[Request], t: float, cost: Callable[[Request], float],
                   deadline: Callable[[Request], float]) -> list[Request]:
    """Arrival order, but each next pick the shortest whose jump is safe (`_jump_is_safe`)."""
    head, out = list(queue), []
    while head:
        chosen = head[0]
        for c in sorted(head, key=cost):
            if c is head[0] or _jump_is_safe(head, c, t, cost, deadline):
                chosen = c
                break
        out.append(chosen)
        head.remove(chosen)
        t += cost(chosen)
    return out


def _jump_is_safe(queue: Sequence[Request], c: Request, t: float, cost: Callable[[Request], float],
                  deadline: Callable[[Request], float]) -> bool:
    extra = cost(c)
    for r in queue:
        if r is c:
            return True
        if deadline(r) == float("-inf"):
            return False  # a preempted request recomputing its tokens: its stream is stalled, nobody passes it
        t += cost(r)
        if t <= deadline(r) < t + extra:  # met in arrival order, missed behind c
            return False
    return True
