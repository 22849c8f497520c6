"""The `pdmux` planner: SGLang's PD-multiplexing policy (python/sglang/srt/multiplex/, `event_loop_pdmux` and
`adjust_stream_groups`) reproduced on muxd's mechanism, the nearest peer's policy as a baseline for `mux`. It owns the
step loop's decisions; the stream groups and the group choice are in `pdmux_groups.py`.

What it reproduces, step by step as SGLang's loop runs (one loop iteration = one muxd step):
- Stream groups fixed at start-up: all-prefill, SGLang's divisions (its `divide_sm` rule, or --pdmux-divisions),
  all-decode; each division runs on the muxd partition nearest its decode SMs (pdmux_groups.py says how).
- One prefill batch at a time (`split_prefill_batch`), formed only when none exists, as SGLang's `PrefillAdder` forms
  one with chunked prefill off (pdmux requires it): waiting requests in arrival order (fcfs, SGLang's default
  schedule policy), the first always, the next while its paged uncached tokens fit what is left of the prefill token
  budget; none when its prompt plus min(max_tokens, 4096) output tokens would not fit the free KV less the running
  requests' remaining output times `new_token_ratio` (0.7, decaying to 0.098 over 600 decode steps, re-estimated on a
  retraction, reset when idle).
- The group re-chosen only when a prefill batch forms or finishes, or decode empties on a split group, after both
  streams are synchronised (a step that waits for every launched prefill layer and runs nothing); chosen by the decode
  batch size alone (`choose_group`).
- The prefill batch advances forward_count = max(1, split_forward_token_budget // its uncached tokens) layers every
  step, launched without waiting for the previous ones (the prefill stream queues them), beside the decode step.
- No predictor, no preemption of prefills, no SLO contract: nothing here reads a latency or a deadline.

Where muxd's mechanism differs: the prefill token budget is --max-num-batched-tokens (SGLang's --max-prefill-tokens,
16384 there; the engine sizes its activations by it) and a prompt longer than it runs as several batches of one chunk
each (SGLang runs it whole); KV pressure preempts the youngest running request (the scheduler's mechanism; SGLang
retracts decode requests).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

from appliance.engine.plan import PrefillWork, StepPlan
from appliance.engine.planners.base import Planner, chunk_end, reserve_all
from appliance.engine.planners.pdmux_groups import StreamGroup, choose_group, stream_groups
from appliance.engine.request import Request, RequestStatus
from appliance.engine.scheduler import Scheduler

CLIP_MAX_NEW_TOKENS = 4096     # SGLang's clip of max_new_tokens in its KV estimates
INIT_NEW_TOKEN_RATIO = 0.7     # SGLANG_INIT_NEW_TOKEN_RATIO (x schedule_conservativeness 1.0)
MIN_NEW_TOKEN_RATIO = INIT_NEW_TOKEN_RATIO * 0.14  # SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR
NEW_TOKEN_RATIO_DECAY = (INIT_NEW_TOKEN_RATIO - MIN_NEW_TOKEN_RATIO) / 600  # SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS
RETRACT_DECODE_STEPS = 20      # SGLANG_RETRACT_DECODE_STEPS


@dataclass(frozen=True)
class PdmuxOptions:
    sm_group_num: int = 8                        # SGLang's sm_group_num
    divisions: tuple[tuple[int, int, int], ...] = ()  # SGLang's manual_divisions (prefill SMs, decode SMs, min batch)
    decode_bs_divisor: int = 36                  # SGLang's decode_bs_divisor
    split_forward_token_budget: int = 65536      # SGLang's split_forward_token_budget
    max_prefill_tokens: int = 8192               # a prefill batch's token budget (SGLang's max_prefill_tokens)


@dataclass
class PdmuxStats:
    """What the planner decided so far (for metrics and tests)."""

    batches: int = 0    # prefill batches formed
    switches: int = 0   # group changes
    syncs: int = 0      # steps spent waiting for both streams before a group change
    retractions: int = 0
    steps: Counter = field(default_factory=Counter)  # steps per group index


@dataclass
class _Batch:
    """SGLang's split prefill batch: each member's token range, its uncached tokens, the next layer to launch."""

    ranges: dict[str, tuple[int, int]]
    extend_tokens: int
    split_index: int = 0


class PdmuxPlanner(Planner):
    name = "pdmux"

    def __init__(self, options: PdmuxOptions, total_sms: int, decode_partitions: Sequence[int]) -> None:
        self.options = options
        self.total_sms = total_sms
        self.groups: list[StreamGroup] = stream_groups(total_sms, decode_partitions, options.sm_group_num,
                                                       options.divisions)
        self.group = 0          # SGLang starts on the all-prefill group
        self.batch: _Batch | None = None
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.stats = PdmuxStats()
        self._adjust = False    # a group change is due (SGLang's adjust_stream_group flag)

    # ---- per step ---------------------------------------------------------------------------------------------
    def plan(self, sched: Scheduler) -> StepPlan:
        decode = self._decode(sched)
        if self.batch is not None and self._batch_done(sched):
            self.batch, self._adjust = None, True  # merged into the running batch: re-choose
        if self.batch is None and self._form_batch(sched):
            self._adjust = True
        if (self.group > 0) != bool(decode):  # decode emptied on a split; or decode came, not from a prefill
            self._adjust = True                 # batch of this planner's (SGLang cannot get there)
        if not decode and self.batch is None:
            self.new_token_ratio = INIT_NEW_TOKEN_RATIO  # idle: SGLang resets its estimate
        if self._adjust:
            if sched.has_inflight():  # both streams synchronised first: launch nothing until every layer has run
                self.stats.syncs += 1
                return StepPlan()
            group = choose_group(self.groups, len(decode), self.batch is not None, self.options.decode_bs_divisor)
            self.stats.switches += group != self.group
            self.group, self._adjust = group, False
        self.stats.steps[self.group] += 1
        g = self.groups[self.group]
        works = self._launch(sched)
        if self.group == 0:  # all-prefill: the prefill stream on every SM, queued like a partition's
            return StepPlan(decode=decode, prefill=works, prefill_sms=g.prefill_sms)
        if self.group == len(self.groups) - 1:  # all-decode
            return StepPlan(decode=decode, prefill=works)
        return StepPlan(decode=decode, prefill=works, decode_sms=g.decode_sms, prefill_sms=g.prefill_sms)

    def forward_count(self, extend_tokens: int, num_layers: int) -> int:
        """Layers a prefill batch of `extend_tokens` uncached tokens advances per step."""
        if extend_tokens <= 0:
            return num_layers
        return max(1, self.options.split_forward_token_budget // extend_tokens)

    def _launch(self, sched: Scheduler) -> tuple[PrefillWork, ...]:
        """The batch's next forward_count layers, for every member still prefilling its range."""
        b, layers = self.batch, sched.num_layers
        if b is None or b.split_index >= layers:
            return ()
        end = min(b.split_index + self.forward_count(b.extend_tokens, layers), layers)
        works = tuple(PrefillWork(rid, start, stop, b.split_index, end) for rid, (start, stop) in b.ranges.items()
                      if self._member(sched, rid, start))
        b.split_index = end
        return works

    def _member(self, sched: Scheduler, rid: str, start: int) -> bool:
        """The request is still prefilling the range its batch gave it (not finished, aborted or preempted)."""
        r = sched.requests.get(rid)
        return r is not None and r.status is RequestStatus.PREFILLING and r.num_computed_tokens == start

    def _batch_done(self, sched: Scheduler) -> bool:
        """Every layer of the batch has run (SGLang: its last launch's event fired), or its members all left."""
        b = self.batch
        assert b is not None
        if any(rid in sched.inflight for rid in b.ranges):
            return False
        return b.split_index >= sched.num_layers or not any(
            self._member(sched, rid, start) for rid, (start, _) in b.ranges.items())

    # ---- the running batch ------------------------------------------------------------------------------------
    def _decode(self, sched: Scheduler) -> tuple[str, ...]:
        """Reserve every decode slot (SGLang's update_running_batch): its KV estimate decays a step, or is re-estimated
        from the survivors when KV pressure took requests away."""
        before = [r for r in sched.decoding if not r.exhausted]  # (those finish once their last token is read)
        decode = reserve_all(sched, before)
        if len(decode) < len(before):
            self.stats.retractions += 1
            left = [sched.requests[rid] for rid in decode]
            done = sum(len(r.output_token_ids) for r in left)
            self.new_token_ratio = min(1.0, (done + RETRACT_DECODE_STEPS * len(left))
                                       / (sum(r.sampling.max_tokens for r in left) + 1))
        elif decode:
            self.new_token_ratio = max(self.new_token_ratio - NEW_TOKEN_RATIO_DECAY, MIN_NEW_TOKEN_RATIO)
        return decode

    # ---- prefill batches --------------------------------------------------------------------------------------
    def _form_batch(self, sched: Scheduler) -> bool:
        """A new prefill batch, as SGLang's PrefillAdder forms one without chunked prefill (see the module's
        docstring); a prompt's next chunk, when one was cut at the token budget, goes first and alone."""
        budget = self.options.max_prefill_tokens
        for r, layer in sched.pending_prefills():
            if layer == 0:
                return self._start(sched, [(r, chunk_end(r, budget))])
        if not sched.waiting:
            return False
        pool = sched.pool
        page = pool.page_size
        rem_total = pool.num_free_pages * page - sum(
            _max_new(r) * self.new_token_ratio for r in sched.decoding)
        rem_input = budget
        idle = not sched.decoding and not sched.prefilling
        chosen: list[tuple[Request, int]] = []
        for r in list(sched.waiting):
            cached = len(pool.cached_prefix(r.all_token_ids, r.num_tokens, r.page_table)) * page
            extend = r.num_tokens - cached
            paged = -(-extend // page) * page
            if extend + _max_new(r) + page >= rem_total and not (idle and not chosen):
                break  # no room for it in the KV estimate (an idle engine takes its first request regardless)
            if chosen and paged >= rem_input:
                break  # the batch's token budget (the first request always goes in)
            if not sched.admit(r):
                break
            chosen.append((r, chunk_end(r, budget)))
            rem_total -= paged + _max_new(r)
            rem_input -= paged
            if rem_total <= 0 or rem_input <= 0:
                break
        return self._start(sched, chosen)

    def _start(self, sched: Scheduler, members: list[tuple[Request, int]]) -> bool:
        if not members:
            return False
        ranges = {r.request_id: (r.num_computed_tokens, end) for r, end in members}
        self.batch = _Batch(ranges, sum(end - start for start, end in ranges.values()))
        self.stats.batches += 1
        return True

    def snapshot(self) -> dict[str, Any]:
        """The stream groups (SGLang's SMs -> muxd's partition) and the decisions so far."""
        return {"groups": [g.describe() for g in self.groups],
                "stats": {"batches": self.stats.batches, "switches": self.stats.switches, "syncs": self.stats.syncs,
                          "retractions": self.stats.retractions,
                          "steps_per_group": {str(k): v for k, v in sorted(self.stats.steps.items())}}}


def _max_new(r: Request) -> int:
    """Output tokens SGLang's estimate reserves for a request: what it may still generate, clipped."""
    return min(max(r.sampling.max_tokens - len(r.output_token_ids), 0), CLIP_MAX_NEW_TOKENS)
