"""Serving calibration: how much slower steps run while serving than the profile predicts for them alone. The
profiler times each step with nothing else in the process; a server's front-end (its event loop, token streaming)
shares the host with the engine, and the steps the host launches slow down. A replay on the GPU logs every step with
its measured time (`muxd bench diagnose`, `muxd profile --calibrate-rate`); `serving_factors` reduces such a log
to one factor per phase, which the profile file keeps and the simulator's clock applies (`ServingClock`). Plans
apply only two of them, as the starting points of what the planner refines online (`split.py`): prefill on a
partition beside decode (contention, not the host) and prefill on all SMs after decode (mux's temporal steps).
"""
from __future__ import annotations

import bisect
import copy
import dataclasses
import logging
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from appliance.bench.client import ReplayResult, replay_in_process
from appliance.bench.prompts import PromptSynth
from appliance.config import SchedulerSettings
from appliance.engine.engine import Engine
from appliance.engine.planners.registry import build_planner
from appliance.engine.steplog import StepLog
from appliance.errors import ConfigError
from appliance.predictor.predictor import Predictor
from appliance.predictor.profile import keepable
from appliance.predictor.shapes import DecodeLoad, PrefillItem
from appliance.predictor.split import FACTOR_RANGE, fit, span_k
from appliance.slo.contract import default_contract
from appliance.workload import shaping as wl
from appliance.workload.metrics import RequestTimeline

log = logging.getLogger("muxd.profile")

MIN_STEPS = 20  # a phase with fewer logged steps gets no factor


def serving_factors(steps: Iterable[dict[str, Any]], predictor: Predictor,
                    prefills: Iterable[dict[str, Any]] = ()) -> dict[str, float]:
    """Total measured time over total predicted time, per phase, of a step log's decode steps that ran alone
    ("decode") and its mixed steps ("prefill": a prompt chunk with decode rows, on all SMs, against the floor the
    steps show: mixed_floor). A step is a dict with launch_ms, mixed, decode (batch size), ctx (the batch's cached
    tokens) and, for mixed steps, items ([new, reused] per chunk) or prefill_tokens (then counted as new tokens
    without reuse); a step's measured time is its wall time, or its device time (device_ms) where that is longer
    (the overlapped loop times a step from the tokens before it, and a step that ran mostly while the host waited
    for those reads shorter than the device ran it). `prefills` (a StepLog's prefill launches: ms, prefill_sms,
    layers, items) give the partition prefill's factors (`split_factors`)."""
    steps = list(steps)
    floor = mixed_floor(steps, predictor)
    if floor:  # the mixed steps' factor is measured against the floor they showed
        latency = predictor.latency
        predictor = dataclasses.replace(predictor, latency=dataclasses.replace(
            latency, mixed=(*latency.mixed[:5], floor["mixed_floor"])))
    sums = {"decode": [0.0, 0.0, 0], "prefill": [0.0, 0.0, 0]}
    for s in steps:
        if "launch_ms" not in s or "ctx" not in s or not s.get("decode"):
            continue
        load = DecodeLoad(int(s["decode"]), int(s["ctx"]))
        if s.get("mixed"):
            phase, predicted = "prefill", predictor.mixed_ms(_mixed_items(s), load)
        elif not s.get("beside") and not s.get("layers"):
            phase, predicted = "decode", predictor.decode_ms(load)
        else:
            continue  # decode beside prefill: the contention guard's business
        if predicted > 0:
            acc = sums[phase]
            acc[0] += max(float(s["launch_ms"]), float(s.get("device_ms") or 0.0))
            acc[1] += predicted
            acc[2] += 1
    factors = {phase: measured / predicted for phase, (measured, predicted, n) in sums.items() if n >= MIN_STEPS}
    return {**factors, **floor, **split_factors(prefills, predictor), **temporal_prefill_factor(steps, predictor)}


def _mixed_items(step: dict[str, Any]) -> list[PrefillItem]:
    return [PrefillItem(int(n), int(r)) for n, r in step["items"]] if step.get("items") else \
        [PrefillItem(int(step["prefill_tokens"]), 0)]


def mixed_floor(steps: Sequence[dict[str, Any]], predictor: Predictor) -> dict[str, float]:
    """The floor of a mixed step while serving ("mixed_floor", ms), where the profile measured a mixed model. The
    profiler times a mixed step from its launch to its tokens with nothing queued before it, so a short chunk reads
    the host's time to launch its layers, in whatever phase the host was (one H200's profiles: 11 and 25 ms for 128
    tokens); served by the overlapped loop, a step is launched while the one before runs, and a short chunk takes
    about its device time (5-15 ms for 76-600 tokens on that H200). The floor is chosen among none, the profile's
    and the measured times (over the model's scale) of the shorter half of the steps, as the one whose figures,
    scaled by their total-time factor, come nearest each step's device time (its wall time where the log has no
    device time), in mean relative error. serving_factors measures the mixed steps' factor against it."""
    latency = predictor.latency
    if getattr(latency, "mixed", None) is None:
        return {}
    rows = [(float(s["device_ms"] if s.get("device_ms") is not None else s["launch_ms"]),
             latency.mixed_gpu_ms(_mixed_items(s), DecodeLoad(int(s["decode"]), int(s["ctx"]))))
            for s in steps if s.get("mixed") and s.get("decode") and "ctx" in s and "launch_ms" in s]
    rows = [(ms, gpu) for ms, gpu in rows if ms > 0 and gpu > 0]
    if len(rows) < MIN_STEPS:
        return {}
    measured, gpu = (np.array(v) for v in zip(*rows))
    profiled = float(latency.mixed[5])
    scale = measured.sum() / gpu.sum()  # measured times over the model's: a floor is a measured time over it
    # a floor shows in the shorter steps: their times (the model's scale taken out) are the candidates, with none
    # and the profile's (itself perhaps a floor fitted so before)
    candidates = sorted({0.0, profiled, *(measured[gpu <= np.median(gpu)] / scale).round(2)})

    def error(floor: float) -> float:
        predicted = np.maximum(floor, gpu)
        return float(np.mean(np.abs(predicted * measured.sum() / predicted.sum() - measured) / measured))

    return {"mixed_floor": min(candidates, key=error)}


def temporal_prefill_factor(steps: Iterable[dict[str, Any]], predictor: Predictor) -> dict[str, float]:
    """Prefill layers on all SMs after a decode step while serving (mux's temporal steps: a step log's `after_ms`,
    `after_items` and `layers`) over the profile's all-SM figure for them ("prefill_full"). Measured from the device's
    mark after decode to the last layer, it holds what the steps pay in serving, a host that queues the layers more
    slowly than the device runs them included; the planner learns the same figure online."""
    measured = predicted = 0.0
    n = 0
    for s in steps:
        if s.get("after_ms") is None or not s.get("after_items") or not s.get("layers"):
            continue
        items = [PrefillItem(int(new), int(reused)) for new, reused in s["after_items"]]
        ms = predictor.prefill_solo_ms(items, None, int(s["layers"]))
        if ms > 0:
            measured += float(s["after_ms"])
            predicted += ms
            n += 1
    return {"prefill_full": measured / predicted} if n >= MIN_STEPS else {}


def full_prefill_factor(timelines: Sequence[RequestTimeline], predictor: Predictor) -> dict[str, float]:
    """Whole prompts prefilled alone on all SMs while serving ("prefill_full"), from a serial replay of prompts that
    share no prefix: the time to first token of every request that arrived with nothing in flight and had the engine
    to itself until its first token, over the profile's all-SM prefill of its prompt. The profiler measures prefill
    back to back; a server that idles between requests may run it faster (the GPU's clocks), or slower (the host)."""
    done = sorted((t for t in timelines if t.success and t.token_times), key=lambda t: t.arrival)
    measured = predicted = 0.0
    n = 0
    busy_until = float("-inf")  # the last token of every earlier request
    for i, t in enumerate(done):
        first = t.token_times[0]
        alone = t.arrival > busy_until and (i + 1 == len(done) or done[i + 1].arrival > first)
        busy_until = max(busy_until, t.token_times[-1])
        ms = predictor.prefill_solo_ms([PrefillItem(t.prompt_tokens, 0)]) if alone and t.prompt_tokens else 0.0
        if ms > 0:
            measured += (first - t.arrival) * 1e3
            predicted += ms
            n += 1
    return {"prefill_full": measured / predicted} if n >= MIN_STEPS else {}


def _split_launches(prefills: Iterable[dict[str, Any]],
                    predictor: Predictor) -> Iterator[tuple[dict[str, Any], list[PrefillItem], float]]:
    """(log row, its items, the profile's solo time) of every prefill launch on a partition's prefill SMs, leaving
    out, as the planner's online fit does, a launch far off its solo figure (a first launch compiling its kernels
    says nothing about the slowdown)."""
    for row in prefills:
        if row.get("ms") is None or int(row["prefill_sms"]) >= predictor.sm_count:
            continue
        items = [PrefillItem(int(n), int(r)) for n, r in row["items"]]
        ms = predictor.prefill_solo_ms(items, int(row["prefill_sms"]), int(row["layers"]))
        if ms > 0 and FACTOR_RANGE[0] <= float(row["ms"]) / ms <= FACTOR_RANGE[1]:
            yield row, items, ms


def split_factors(prefills: Iterable[dict[str, Any]], predictor: Predictor) -> dict[str, float]:
    """Layer-wise prefill on a partition's prefill SMs while serving (decode beside it) against the profile's solo
    figure for those SMs, fitted as `split.fit` does: prefill_split + prefill_split_per_1k per 1,000 tokens of span."""
    launches = [(ms, span_k(items), float(row["ms"])) for row, items, ms in _split_launches(prefills, predictor)]
    fitted = fit(*zip(*launches)) if launches else None
    return {} if fitted is None else {"prefill_split": fitted[0], "prefill_split_per_1k": fitted[1]}


SPAN_BINS = (2.0, 8.0, 16.0)   # thousands of tokens of attention span: the breakdown's rows
BATCH_BINS = (0, 8, 32)        # mean decode batch beside a launch: its columns (above the last: the last one open)


def split_breakdown(prefills: Iterable[dict[str, Any]], predictor: Predictor) -> dict[tuple[int, int], list[float]]:
    """The split's slowdown (measured / solo) of each partition prefill launch, binned by its attention span
    (SPAN_BINS) and the mean decode batch planned beside it (BATCH_BINS; a log row's `decode_beside`, launches
    logged without it left out): {(span bin, batch bin): [count, mean ratio, reused share]}, to see what the
    one fitted slowdown averages over (the span, the decode beside, prefix reuse)."""
    cells: dict[tuple[int, int], list[float]] = {}
    for row, items, ms in _split_launches(prefills, predictor):
        if row.get("decode_beside") is None:
            continue
        key = (bisect.bisect_left(SPAN_BINS, span_k(items)),
               bisect.bisect_left(BATCH_BINS, row["decode_beside"]["batch"]))
        cell = cells.setdefault(key, [0, 0.0, 0.0])
        tokens = sum(i.new + i.reused for i in items)
        cell[0] += 1
        cell[1] += float(row["ms"]) / ms
        cell[2] += sum(i.reused for i in items) / tokens if tokens else 0.0
    return {k: [n, total / n, reused / n] for k, (n, total, reused) in sorted(cells.items())}


SERIAL_IDLE_S = 0.2  # the serial calibration replay idles this long between requests


def calibration_seconds(workloads: Sequence[tuple[int, float]]) -> float:
    """What the calibration of `workloads` ((requests, rate) each) takes at most: two replays of each (chunked, then
    mux on a multiplexed engine), its arrivals plus a margin for the last requests to finish, and the serial replay
    of the first (each request alone, then a short idle), which runs only where the mux replays left too few
    temporal steps to measure prefill on all SMs."""
    total = sum(2 * (requests / rate + 30.0) for requests, rate in workloads)
    requests, rate = workloads[0]
    return total + requests * SERIAL_IDLE_S + requests / rate + 30.0


def calibrate_serving(engine: Engine, workloads: Sequence[tuple[Sequence, float]],
                      predictor: Predictor) -> tuple[dict[str, float], list[dict], list[dict]]:
    """Replay each of `workloads` (its requests and the rate they are re-timed to) in process on `engine` under
    chunked prefill (its budget tuned from `predictor` as `muxd serve --policy chunked` would), then, on a
    multiplexed engine, under mux, with the prefix cache on as the server runs it; log every step and prefill launch,
    each replay with prompts of its own (none hits an earlier one's prefix cache). The factors are fitted over all
    replays together: workloads of short and long prompts let the split's slowdown be fitted over the spans both
    reach. Where the mux replays measured no prefill on all SMs, the first workload's requests are replayed once
    more, sharing no prefix, one at a time under serial, each followed by SERIAL_IDLE_S of idle time.
    Return the serving factors (predictor/calibrate.py: how much slower decode, mixed steps, layer-wise prefill on a
    partition and a whole prompt's prefill on all SMs ran while serving than `predictor` says), and the step and
    prefill-launch logs of the chunked and mux replays (`muxd bench diagnose --from-steps --from-prefills` fits the
    same factors from them again)."""
    if not workloads:
        raise ConfigError("the calibration has no workload to replay")
    max_len = min(engine.pool.num_pages * engine.pool.page_size - 1, engine.max_model_len - 1)
    timed = []
    for specs, rate in workloads:
        specs, _ = wl.clip_to_context(wl.retime(list(specs), rate=rate), max_len)
        if not specs:
            raise ConfigError("a calibration replay has no request that fits the KV pool")
        timed.append(specs)
    synth = PromptSynth(vocab_size=engine.model.config.vocab_size)
    policies = ("chunked", "mux") if engine.executor.multiplexed else ("chunked",)
    # as `muxd serve` runs them: prompts that share a prefix in the trace find it cached (the profiler's own engine
    # caches nothing, so that its grid's prompts run whole); a model whose rope depends on the length never caches
    pool, caching = engine.pool, engine.pool.enable_prefix_caching
    pool.enable_prefix_caching = not engine.model.config.rope.length_dependent
    try:
        factors, steps, prefills = _replays(engine, timed, policies, synth, predictor)
    finally:
        pool.enable_prefix_caching = caching
    factors, dropped = keepable(factors)
    for why in dropped:
        log.warning("calibration: %s", why)
    return factors, steps, prefills


def _replays(engine: Engine, timed: Sequence[Sequence], policies: Sequence[str], synth: PromptSynth,
             predictor: Predictor) -> tuple[dict[str, float], list[dict], list[dict]]:
    """calibrate_serving's replays and the factors fitted over them."""
    steps: list[dict] = []
    prefills: list[dict] = []
    # each replay draws its own prompts (salt), so that none finds an earlier one's prompts in the prefix cache;
    # prompts that share hash ids still share their prefix within a replay, as in the trace
    for w, specs in enumerate(timed):
        for p, policy in enumerate(policies):
            prompts = [synth.token_ids(s, i, salt=2 + 2 * (len(policies) * w + p)) for i, s in enumerate(specs)]
            _, log_ = _replay(engine, policy, predictor, specs, prompts)
            steps += log_.steps
            prefills += log_.prefills
    factors = serving_factors(steps, predictor, prefills)
    if "prefill_full" not in factors:  # no mux replay, or too few temporal steps: every request alone
        alone = [dataclasses.replace(s, arrival=1000.0 * i, hash_ids=(), block_size=0)
                 for i, s in enumerate(timed[0])]
        result, _ = _replay(engine, "serial", predictor, alone,
                            [synth.token_ids(s, i, salt=1) for i, s in enumerate(alone)], max_idle=SERIAL_IDLE_S)
        factors.update(full_prefill_factor(result.timelines, predictor))
    return factors, steps, prefills


def _replay(engine: Engine, policy: str, predictor: Predictor, specs: Sequence, prompts: Sequence,
            max_idle: float | None = None) -> tuple[ReplayResult, StepLog]:
    """One calibration replay under `policy` (a planner of its own; the engine's is put back after): its result and
    its step log. A lost request fails the calibration."""
    sched = engine.scheduler
    planner = sched.planner
    # the mux planner refines its predictor online: a copy, so the factors are measured against the profile
    sched.planner = build_planner(SchedulerSettings(policy=policy), default_contract(), copy.deepcopy(predictor))
    log_ = StepLog(engine, predictor).attach()
    try:
        result = replay_in_process(engine, specs, prompts, max_idle=max_idle)
    finally:
        log_.detach()
        sched.planner = planner
    failed = [t.error for t in result.timelines if t.error]
    if failed:
        raise ConfigError(f"the {policy} calibration replay lost {len(failed)} of {len(specs)} requests "
                          f"(first: {failed[0]})")
    return result, log_
