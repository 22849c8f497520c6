"""Capacity planning without a GPU: replay a trace per policy on the simulated executor, judge each replay against
the SLO contract, and search the highest request rate that keeps it (the bench's bracketing + bisection).
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Sequence

from appliance.bench.simulate import ServingClock, SimConfig, SimResult, Simulator, Skewed, StepTimer
from appliance.bench.sweep import SweepResult, find_capacity
from appliance.config import SchedulerSettings
from appliance.engine.planners.registry import build_planner, tune_chunk_budget
from appliance.model_zoo.config import ModelConfig
from appliance.predictor.host import HostModel
from appliance.predictor.predictor import Predictor
from appliance.predictor.roofline import DeviceSpec
from appliance.slo.attainment import ContractReport, evaluate
from appliance.slo.contract import Contract
from appliance.workload import shaping as wl
from appliance.workload.traces import RequestSpec


def kv_pages(model: ModelConfig, device: DeviceSpec, page_size: int = 16, utilization: float = 0.9,
             dtype_bytes: int = 2, budget_bytes: int | None = None) -> int:
    """KV pages a GPU holds for `model`: `budget_bytes` where given (--kv-cache-memory), else `utilization` of its
    memory less the weights (as `muxd serve` sizes it)."""
    per_page = 2 * model.num_layers * model.num_kv_heads * model.head_dim * dtype_bytes * page_size
    budget = budget_bytes if budget_bytes is not None else \
        utilization * device.memory_bytes - model.num_params() * dtype_bytes
    return max(1, int(budget // per_page))


@dataclass
class PolicyRun:
    """One replay of one policy: the contract's verdict, the simulator's record, the planner's decisions."""

    policy: str
    rate: float | None
    report: ContractReport
    result: SimResult
    planner: Any


@dataclass
class SimulatedBench:
    """Everything a simulated replay needs: the contract, the planner's predictor, the step timer standing in for
    the GPU (the predictor itself unless a truer function is known), the KV pool, the policies' options."""

    contract: Contract
    predictor: Predictor
    sim: SimConfig
    truth: StepTimer | None = None
    options: SchedulerSettings | None = None  # the serve flags the planners honour (policy set per replay)
    device_error: float = 0.0  # the simulated GPU runs (1 + this) x the clock's times: model error injected
    host_error: float = 0.0  # the simulated host takes (1 + this) x the host model's times: host error injected
    host_spread: float = 0.0  # each simulated prefill launch takes a lognormal multiple (this sigma) of its time
    device_spread: float = 0.0  # judge each replay over the GPU this much slower, as timed and this much faster
    save_steps: bool = False  # each replay's summary holds the step and prefill-launch logs of its replay as timed
    host: HostModel | None = None  # the simulated host (None: the planner's host model, as its predictor has it)
    _prompts: dict = field(default_factory=dict, repr=False)  # shared by the replays of one trace
    _runs: dict = field(default_factory=dict, repr=False)

    def planner(self, policy: str) -> Any:
        options = dataclasses.replace(self.options or SchedulerSettings(), policy=policy)
        if policy == "chunked" and options.chunk_budget is None:
            options = dataclasses.replace(options, chunk_budget=self.idle_chunk_budget())
        # each replay starts from the profile, as a fresh server does: what one replay learns online stays there
        return build_planner(options, self.contract, copy.deepcopy(self.predictor))

    def idle_chunk_budget(self) -> int:
        """The baseline as the papers tuned it: the largest budget whose step meets TBT on an idle GPU, found on the
        machine itself (here: the step timer)."""
        return tune_chunk_budget(self.timer, self.contract.slo_for(None).tbt_ms, host=self.host_model)

    def tune_chunk_budget(self, specs: Sequence[RequestSpec], step: int = 128, max_budget: int = 8192,
                          max_requests: int = 200) -> int:
        """Chunked prefill tuned to the TBT target on this workload, as the papers tune their baseline: the largest
        token budget (a multiple of `step`) whose replay of `specs` (its first `max_requests`, at their own times)
        keeps the contract's TBT percentile; `step` when none does. The options keep it for later replays."""
        base = list(specs)[:max_requests]
        target = self.contract.slo_for(None).tbt_ms
        options = self.options or SchedulerSettings()

        def fits(budget: int) -> bool:
            self.options = dataclasses.replace(options, chunk_budget=budget)
            return self.run("chunked", base).report.tbt_ms <= target

        lo, hi = 1, max_budget // step  # in steps; fits(lo * step) assumed, the search finds the last that fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if fits(mid * step):
                lo = mid
            else:
                hi = mid - 1
        self.options = dataclasses.replace(options, chunk_budget=lo * step)
        return lo * step

    @property
    def host_model(self) -> HostModel:
        """The simulated host: `host` where given, else the planner's model of it."""
        return self.host or self.predictor.host

    @property
    def timer(self) -> StepTimer:
        """The clock: a given truth, else the profile slowed by its serving factors, else the predictor itself."""
        return self._clock(1.0)

    def _clock(self, speed: float) -> StepTimer:
        """The clock with the device taking `speed` x its times (and the injected model error)."""
        if self.truth is None and self.predictor.serving:
            self.truth = ServingClock(self.predictor)
        timer = self.truth if self.truth is not None else self.predictor
        factor = (1.0 + self.device_error) * speed
        return Skewed(timer, factor) if factor != 1.0 else timer

    @property
    def speeds(self) -> tuple[float, ...]:
        """The device speeds each replay is judged over: as timed, and `device_spread` slower and faster."""
        spread = self.device_spread
        return (1.0,) if not spread else (1.0, 1.0 + spread, 1.0 - spread)

    def run(self, policy: str, specs: Sequence[RequestSpec], rate: float | None = None) -> PolicyRun:
        """Replay `specs` (re-timed to `rate` req/s when given) under `policy`; a replay asked for again (a capacity
        search revisiting a rate) is not simulated twice."""
        key = (policy, repr(self.options), rate,
               tuple((s.arrival, s.prompt_len, s.output_len, s.hash_ids) for s in specs))
        if key not in self._runs:
            self._runs[key] = self._run(policy, specs, rate)
        return self._runs[key]

    def _run(self, policy: str, specs: Sequence[RequestSpec], rate: float | None) -> PolicyRun:
        """One replay per device speed (`speeds`); with more than one, the verdict is theirs pooled, as slices of one
        replay are (`muxd bench pool`): attainment over all their requests, the TBT percentile over all their gaps.
        The rest of the summary (throughput, planner) is the replay as timed."""
        if rate is not None:
            specs = wl.retime(list(specs), rate=rate)
        host = self.host_model.scaled(1.0 + self.host_error) if self.host_error else self.host_model
        replays = []
        for speed in self.speeds:
            planner = self.planner(policy)
            # each replay's own spec objects: their uncached counts are looked up by id
            copies = list(specs) if speed == 1.0 else [dataclasses.replace(s) for s in specs]
            result = Simulator(planner, self._clock(speed), self.sim, prompts=self._prompts, host=host,
                               host_spread=self.host_spread, log=self.save_steps and speed == 1.0).run(copies)
            replays.append((speed, copies, result, planner))
        uncached = {id(s): r.num_prompt_tokens - (r.num_cached_tokens or 0)
                    for _, copies, result, _ in replays for s, r in zip(copies, result.requests)}

        def judge(spec: RequestSpec) -> int:
            return uncached[id(spec)]

        band = [evaluate(self.contract, r.timelines, c, judge) for _, c, r, _ in replays]
        _, _, result, planner = replays[0]
        report = band[0]
        if len(replays) > 1:
            pooled = evaluate(self.contract, [t for _, _, r, _ in replays for t in r.timelines],
                              [s for _, c, _, _ in replays for s in c], judge)
            goodputs = [b.summary.get("request_goodput") or 0.0 for b in band]
            summary = dict(report.summary, slo_attainment=pooled.attainment,
                           good_requests=round(pooled.attainment * len(specs)),
                           request_goodput=sum(goodputs) / len(goodputs),
                           device_band=[{"speed": speed, "slo_attainment": b.attainment, "contract_tbt_ms": b.tbt_ms,
                                         "contract_met": b.met} for (speed, *_), b in zip(replays, band)])
            report = dataclasses.replace(pooled, summary=summary)
        report.summary.update(policy=policy, request_rate=rate, offered_rate=wl.offered_rate(list(specs)),
                              **report.verdict(), shed=result.shed, steps=result.steps,
                              spatial_steps=result.spatial_steps)
        snapshot = planner.snapshot()
        if snapshot is not None:
            report.summary["planner"] = snapshot
        if self.save_steps:
            report.summary.update(steps=result.step_log, prefills=result.prefill_log, simulated=True)
        return PolicyRun(policy, rate, report, result, planner)

    def capacity(self, policy: str, specs: Sequence[RequestSpec], start_rate: float, tolerance: float = 0.05,
                 max_points: int = 10, min_rate: float = 0.01, max_rate: float = float("inf")) -> SweepResult:
        """The highest rate at which `policy` keeps the contract (attainment and percentile targets)."""
        base = list(specs)
        return find_capacity(lambda rate: self.run(policy, base, rate).report.summary, self.contract.attainment,
                             start_rate, tolerance, max_points, min_rate, max_rate, label=policy,
                             passes=lambda summary: bool(summary["contract_met"]))
