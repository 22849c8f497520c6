"""The `layerwise` policy: every step decodes and advances the prefills a fixed number of layers on a fixed SM
split."""
from __future__ import annotations

from appliance.engine.plan import PrefillWork, StepPlan
from appliance.engine.planners.base import Planner, admit_fcfs, chunk_end, reserve_all
from appliance.engine.scheduler import Scheduler


class LayerwisePlanner(Planner):
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
        decode = reserve_all(sched, list(sched.decoding))
        if not sched.prefilling:
            admit_fcfs(sched, self.max_prefill_tokens)
        # at most MAX_QUEUED launches in flight per request: the prefill stream stays busy, and when decode moves
        # back onto a partition only a few layers are still queued on the all-SM stream
        works = tuple(
            PrefillWork(r.request_id, r.num_computed_tokens, chunk_end(r, self.max_prefill_tokens), layer,
                        min(layer + self.layers_per_step, sched.num_layers))
            for r, layer in sched.pending_prefills() if len(sched.inflight.get(r.request_id, ())) < self.MAX_QUEUED)
        # a fixed split while both phases run; executors without partitions ignore it
        return StepPlan(decode=decode, prefill=works,
                        decode_sms=self.decode_sms if decode and (works or sched.has_inflight()) else None)
