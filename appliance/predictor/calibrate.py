"""Serving calibration: how much slower steps run while serving than the profile predicts for them alone. The
profiler times each step with nothing else in the process; a server's front-end (its event loop, token streaming)
shares the host with the engine, and the steps the host launches slow down. A replay on the GPU logs every step with
its measured time (`scripts/mux_diagnose.py`, `muxd profile --calibrate-rate`); `serving_factors` reduces such a log
to one factor per phase, which the profile file keeps and the simulator's clock applies (`ServingClock`); plans never
apply these. The same replay under mux also measures prefill on a partition beside decode: that slowdown is
contention, not the host, so the predictor plans with it (`split.py`) and refines it online.
"""
from __future__ import annotations

import copy
from typing import Any, Iterable, Sequence

from appliance.bench.metrics import RequestTimeline
from appliance.predictor.predictor import Predictor
from appliance.predictor.split import fit, span_k
from appliance.predictor.workload import DecodeLoad, PrefillItem

MIN_STEPS = 20  # a phase with fewer logged steps gets no factor


def serving_factors(steps: Iterable[dict[str, Any]], predictor: Predictor,
                    prefills: Iterable[dict[str, Any]] = ()) -> dict[str, float]:
    """Total measured time over total predicted time, per phase, of a step log's decode steps that ran alone
    ("decode") and its mixed steps ("prefill": a prompt chunk with decode rows, on all SMs). A step is a dict with
    launch_ms, mixed, decode (batch size), ctx (the batch's cached tokens) and, for mixed steps, items ([new,
    reused] per chunk) or prefill_tokens (then counted as new tokens without reuse). `prefills` (a StepLog's
    prefill launches: ms, prefill_sms, layers, items) give the partition prefill's factors (`split_factors`)."""
    sums = {"decode": [0.0, 0.0, 0], "prefill": [0.0, 0.0, 0]}
    for s in steps:
        if "launch_ms" not in s or "ctx" not in s or not s.get("decode"):
            continue
        load = DecodeLoad(int(s["decode"]), int(s["ctx"]))
        if s.get("mixed"):
            items = [PrefillItem(int(n), int(r)) for n, r in s["items"]] if s.get("items") else \
                [PrefillItem(int(s["prefill_tokens"]), 0)]
            phase, predicted = "prefill", predictor.mixed_ms(items, load)
        elif not s.get("beside") and not s.get("layers"):
            phase, predicted = "decode", predictor.decode_ms(load)
        else:
            continue  # decode beside prefill: the contention guard's business
        if predicted > 0:
            acc = sums[phase]
            acc[0] += float(s["launch_ms"])
            acc[1] += predicted
            acc[2] += 1
    factors = {phase: measured / predicted for phase, (measured, predicted, n) in sums.items() if n >= MIN_STEPS}
    return {**factors, **split_factors(prefills, predictor)}


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
        ms = predictor.prefill_ms([PrefillItem(t.prompt_tokens, 0)]) if alone and t.prompt_tokens else 0.0
        if ms > 0:
            measured += (first - t.arrival) * 1e3
            predicted += ms
            n += 1
    return {"prefill_full": measured / predicted} if n >= MIN_STEPS else {}


def split_factors(prefills: Iterable[dict[str, Any]], predictor: Predictor) -> dict[str, float]:
    """Layer-wise prefill on a partition's prefill SMs while serving (decode beside it) against the profile's solo
    figure for those SMs, fitted as `split.fit` does: prefill_split + prefill_split_per_1k per 1,000 tokens of span."""
    solo, span, measured = [], [], []
    for row in prefills:
        if row.get("ms") is None or int(row["prefill_sms"]) >= predictor.sm_count:
            continue
        items = [PrefillItem(int(n), int(r)) for n, r in row["items"]]
        ms = predictor.prefill_solo_ms(items, int(row["prefill_sms"]), int(row["layers"]))
        if ms > 0:
            solo.append(ms)
            span.append(span_k(items))
            measured.append(float(row["ms"]))
    fitted = fit(solo, span, measured)
    return {} if fitted is None else {"prefill_split": fitted[0], "prefill_split_per_1k": fitted[1]}


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
        split = sms is not None and sms < self.sm_count
        return self.predictor.prefill_ms(items, sms) * (1.0 if split else self.full_factor)

    def decode_ms(self, load: DecodeLoad, sms: int | None = None, concurrent: Sequence[PrefillItem] = ()) -> float:
        return self.predictor.decode_ms(load, sms, concurrent) * self.decode_factor

    def mixed_ms(self, items: Sequence[PrefillItem], load: DecodeLoad) -> float:
        return self.predictor.mixed_ms(items, load) * self.prefill_factor
