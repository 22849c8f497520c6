"""The `serial` policy: prefill first, as vLLM's classic scheduler."""
from __future__ import annotations

from appliance.engine.plan import PrefillWork, StepPlan
from appliance.engine.planners.base import Planner, admit_fcfs, chunk_end, reserve_all
from appliance.engine.scheduler import Scheduler


class SerialPlanner(Planner):
    """Prefill first: prompts through all layers before any decode step (vLLM's classic default), in chunks of at
    most max_prefill_tokens new tokens per step."""

    name = "serial"

    def __init__(self, max_prefill_tokens: int = 8192) -> None:
        self.max_prefill_tokens = max_prefill_tokens

    def plan(self, sched: Scheduler) -> StepPlan:
        admit_fcfs(sched, self.max_prefill_tokens)
        works, budget = [], self.max_prefill_tokens
        for r, layer in sched.pending_prefills():  # oldest first, within the step's token budget (one at least)
            if works and budget <= 0:
                break
            end = chunk_end(r, max(budget, 1))
            works.append(PrefillWork(r.request_id, r.num_computed_tokens, end, layer, sched.num_layers))
            budget -= end - r.num_computed_tokens
        if works:
            return StepPlan(prefill=tuple(works))
        return StepPlan(decode=reserve_all(sched, list(sched.decoding)))
