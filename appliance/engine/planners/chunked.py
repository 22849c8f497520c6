"""The `chunked` policy: Sarathi-style chunked prefill under a token budget, the vLLM and SGLang default."""
from __future__ import annotations

from appliance.engine.plan import PrefillWork, StepPlan
from appliance.engine.planners.base import Planner, reserve_all
from appliance.engine.request import Request
from appliance.engine.scheduler import Scheduler


class ChunkedPlanner(Planner):
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
        decode = reserve_all(sched, list(sched.decoding))
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
