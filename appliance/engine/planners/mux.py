"""The `mux` planner: every step, from the SLO contract and the latency predictor, decides how decode and prefill
share the GPU. Decode gets the smallest partition whose worst-case step meets the TBT target and prefill the rest,
advancing ceil(T_decode * L / T_prefill) layers per step (MuxWise); a mixed batch on all SMs when that already meets
TBT (DuetServe); with `mixed_chunks`, a chunk of prompt tokens sized to the TBT target beside the decode rows on all
SMs, earliest deadline first, when that prefills faster than the split would (adaptive chunked prefill); with
`temporal` (on by default), the decode rows and then as many prefill layers as the target leaves room for, both on
all SMs, when that prefills faster than the split would (temporal multiplexing); shedding per the contract. Which
prompts prefill together, in what order, and when a short one pauses a long one is mux_batches.py's.

Prefill may be asynchronous: layers launched in one step can still run steps later. The planner reads what is in
flight from the scheduler (`pass_layer`, `pass_start`) and never relaunches it. A prompt prefills in passes of at
most `chunk_tokens` tokens (the engine's max_num_batched_tokens: what its activation memory is sized for), each
through every layer and launched as soon as the last pass has every layer launched.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field

from appliance.engine.plan import PrefillWork, StepPlan
from appliance.engine.planners.base import reserve_all
from appliance.engine.planners.control import ClassControl, class_control
from appliance.engine.planners.deadlines import Deadlines
from appliance.engine.planners.mux_batches import PAUSE_CANDIDATES, MuxBatches
from appliance.engine.request import Request
from appliance.engine.scheduler import Scheduler
from appliance.predictor.predictor import Predictor
from appliance.predictor.shapes import DecodeLoad, PrefillItem, decode_load
from appliance.slo.contract import Contract


@dataclass
class MuxOptions:
    max_prefill_tokens: int = 8192  # prompt tokens prefilled together as one layer-wise batch
    chunk_tokens: int | None = None  # a prompt's tokens in one layer-wise pass at most (a longer one prefills in
    #                                  passes of this many: the engine sizes activation memory for them); None: all
    control: bool = True            # closed-loop: plan to the controllers' headroom x the targets (control.py)
    prefill_pause: bool = True      # a short prompt may pause the running batch between layers (MuxWise)
    pause_margin: float = 0.2       # ... when it would miss its TTFT behind the batch with their predicted prefill
    #                                 times this much longer (prefill launches run 1.0-1.35x their figure serving)
    reorder: bool = True
    inflight_steps: float = 3.0     # prefill kept queued on its stream, in predicted decode steps
    growth_tokens: int = 1024       # KV kept free for each running request's next output tokens
    mixed_chunks: bool = False      # chunks of the prompt beside decode on all SMs when they prefill faster
    chunk_tbt: float = 0.8          # such a mixed step is planned to this fraction of the TBT target
    temporal: bool = True           # decode, then prefill layers, both on all SMs, when that prefills faster


@dataclass
class MuxStats:
    """What the planner decided so far (for metrics and tests)."""

    spatial_steps: int = 0
    aggregated_steps: int = 0
    chunk_steps: int = 0
    temporal_steps: int = 0
    decode_only_steps: int = 0
    prefill_only_steps: int = 0
    pauses: int = 0  # batches paused between layers for a more urgent prompt
    drain_steps: int = 0  # temporal: decode alone while the split's queued prefill drains
    shed: int = 0
    last_mode: str = ""
    decode_sms: Counter = field(default_factory=Counter)  # spatial steps per decode partition


class MuxPlanner:
    name = "mux"

    def __init__(self, contract: Contract, predictor: Predictor, options: MuxOptions | None = None) -> None:
        self.contract, self.predictor = contract, predictor
        self.options = options or MuxOptions()
        self.stats = MuxStats()
        self._deadlines: Deadlines | None = None
        self._steps = 0
        self.controls: dict[str, ClassControl] = {}  # per SLO class: the TBT and TTFT tail controllers
        self.batches = MuxBatches(predictor, self.options, self.stats, self._dl)

    # ---- per step ---------------------------------------------------------------------------------------------
    def plan(self, sched: Scheduler) -> StepPlan:
        dl = self._dl(sched)
        self._steps += 1
        if self._steps % 256 == 0:
            dl.forget(set(sched.requests))
        decode = reserve_all(sched, list(sched.decoding))
        batches = self.batches
        batches.tidy(sched)
        now = sched.clock()
        if not batches.batch:
            batches.start(sched, now)
        elif self.options.prefill_pause and not batches.paused:
            batches.maybe_pause(sched, now)
        load = self._load(sched, decode)
        tbt = self._tbt_ms(sched, decode)
        batch = [sched.requests[rid] for rid in batches.batch]
        if not batch:
            return self._decode_only(sched, decode, load, tbt)
        start = sched.pass_layer(batch[0])
        items = [self._item(sched, r) for r in batch]
        if not decode:
            return self._prefill_all_sms(sched, batch, start, items, tbt)
        if start == 0 and not sched.has_inflight() and \
                self.predictor.host.gap(load.batch_size, self.predictor.mixed_ms(items, load)) <= tbt:
            self.stats.aggregated_steps += 1
            self.stats.last_mode = "aggregated"
            return StepPlan(decode=decode, prefill=self._works(sched, batch, 0, self.predictor.num_layers),
                            mixed=True)
        if self.options.mixed_chunks and start == 0 and not sched.has_inflight():
            chunk = self._chunk(sched, decode, load, batch, items, tbt)
            if chunk is not None:
                return chunk
        if self.options.temporal:
            if not sched.has_inflight():
                temporal = self._temporal(sched, decode, load, batch, start, items, tbt)
                if temporal is not None:
                    return temporal
            elif self._temporal_layers(load, start, items, tbt):
                # the split's queue drains first (it runs meanwhile): topped up, it would keep every later step on
                # the split, which this batch would advance slower on
                self.stats.drain_steps += 1
                return self._decode_only(sched, decode, load, tbt)
        return self._spatial(sched, decode, load, batch, start, items, tbt)

    def _decode_only(self, sched: Scheduler, decode: tuple[str, ...], load: DecodeLoad, tbt: float) -> StepPlan:
        self.stats.decode_only_steps += bool(decode)
        self.stats.last_mode = "decode"
        if decode and sched.has_inflight():  # prefill layers still run on their partition: decode keeps to its own
            d = self._decode_partition(load, self._inflight_items(sched), tbt) or self.predictor.decode_partitions[-1]
            return StepPlan(decode=decode, decode_sms=d, prefill_sms=self.predictor.sm_count - d)
        return StepPlan(decode=decode)

    def _prefill_all_sms(self, sched: Scheduler, batch: list[Request], start: int, items: list[PrefillItem],
                         tbt: float) -> StepPlan:
        """No decode: prefill on all SMs in chunks of about one planning target, launched without waiting but never
        more than one queued behind the one running, and none behind a launch that completes a prompt (an empty plan
        waits for the oldest launch). Kernels launched on every SM hold them all until they end: a completed prompt's
        first decode step would wait behind them (its first gap), and an arriving prompt can pause the batch only
        after them."""
        p = self.predictor
        if self._queued_ms(sched) > tbt * (1 + 1e-9) or self._completes_prompt(sched):
            self.stats.last_mode = "wait"
            return StepPlan()
        per_layer = p.prefill_ms(items) / p.num_layers
        k = max(1, min(p.num_layers - start, int(tbt // per_layer) if per_layer > 0 else p.num_layers))
        self.stats.prefill_only_steps += 1
        self.stats.last_mode = "prefill"
        self.batches.prefill_sms = p.sm_count
        return StepPlan(prefill=self._works(sched, batch, start, start + k))

    def _spatial(self, sched: Scheduler, decode: tuple[str, ...], load: DecodeLoad, batch: list[Request], start: int,
                 items: list[PrefillItem], tbt: float) -> StepPlan:
        p = self.predictor
        d = self._decode_partition(load, items, tbt)
        if d is None:  # no split holds TBT beside this prefill: decode alone on all SMs, prefill waits a step
            return self._decode_only(sched, decode, load, tbt)
        self.stats.spatial_steps += 1
        self.stats.last_mode = "spatial"
        self.stats.decode_sms[d] += 1
        self.batches.prefill_sms = p.sm_count - d
        queued = sum(w.layer_end - w.layer_start for w in sched.inflight.get(batch[0].request_id, ()))
        t_decode = p.decode_ms(load, d, items)
        t_prefill = p.prefill_ms(items, p.sm_count - d)
        works: tuple[PrefillWork, ...] = ()
        # keep the prefill stream fed for about `inflight_steps` decode steps: chunks cut short by the host's launch
        # room queue deeper than chunks that fill a step, and none queues so deep that a pause waits long
        if t_prefill * queued / p.num_layers < self.options.inflight_steps * t_decode:
            k = math.ceil(t_decode * p.num_layers / t_prefill) if t_prefill > 0 else p.num_layers
            # the host launches these layers while decode runs: no more than the step can hide within the target
            fixed, per_layer = p.host.launch_costs(sum(i.new for i in items))
            room = p.host.launch_room(load.batch_size, t_decode, tbt) - fixed
            if per_layer > 0:
                k = min(k, int(room // per_layer))
            works = self._works(sched, batch, start, min(p.num_layers, start + max(1, k)))
        return StepPlan(decode=decode, prefill=works, decode_sms=d, prefill_sms=p.sm_count - d)

    def _temporal_layers(self, load: DecodeLoad, start: int, items: list[PrefillItem], tbt: float) -> int:
        """How many of the batch's next layers a temporal step runs: as many as the step's gap (the decode rows on
        all SMs, then the layers on all SMs) holds within the planning target, when that advances the batch faster
        (layers per ms of gap) than the split would beside decode; 0 when the split is faster or no layer fits.
        The split advances the batch by what its prefill SMs compute during the decode step, but never past the
        batch's last layer: the step lasts as long as its decode rows on their partition, however few layers are
        left (the next batch starts at the next step), where a temporal step's gap shrinks with its layers. Both
        steps' gaps include the host launching their layers."""
        p = self.predictor
        t_decode = p.decode_ms(load)
        per_layer = p.prefill_ms(items) / p.num_layers
        if per_layer <= 0:
            return 0
        tokens = sum(i.new for i in items)

        def gap(layers: int) -> float:  # the host launches the layers too: their launches hide within the gap
            return p.host.gap(load.batch_size, t_decode + layers * per_layer, layers, tokens)

        k = min(p.num_layers - start, int((p.host.device_room(load.batch_size, tbt) - t_decode) // per_layer))
        while k > 0 and gap(k) > tbt:
            k -= 1
        if k < 1:
            return 0
        d = self._decode_partition(load, items, tbt)
        if d is not None:
            t_split = p.decode_ms(load, d, items)
            split = min(p.num_layers - start,
                        p.host.gap(load.batch_size, t_split) * p.num_layers / p.prefill_ms(items, p.sm_count - d))
            step = p.host.gap(load.batch_size, t_split, split, tokens)  # the host launches the split's layers too
            # where the host's launches set both steps' length the two advance alike: a tie (to rounding) goes to
            # decode on all SMs, none of it beside prefill
            if split / step > (1 + 1e-9) * k / gap(k):
                return 0
        return k

    def _temporal(self, sched: Scheduler, decode: tuple[str, ...], load: DecodeLoad, batch: list[Request], start: int,
                  items: list[PrefillItem], tbt: float) -> StepPlan | None:
        """Temporal multiplexing (`_temporal_layers`); None when the split is faster or no layer fits."""
        k = self._temporal_layers(load, start, items, tbt)
        if k < 1:
            return None
        p = self.predictor
        self.stats.temporal_steps += 1
        self.stats.last_mode = "temporal"
        self.batches.prefill_sms = p.sm_count
        return StepPlan(decode=decode, prefill=self._works(sched, batch, start, start + k), prefill_after_decode=True)

    def _chunk(self, sched: Scheduler, decode: tuple[str, ...], load: DecodeLoad, batch: list[Request],
               items: list[PrefillItem], tbt: float) -> StepPlan | None:
        """Adaptive chunked prefill: as many of the batch's tokens as a mixed step with the decode rows is predicted
        to take within `chunk_tbt` x TBT, when they go faster that way than the batch would on the split beside
        decode (None when the split is faster, or decode needs all SMs). The chunk takes its tokens earliest TTFT
        deadline first, from the batch and the most urgent waiting prompts (which join the batch), and is sized by the
        mixed step of those very chunks (their contexts differ)."""
        p, dl = self.predictor, self._dl(sched)
        d = self._decode_partition(load, items, tbt)
        if d is None:
            return None
        total = sum(i.new for i in items)
        limit = p.host.device_room(load.batch_size, self.options.chunk_tbt * tbt)
        queue = [(r, dl.item(r)) for r in sorted(batch + self.batches.order(sched, sched.clock())[:PAUSE_CANDIDATES],
                                                 key=dl.deadline)]

        def fill(budget: int) -> list[tuple[Request, PrefillItem]]:
            """`budget` tokens, earliest deadline first: each prompt and its chunk (its tokens, the context before)."""
            out, left = [], budget
            for r, item in queue:
                n = min(left, item.new)
                if n > 0:
                    out.append((r, PrefillItem(n, item.reused)))
                    left -= n
            return out

        def mixed_ms(budget: int) -> float:  # the mixed step of that chunk, as it would run
            return p.mixed_ms([item for _, item in fill(budget)], load)

        lo, hi = 0, total  # the largest chunk that fits: mixed_ms(lo) <= limit (or lo is 0)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if mixed_ms(mid) <= limit:
                lo = mid
            else:
                hi = mid - 1
        if lo < 1 or lo / mixed_ms(lo) <= total / p.prefill_ms(items, p.sm_count - d):
            return None
        works = []
        for r, item in fill(lo):
            if r not in batch:
                if not self.batches.admit(sched, r):
                    continue  # (its tokens stay out of this chunk: the step only gets shorter)
                self.batches.batch.append(r.request_id)
            start = r.num_computed_tokens
            works.append(PrefillWork(r.request_id, start, min(start + item.new, r.num_tokens), 0, p.num_layers))
        if not works:
            return None
        self.batches.chunked.update(w.request_id for w in works)
        self.stats.chunk_steps += 1
        self.stats.last_mode = "chunk"
        return StepPlan(decode=decode, prefill=tuple(works), mixed=True)

    def _decode_partition(self, load: DecodeLoad, items: list[PrefillItem], tbt: float) -> int | None:
        """The smallest decode partition whose worst-case step beside `items` meets `tbt`; when none does, None if
        decode alone on all SMs would, else the largest partition (the best that can be done)."""
        p = self.predictor
        host = p.host  # every gap carries the step's host time too (hidden behind the device when overlapped)
        for d in p.decode_partitions:
            if host.gap(load.batch_size, p.decode_ms(load, d, items)) <= tbt:
                return d
        if host.gap(load.batch_size, p.decode_ms(load)) <= tbt:
            return None
        return p.decode_partitions[-1]

    # ---- helpers ----------------------------------------------------------------------------------------------
    def _works(self, sched: Scheduler, batch: list[Request], start: int, end: int) -> tuple[PrefillWork, ...]:
        """Layers [start, end) of the batch's current pass: each prompt's tokens from the pass's first, cut at
        chunk_tokens (a pass's token range stays fixed while its layers run)."""
        return tuple(PrefillWork(r.request_id, *self._pass(sched, r), start, end) for r in batch)

    def _item(self, sched: Scheduler, r: Request) -> PrefillItem:
        """The request's current pass as the predictor sees it: its tokens and the context before them."""
        first, last = self._pass(sched, r)
        return PrefillItem(last - first, first)

    def _pass(self, sched: Scheduler, r: Request) -> tuple[int, int]:
        """The token range [first, last) of the request's current pass: from the pass's first token, the rest of the
        prompt cut at chunk_tokens."""
        first, cap = sched.pass_start(r), self.options.chunk_tokens
        return first, r.num_tokens if cap is None else min(r.num_tokens, first + cap)

    def _dl(self, sched: Scheduler) -> Deadlines:
        if self._deadlines is None or self._deadlines.pool is not sched.pool:
            self._deadlines = Deadlines(self.contract, sched.pool, lambda name: self.control(name).ttft.headroom)
        return self._deadlines

    def control(self, name: str) -> ClassControl:
        """The tail controllers of an SLO class (made on first use)."""
        if name not in self.controls:
            slo = self.contract.slo_for(name)
            self.controls[name] = class_control(slo.tbt_percentile, slo.ttft_percentile)
            if not self.options.control:  # open loop: plan to the targets themselves, whatever clients see
                for c in (self.controls[name].tbt, self.controls[name].ttft):
                    c.headroom = c.min_headroom = c.max_headroom = 1.0
        return self.controls[name]

    def _load(self, sched: Scheduler, decode: tuple[str, ...]) -> DecodeLoad:
        return decode_load(sched.requests, decode)

    def _tbt_ms(self, sched: Scheduler, decode: tuple[str, ...]) -> float:
        """The decode batch's planning target: the tightest of its classes' TBT targets, each times its
        controller's headroom."""
        dl = self._dl(sched)
        slos = {slo.name: slo for slo in (dl.slo(sched.requests[rid]) for rid in decode)}
        if not slos:
            default = self.contract.slo_for(None)
            slos = {default.name: default}
        return min(slo.tbt_ms * self.control(name).tbt.headroom for name, slo in slos.items())

    def _queued_ms(self, sched: Scheduler) -> float:
        """The predicted time, on all SMs, of the prefill launched and not complete yet (each launch whole, the one
        running too); works of one layer range count as one launch."""
        p = self.predictor
        launches: dict[tuple[int, int], list[PrefillItem]] = {}
        for works in sched.inflight.values():
            for w in works:
                launches.setdefault((w.layer_start, w.layer_end), []).append(PrefillItem(w.num_tokens, w.token_start))
        return sum(p.prefill_ms(items) * (end - start) / p.num_layers for (start, end), items in launches.items())

    def _completes_prompt(self, sched: Scheduler) -> bool:
        """Whether prefill in flight ends a prompt (its request decodes next)."""
        num_layers = self.predictor.num_layers
        return any(w.layer_end >= num_layers and rid in sched.requests and w.token_end >= sched.requests[rid].num_tokens
                   for rid, works in sched.inflight.items() for w in works)

    def _inflight_items(self, sched: Scheduler) -> list[PrefillItem]:
        """The prefill passes in flight, each request's latest."""
        return [PrefillItem(works[-1].num_tokens, works[-1].token_start) for rid, works in sched.inflight.items()
                if works and rid in sched.requests]

    def observe_decode(self, load: DecodeLoad, decode_sms: int, concurrent: list[PrefillItem] | tuple,
                       measured_ms: float) -> None:
        """An executor's measured decode step beside prefill work: online refinement of the contention guard."""
        self.predictor.observe_decode(load, decode_sms, concurrent, measured_ms)

    def observe_prefill(self, items: list[PrefillItem], layers: int, prefill_sms: int, measured_ms: float) -> None:
        """Prefill layers measured on a partition beside decode: online refinement of the split slowdown."""
        self.predictor.observe_prefill(items, layers, prefill_sms, measured_ms)

    def observe_mixed(self, items: list[PrefillItem], load: DecodeLoad, measured_ms: float) -> None:
        """A mixed step measured on all SMs: online refinement of what mixed steps cost while serving."""
        self.predictor.observe_mixed(items, load, measured_ms)

    def observe_full(self, items: list[PrefillItem], layers: int, measured_ms: float) -> None:
        """Prefill layers measured on all SMs after decode: online refinement of what they cost while serving."""
        self.predictor.observe_full(items, layers, measured_ms)

    def observe_launch(self, launches: int, layers: int, measured_ms: float, graphs: bool = False) -> None:
        """Prefill launches timed on the host while serving: online refinement of the host's per-layer time."""
        self.predictor.observe_launch(launches, layers, measured_ms, graphs)

    def observe_tokens(self, gaps: list[tuple[Request, float]], first: list[tuple[Request, float]]) -> None:
        """What clients see, per SLO class, as fractions of the class's targets: the controllers' input."""
        dl = self._deadlines
        if dl is None:
            return
        by_class: dict[str, tuple[list[float], list[float]]] = {}
        for r, seconds in gaps:
            slo = dl.slo(r)
            by_class.setdefault(slo.name, ([], []))[0].append(seconds * 1e3 / slo.tbt_ms)
        for r, seconds in first:
            slo = dl.slo(r)
            target = slo.ttft_target_ms(r.num_uncached_prompt_tokens)
            by_class.setdefault(slo.name, ([], []))[1].append(seconds * 1e3 / target)
        for name, (g, f) in by_class.items():
            self.control(name).observe(g, f)

    def control_state(self) -> dict[str, dict[str, dict]]:
        return {name: {"tbt": c.tbt.state(), "ttft": c.ttft.state()} for name, c in self.controls.items()}

    def headrooms(self) -> dict[str, float]:
        return {name: round(c.tbt.headroom, 4) for name, c in self.controls.items()}

    def snapshot(self) -> dict:
        """What the planner decided and learned online so far (a replay's result JSON keeps it): its step counts,
        and the split, mixed-step and all-SM prefill factors it plans with, with how many measured launches or steps
        they hold."""
        p = self.predictor
        stats = asdict(self.stats)
        stats["decode_sms"] = {str(k): v for k, v in sorted(self.stats.decode_sms.items())}
        return {"stats": stats, "contention_cells": len(p.guard.observations),
                "control": self.control_state(),
                "host": {"launch_ms": p.host.launch_ms, "per_layer_ms": p.host.per_layer_ms,
                         "launches": len(p.launches.windows[False]), "graph_launch_ms": p.host.graph_launch_ms,
                         "graph_per_layer_ms": p.host.graph_per_layer_ms,
                         "graph_launches": len(p.launches.windows[True])},
                **{
            name: {"flat": model.flat, "per_1k": model.per_1k, "observations": len(model.window)}
            for name, model in (("split", p.split), ("mixed", p.mixed), ("full", p.full))}}

    # ---- admission --------------------------------------------------------------------------------------------
    def admission_check(self, sched: Scheduler, request: Request) -> float | None:
        """None to accept the request; else the Retry-After (seconds) of shedding it, when the contract says shed
        and its predicted first token misses its TTFT deadline."""
        if self.contract.overload.mode != "shed":
            return None
        dl, now = self._dl(sched), sched.clock()
        own = self.predictor.prefill_ms([dl.item(request)], self.batches.prefill_sms) / 1e3
        deadline = dl.deadline(request)
        wait = self.batches.wait_before(sched, request, own)
        if now + wait + own <= deadline or now + own > deadline:
            return None  # on time, or late even on an idle GPU: refusing would not help it, it is served late
        self.stats.shed += 1
        return self.contract.overload.retry_after_s or max(1.0, wait)
