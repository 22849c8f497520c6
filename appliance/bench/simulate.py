"""The simulated executor: runs any planner against a trace on a CPU, with the real Scheduler, page pool and prefix
cache but no model, advancing virtual time from a step timer (a Predictor, or a known function standing in for
the GPU) instead of running kernels.

It executes plans the way the multiplex executor will: a plan with partitions runs its decode step on the decode
SMs while its prefill layers queue on the prefill stream and complete later (decode slowed by contention while
the stream is busy); for a policy served on SM partitions, prefill alone without partitions queues on all SMs and
the planner runs again at once (a decode step waits until such a launch has ended); any other plan without
partitions runs on all SMs after in-flight prefill drains. It records every
output token's time, so TTFT and every TBT gap come out per request as `RequestTimeline`s for the bench metrics.
"""
from __future__ import annotations

import copy
from collections import deque
from dataclasses import dataclass, field
from itertools import groupby
from typing import Protocol, Sequence

import numpy as np

from appliance.config import SPATIAL_POLICIES
from appliance.engine.kv_cache import PagePool, PageTable
from appliance.engine.plan import PrefillWork, StepPlan
from appliance.engine.planners.base import Planner
from appliance.engine.request import Request, RequestStatus, SamplingParams
from appliance.engine.scheduler import Scheduler
from appliance.engine.steplog import item_pairs, planned_row
from appliance.errors import CapacityError, ConfigError
from appliance.predictor.host import HostModel
from appliance.predictor.predictor import Predictor
from appliance.predictor.shapes import DecodeLoad, PrefillItem, decode_load, prefill_items
from appliance.workload.metrics import RequestTimeline
from appliance.workload.traces import RequestSpec

SAMPLED_TOKEN = 0  # every simulated output token; only counts and times matter


class StepTimer(Protocol):
    """Where virtual time comes from (Predictor and SyntheticGPU both fit)."""

    num_layers: int
    sm_count: int

    def prefill_ms(self, items: Sequence[PrefillItem], sms: int | None = None) -> float: ...

    def decode_ms(self, load: DecodeLoad, sms: int | None = None,
                  concurrent: Sequence[PrefillItem] = ()) -> float: ...

    def mixed_ms(self, items: Sequence[PrefillItem], load: DecodeLoad) -> float: ...


@dataclass
class SimConfig:
    num_pages: int
    page_size: int = 16
    max_num_seqs: int = 256
    max_waiting: int = 4096
    enable_prefix_caching: bool = True


@dataclass
class SimResult:
    """One replay: a timeline per spec (same order), when the last token came, how many steps ran; with the
    simulator's `log`, every step and prefill launch as the engine's step log has them (engine/steplog.py), times
    in the replay's virtual seconds and milliseconds."""

    timelines: list[RequestTimeline]
    requests: list[Request]
    end_time: float
    steps: int = 0
    spatial_steps: int = 0
    shed: int = 0
    step_log: list[dict] = field(default_factory=list)
    prefill_log: list[dict] = field(default_factory=list)


@dataclass
class _Launch:
    """Prefill works queued on the prefill stream, running from `start` to `end` (virtual seconds)."""

    start: float
    end: float
    works: tuple[PrefillWork, ...]
    items: tuple[PrefillItem, ...]
    all_sms: bool = False  # launched on every SM: nothing else runs until it ends


@dataclass
class _Clock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


def prompt_tokens(spec: RequestSpec, index: int) -> list[int]:
    """Token ids for a spec's prompt: equal hash-id blocks give equal tokens (prefix reuse as in the trace); a
    prompt without hash ids gets tokens no other request shares."""
    if spec.hash_ids:
        size = spec.block_size
        ids = [t for h in spec.hash_ids for t in range(h * size, (h + 1) * size)]
        return ids[:spec.prompt_len]
    base = -(index + 1) << 24
    return list(range(base, base + spec.prompt_len))


@dataclass
class Simulator:
    planner: Planner
    timer: StepTimer
    config: SimConfig
    clock: _Clock = field(default_factory=_Clock)
    host: HostModel | None = None  # the host's share of each step (None: steps take their device time only)
    host_spread: float = 0.0  # each prefill launch's host time: a lognormal multiple (this sigma) of the model's
    seed: int = 0  # of the launch times' draws
    log: bool = False  # keep every step and prefill launch in the result (`muxd bench --simulate --save-steps`)
    prompts: dict = field(default_factory=dict)  # (index, prompt_len, block, hash_ids) -> (tokens, hashes)
    _next_arrival: float | None = None

    def run(self, specs: Sequence[RequestSpec]) -> SimResult:
        cfg, t = self.config, self.timer
        self.sched = sched = Scheduler(PagePool(cfg.num_pages, cfg.page_size, cfg.enable_prefix_caching),
                                       t.num_layers, self.planner, cfg.max_num_seqs)
        sched.clock = self.clock
        self.clock.now = 0.0
        self._rng = np.random.default_rng(self.seed)
        self.stream: deque[_Launch] = deque()
        self.times: dict[str, list[float]] = {}
        timelines = [RequestTimeline(arrival=s.arrival, prompt_tokens=s.prompt_len, index=i)
                     for i, s in enumerate(specs)]
        requests = [self._request(s, i) for i, s in enumerate(specs)]
        order = deque(sorted(range(len(specs)), key=lambda i: specs[i].arrival))
        result = SimResult(timelines, requests, 0.0)
        while order or sched.has_work():
            self._next_arrival = specs[order[0]].arrival if order else None
            while order and specs[order[0]].arrival <= self.clock.now:
                i = order.popleft()
                error = self._submit(requests[i])
                if error:
                    timelines[i].error = error
                    result.shed += 1
            self._complete_until(self.clock.now)
            if not sched.has_work():
                if order:
                    self.clock.now = max(self.clock.now, specs[order[0]].arrival)
                continue
            plan = sched.schedule()
            result.steps += 1
            row = planned_row(self.clock.now, plan, sched, len(self.stream)) if self.log and not plan.empty else None
            self._device_ms = self._after_ms = self._queued = None
            begin = self.clock.now
            if plan.empty:
                self._wait()
            elif plan.spatial:
                result.spatial_steps += 1
                self._run_spatial(plan)
            elif not plan.decode and not plan.mixed and self.planner.name in SPATIAL_POLICIES:
                self._queue(plan, None, all_sms=True)  # as the executor launches it: the planner runs again at once
            else:
                self._run_all_sms(plan)
            if row is not None:
                self._finish_row(row, plan, begin, result)
        for tl, r in zip(timelines, requests):
            tl.token_times = self.times.get(r.request_id, [])
            if tl.error is None and r.status is not RequestStatus.FINISHED:
                tl.error = f"not finished ({r.status.value})"
        result.end_time = self.clock.now
        return result

    # ---- step log ---------------------------------------------------------------------------------------------
    def _finish_row(self, row: dict, plan: StepPlan, begin: float, result: SimResult) -> None:
        """The step as it ran: its wall time (from its launch to its tokens, a wait for the prefill stream
        included), its device time, a temporal step's prefill layers; and the prefill launch it queued."""
        row["launch_ms"] = (self.clock.now - begin) * 1e3
        if self._device_ms is not None:
            row["device_ms"] = self._device_ms
        if self._after_ms is not None:
            row.update(after_ms=self._after_ms, after_items=item_pairs(prefill_items(plan.prefill)))
        result.step_log.append(row)
        launch = self._queued
        if launch is not None:
            result.prefill_log.append({"t": launch.start, "ms": (launch.end - launch.start) * 1e3,
                                       "prefill_sms": plan.prefill_sms, "layers": row["layers"],
                                       "beside": bool(plan.decode), "items": item_pairs(launch.items)})

    # ---- requests ---------------------------------------------------------------------------------------------
    def _request(self, spec: RequestSpec, index: int) -> Request:
        if spec.prompt_len < 1 or spec.output_len < 1:
            raise ConfigError(f"request {index} of the trace has {spec.prompt_len} prompt and {spec.output_len} "
                              "output tokens; both must be >= 1")
        # replays of one trace at many rates share its prompts and their page hashes (the pool's own hash chain,
        # computed once: hashing long prompts would otherwise dominate a replay)
        key = (index, spec.prompt_len, spec.block_size, spec.hash_ids)
        if key not in self.prompts:
            tokens = prompt_tokens(spec, index)
            scratch = PageTable()
            self.sched.pool.cached_prefix(tokens, len(tokens), scratch)
            self.prompts[key] = (tokens, scratch.hashes)
        tokens, hashes = self.prompts[key]
        r = Request(f"sim-{index}", tokens, SamplingParams(max_tokens=spec.output_len, ignore_eos=True),
                    arrival_time=spec.arrival)
        r.page_table.hashes = list(hashes)
        return r

    def _submit(self, r: Request) -> str | None:
        """Hand a request to the scheduler as Engine.submit would; returns why it was refused, if it was."""
        sched = self.sched
        if len(sched.waiting) >= self.config.max_waiting:
            return f"refused: {len(sched.waiting)} requests waiting"
        if self.config.num_pages * self.config.page_size < r.num_prompt_tokens + r.sampling.max_tokens:
            return "refused: longer than the KV cache"
        try:
            retry = sched.planner.admission_check(sched, r)
        except CapacityError as exc:
            return f"shed: {exc}"
        if retry is not None:
            return f"shed (429, Retry-After {retry:.0f} s)"
        sched.add(r)
        self.times[r.request_id] = []
        return None

    def _tokens(self, produced: list[tuple[Request, int]], when: float) -> None:
        for r, _ in produced:
            self.times[r.request_id].append(when)
            if len(r.output_token_ids) >= r.sampling.max_tokens:
                self.sched.finish(r, "length")

    # ---- execution --------------------------------------------------------------------------------------------
    def _complete_until(self, when: float) -> None:
        """Take the completions of every queued prefill launch that ended by `when`, in stream order. The executor
        learns of them by polling between decode steps, so their first tokens are out at `when`."""
        while self.stream and self.stream[0].end <= when:
            launch = self.stream.popleft()
            for work in launch.works:
                self._tokens(self.sched.complete_prefill(work, SAMPLED_TOKEN), when)

    def _wait(self) -> None:
        """No decode step to run: jump to the next event (a prefill completing or a request arriving)."""
        events = [x for x in (self.stream[0].end if self.stream else None, self._next_arrival) if x is not None]
        if not events:
            raise RuntimeError(f"planner {self.planner.name!r} planned nothing with {len(self.sched.requests)} "
                               "requests pending and nothing in flight")
        self.clock.now = max(self.clock.now, min(events))

    def _prefill_ms(self, works: Sequence[PrefillWork], sms: int | None, observe: bool = False) -> float:
        """The launch's time; with `observe` (on a partition, decode beside it) each layer range also refines the
        planner's split slowdown, as the engine hands it the executor's measured launches."""
        total = 0.0
        for (start, end), group in groupby(works, key=lambda w: (w.layer_start, w.layer_end)):
            items = prefill_items(group)
            ms = self.timer.prefill_ms(items, sms) * (end - start) / self.timer.num_layers
            if observe and sms is not None and sms < self.timer.sm_count:
                self.planner.observe_prefill(items, end - start, sms, ms)
            total += ms
        return total

    def _host_step(self, rows: int) -> float:
        return self.host.step(rows) if self.host is not None else 0.0

    def _launch(self, layers: int, tokens: int) -> HostModel | None:
        """The host of a step that launches `layers` prefill layers of `tokens` tokens: the model, its launch time
        drawn around the model's with a spread; what the launch took is handed to the planner, as the engine hands
        it the executor's."""
        host = self.host
        if host is None or layers <= 0:
            return host
        if self.host_spread > 0:
            host = host.launch_scaled(float(self._rng.lognormal(0.0, self.host_spread)))
        self.planner.observe_launch(1, layers, host.prefill_launch(layers, tokens), host.replays_graphs(tokens))
        return host

    def _load(self, plan: StepPlan) -> DecodeLoad:
        return decode_load(self.sched.requests, plan.decode)

    def _run_all_sms(self, plan: StepPlan) -> None:
        """Decode and prefill on all SMs, after the prefill stream drains; everything completes at the end."""
        start = max(self.clock.now, self.stream[-1].end if self.stream else 0.0)
        self._complete_until(start)
        rows = len(plan.decode)
        layers = plan.prefill[0].layer_end - plan.prefill[0].layer_start if plan.prefill and not plan.mixed else 0
        if plan.mixed:
            items = prefill_items(plan.prefill)
            duration = self.timer.mixed_ms(items, self._load(plan))
            if items:  # the measured step refines the planner's mixed-step model
                self.planner.observe_mixed(items, self._load(plan), duration)
        else:
            after = self._prefill_ms(plan.prefill, None)
            if plan.prefill_after_decode and plan.decode and layers:  # as the engine hands the executor's
                self.planner.observe_full(prefill_items(plan.prefill), layers, after)
            duration = self.timer.decode_ms(self._load(plan)) + after
            self._after_ms = after if plan.prefill else None
        self._device_ms = duration - (self._after_ms or 0.0)  # the decode or mixed kernels, as the engine logs them
        tokens = sum(w.num_tokens for w in plan.prefill)
        host = self._launch(layers, tokens)
        if host is not None:  # the step's host time and its layer launches, after its tokens or hidden
            duration = host.gap(rows, duration, layers, tokens)
        self.clock.now = end = start + duration / 1e3
        self._tokens(self.sched.update_decode(plan, {rid: SAMPLED_TOKEN for rid in plan.decode}), end)
        for work in plan.prefill:
            self._tokens(self.sched.complete_prefill(work, SAMPLED_TOKEN), end)

    def _queue(self, plan: StepPlan, sms: int | None, all_sms: bool = False) -> HostModel | None:
        """Queue the plan's prefill layers on the prefill stream (on `sms` SMs; `all_sms`: launched on every SM,
        holding them all until they end) and hand their launch to the planner; without decode rows the clock moves
        by the host's launch alone. Returns the host that launched them."""
        if plan.prefill:
            start = max(self.clock.now, self.stream[-1].end if self.stream else self.clock.now)
            duration = self._prefill_ms(plan.prefill, sms, observe=bool(plan.decode))
            self._queued = _Launch(start, start + duration / 1e3, plan.prefill, prefill_items(plan.prefill), all_sms)
            self.stream.append(self._queued)
        layers = plan.prefill[0].layer_end - plan.prefill[0].layer_start if plan.prefill else 0
        tokens = sum(w.num_tokens for w in plan.prefill)
        host = self._launch(layers, tokens)
        if not plan.decode:
            self.clock.now += (self._host_step(0) + (host.prefill_launch(layers, tokens) if host is not None
                                                     else 0.0)) / 1e3
        return host

    def _run_spatial(self, plan: StepPlan) -> None:
        """Prefill layers queue on the prefill stream; the decode step runs now on its partition, slowed while the
        stream is busy; the planner runs again when it ends (or at the next event without decode)."""
        now = self.clock.now
        host = self._queue(plan, plan.prefill_sms)
        if not plan.decode:
            self._wait()
            return
        layers = plan.prefill[0].layer_end - plan.prefill[0].layer_start if plan.prefill else 0
        tokens = sum(w.num_tokens for w in plan.prefill)
        now = max([now] + [launch.end for launch in self.stream if launch.all_sms])  # (its SMs are busy till then)
        busy = next((launch for launch in self.stream if launch.start <= now < launch.end), None)
        concurrent = busy.items if busy else ()
        load = self._load(plan)
        duration = self.timer.decode_ms(load, plan.decode_sms, concurrent)
        if concurrent:  # the measured step refines the planner's contention guard
            self.planner.observe_decode(load, plan.decode_sms, concurrent, duration)
        self._device_ms = duration
        if host is not None:  # the host launches the prefill layers while the decode kernels run
            duration = host.gap(len(plan.decode), duration, layers, tokens)
        self.clock.now = end = now + duration / 1e3
        self._complete_until(end)
        self._tokens(self.sched.update_decode(plan, {rid: SAMPLED_TOKEN for rid in plan.decode}), end)


class ServingClock:
    """The simulator's clock for a profile with serving factors: the profile's latencies, decode and all-SM steps
    slowed by their factor (prefill on a partition already carries the profile's split slowdown; prefill on all SMs
    takes prefill_full where the profile has it, else the mixed steps' factor). It holds its own copy of the
    predictor, so the planner's online refinement never feeds back into it."""

    def __init__(self, predictor: Predictor) -> None:
        self.predictor = copy.deepcopy(predictor)
        self.num_layers, self.sm_count = predictor.num_layers, predictor.sm_count
        self.decode_factor = predictor.serving.get("decode", 1.0)
        self.prefill_factor = predictor.serving.get("prefill", 1.0)
        self.full_factor = predictor.serving.get("prefill_full", self.prefill_factor)

    def prefill_ms(self, items: Sequence[PrefillItem], sms: int | None = None) -> float:
        if sms is not None and sms < self.sm_count:
            return self.predictor.prefill_ms(items, sms)
        return self.predictor.prefill_solo_ms(items) * self.full_factor

    def decode_ms(self, load: DecodeLoad, sms: int | None = None, concurrent: Sequence[PrefillItem] = ()) -> float:
        return self.predictor.decode_ms(load, sms, concurrent) * self.decode_factor

    def mixed_ms(self, items: Sequence[PrefillItem], load: DecodeLoad) -> float:
        return self.predictor.mixed_ms(items, load) * self.prefill_factor


@dataclass
class Skewed:
    """A step timer whose device runs `factor` times the time of another's (model error injected: 1.2 is a GPU 20 %
    slower than predicted)."""

    timer: StepTimer
    factor: float

    @property
    def num_layers(self) -> int:
        return self.timer.num_layers

    @property
    def sm_count(self) -> int:
        return self.timer.sm_count

    def prefill_ms(self, items: Sequence[PrefillItem], sms: int | None = None) -> float:
        return self.timer.prefill_ms(items, sms) * self.factor

    def decode_ms(self, load: DecodeLoad, sms: int | None = None, concurrent: Sequence[PrefillItem] = ()) -> float:
        return self.timer.decode_ms(load, sms, concurrent) * self.factor

    def mixed_ms(self, items: Sequence[PrefillItem], load: DecodeLoad) -> float:
        return self.timer.mixed_ms(items, load) * self.factor
