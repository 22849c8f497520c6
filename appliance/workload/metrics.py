"""Latency metrics, SLO attainment and goodput from per-request timelines, with vLLM `bench serve` meanings and keys.

Stable API (the simulated executor feeds it too): build one `RequestTimeline` per request (scheduled arrival, the
time of every output token, token counts, error), then `request_metrics(timeline)` gives TTFT / TPOT / E2E / every
inter-token gap of one request, and `summarize(timelines, slo=..., specs=...)` gives the result dict (vLLM keys such
as `request_throughput`, `request_goodput`, `p99_ttft_ms`, plus `slo_attainment`). An SLO is anything with
`targets_for(spec) -> {"ttft": ms, "tpot": ms, "e2el": ms, "tbt": ms}` (any subset); `GoodputSLO` is vLLM's
`--goodput ttft:MS tpot:MS e2el:MS`.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Protocol, Sequence

import numpy as np

from appliance.errors import ConfigError
from appliance.workload.traces import RequestSpec

PERCENTILES = (50.0, 90.0, 99.0)
METRIC_NAMES = ("ttft", "tpot", "itl", "e2el")  # vLLM's --percentile-metrics names
SLO_METRICS = ("ttft", "tpot", "e2el", "tbt")  # tbt: every inter-token gap of the request
GOODPUT_METRICS = ("ttft", "tpot", "e2el")      # what vLLM's --goodput accepts


@dataclass
class RequestTimeline:
    """What happened to one request, all times in seconds on one clock (any origin).

    arrival:       scheduled arrival; every latency counts from here, so a client that sends late cannot hide it.
    token_times:   arrival of each output token at the client; token_times[0] is the first token. A stream whose
                   chunks carry several tokens records one time per chunk (as vLLM's ITL does).
    output_tokens: tokens generated; None means len(token_times).
    prompt_tokens: prompt tokens (as the server reports them, else as requested).
    sent:          when the request actually left the client; None means at `arrival`. sent - arrival is client lag.
    error:         None for a completed request, else why it failed (a failed request is never good).
    index:         position of the request in the workload (its RequestSpec), -1 if unknown.
    """

    arrival: float
    token_times: list[float] = field(default_factory=list)
    output_tokens: int | None = None
    prompt_tokens: int = 0
    sent: float | None = None
    error: str | None = None
    index: int = -1

    @property
    def success(self) -> bool:
        return self.error is None and bool(self.token_times)

    @property
    def num_output_tokens(self) -> int:
        return self.output_tokens if self.output_tokens is not None else len(self.token_times)


@dataclass(frozen=True)
class RequestMetrics:
    """Latencies of one completed request, in seconds."""

    ttft: float                # first token - scheduled arrival
    tpot: float                # (e2el - ttft) / (output tokens - 1); 0 for one output token (vLLM's definition)
    e2el: float                # last token - scheduled arrival
    itls: tuple[float, ...]    # every gap between consecutive token arrivals (time between tokens)
    output_tokens: int
    prompt_tokens: int
    lag: float                 # sent - scheduled arrival (client lag)


def request_metrics(t: RequestTimeline) -> RequestMetrics:
    """Metrics of one completed request; ValueError for a failed one (it has none)."""
    if not t.success:
        raise ValueError(f"request {t.index} did not complete: {t.error or 'no token arrived'}")
    ttft = t.token_times[0] - t.arrival
    e2el = t.token_times[-1] - t.arrival
    n = t.num_output_tokens
    tpot = (e2el - ttft) / (n - 1) if n > 1 else 0.0
    itls = tuple(b - a for a, b in zip(t.token_times, t.token_times[1:]))
    lag = (t.sent - t.arrival) if t.sent is not None else 0.0
    return RequestMetrics(ttft, tpot, e2el, itls, n, t.prompt_tokens, lag)


# ---- SLOs ---------------------------------------------------------------------------------------------------------
class SLO(Protocol):
    """Per-request latency targets in milliseconds; keys are a subset of SLO_METRICS. A request is good when it
    meets every target it has (each metric <= its target). A YAML contract with per-class targets plugs in here."""

    def targets_for(self, spec: RequestSpec | None) -> dict[str, float]:
        ...


@dataclass(frozen=True)
class GoodputSLO:
    """vLLM's `--goodput ttft:MS tpot:MS e2el:MS`: the same targets for every request."""

    targets: dict[str, float]

    def targets_for(self, spec: RequestSpec | None) -> dict[str, float]:
        return dict(self.targets)

    def describe(self) -> str:
        return " ".join(f"{k}:{v:g}" for k, v in self.targets.items())


def parse_goodput(pairs: Iterable[str]) -> GoodputSLO | None:
    """['ttft:500', 'tpot:50'] (or one string 'ttft:500 tpot:50', commas allowed) -> GoodputSLO; None if empty."""
    items = [p for text in pairs for p in str(text).replace(",", " ").split()]
    if not items:
        return None
    targets: dict[str, float] = {}
    for item in items:
        name, _, value = item.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = math.nan
        if name not in GOODPUT_METRICS:
            raise ConfigError(f"--goodput: unknown metric {name!r} in {item!r}; use ttft, tpot or e2el, "
                              "e.g. --goodput ttft:500 --goodput tpot:50")
        if not ms >= 0 or math.isinf(ms):
            raise ConfigError(f"--goodput: {item!r} needs a target in milliseconds >= 0, e.g. {name}:500")
        targets[name] = ms
    return GoodputSLO(targets)


def meets(m: RequestMetrics, targets: dict[str, float]) -> bool:
    """True when the request meets every target (milliseconds); 'tbt' bounds every inter-token gap."""
    values = {"ttft": m.ttft, "tpot": m.tpot, "e2el": m.e2el, "tbt": max(m.itls, default=0.0)}
    for name, ms in targets.items():
        if name not in values:
            raise ConfigError(f"SLO metric {name!r} is unknown; use one of {', '.join(SLO_METRICS)}")
        if values[name] > ms / 1000.0:
            return False
    return True


def good_flags(timelines: Sequence[RequestTimeline], slo: SLO,
               specs: Sequence[RequestSpec] | None = None) -> list[bool]:
    """Per request: completed and meets its targets."""
    flags = []
    for t in timelines:
        spec = specs[t.index] if specs is not None and 0 <= t.index < len(specs) else None
        flags.append(t.success and meets(request_metrics(t), slo.targets_for(spec)))
    return flags


# ---- summary ------------------------------------------------------------------------------------------------------
def summarize(timelines: Sequence[RequestTimeline], duration: float | None = None, slo: SLO | None = None,
              specs: Sequence[RequestSpec] | None = None, percentiles: Sequence[float] = PERCENTILES,
              detailed: bool = False, percentile_metrics: Sequence[str] = METRIC_NAMES) -> dict[str, Any]:
    """The result dict of a replay, with vLLM `bench serve` keys where the meaning is the same.

    duration: seconds from the first scheduled arrival to the last token (computed when None).
    Throughputs divide by it; `request_goodput` = good requests / duration (None without an SLO), and
    `slo_attainment` = good requests / all requests (failed ones count as missed). Percentiles are reported for
    the `percentile_metrics` only; every metric keeps its mean, median and standard deviation.
    """
    done = [t for t in timelines if t.success]
    metrics = [request_metrics(t) for t in done]
    if duration is None:
        start = min((t.arrival for t in timelines), default=0.0)
        end = max((t.token_times[-1] for t in done), default=start)
        duration = end - start
    dur = duration if duration > 0 else math.nan
    total_in = sum(m.prompt_tokens for m in metrics)
    total_out = sum(m.output_tokens for m in metrics)
    result: dict[str, Any] = {
        "duration": duration, "completed": len(done), "failed": len(timelines) - len(done),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": _rate(len(done), dur), "request_goodput": None,
        "output_throughput": _rate(total_out, dur), "total_token_throughput": _rate(total_in + total_out, dur),
        "slo": None, "good_requests": None, "slo_attainment": None, **_peaks(done),
    }
    if slo is not None:
        good = sum(good_flags(timelines, slo, specs))
        result.update(request_goodput=_rate(good, dur), good_requests=good,
                      slo_attainment=good / len(timelines) if timelines else 0.0,
                      slo=slo.describe() if hasattr(slo, "describe") else type(slo).__name__)
    series = {"ttft": [m.ttft for m in metrics], "tpot": [m.tpot for m in metrics if m.output_tokens > 1],
              "itl": [g for m in metrics for g in m.itls], "e2el": [m.e2el for m in metrics]}
    for name, values in series.items():
        result.update(_stats(name, values, percentiles if name in percentile_metrics else ()))
    lags = [m.lag for m in metrics]
    result["mean_client_lag_ms"] = float(np.mean(lags)) * 1000 if lags else 0.0
    result["max_client_lag_ms"] = float(np.max(lags)) * 1000 if lags else 0.0
    if detailed:
        result.update(detailed_arrays(timelines))
    return result


def _peaks(done: Sequence[RequestTimeline]) -> dict[str, Any]:
    """vLLM's peak figures: the most token arrivals within one second (seconds counted from the first arrival) and
    the most requests in flight at once (each from its arrival to its last token)."""
    if not done:
        return {"max_output_tokens_per_s": 0.0, "max_concurrent_requests": 0}
    t0 = min(t.arrival for t in done)
    per_second = np.bincount([max(0, int(x - t0)) for t in done for x in t.token_times])
    events = sorted([(t.arrival, 1) for t in done] + [(t.token_times[-1], -1) for t in done])  # an end before a start
    return {"max_output_tokens_per_s": float(per_second.max()),
            "max_concurrent_requests": max(itertools.accumulate(step for _, step in events))}


def _rate(count: float, duration: float) -> float:
    return count / duration if duration == duration else 0.0  # nan duration: nothing ran


def _stats(name: str, values: list[float], percentiles: Sequence[float]) -> dict[str, float]:
    """mean/median/std/pN in ms, 0 when there is no value (as vLLM reports an empty series)."""
    arr = np.asarray(values if values else [0.0], dtype=float) * 1000
    out = {f"mean_{name}_ms": float(arr.mean()), f"median_{name}_ms": float(np.median(arr)),
           f"std_{name}_ms": float(arr.std())}
    for p in percentiles:
        word = str(int(p)) if float(p).is_integer() else str(p)
        out[f"p{word}_{name}_ms"] = float(np.percentile(arr, p))
    return out


def detailed_arrays(timelines: Sequence[RequestTimeline]) -> dict[str, list]:
    """Per-request arrays under vLLM's --save-detailed keys (ttfts and itls in seconds, as vLLM writes them)."""
    out: dict[str, list] = {"input_lens": [], "output_lens": [], "ttfts": [], "itls": [], "latencies": [],
                            "start_times": [], "errors": []}
    for t in timelines:
        m = request_metrics(t) if t.success else None
        out["input_lens"].append(t.prompt_tokens)
        out["output_lens"].append(m.output_tokens if m else 0)
        out["ttfts"].append(m.ttft if m else 0.0)
        out["itls"].append(list(m.itls) if m else [])
        out["latencies"].append(m.e2el if m else 0.0)
        out["start_times"].append(t.arrival)
        out["errors"].append(t.error or "")
    return out
