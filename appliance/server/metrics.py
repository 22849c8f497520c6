"""Prometheus metrics of the server: muxd's own `muxd:*` series, and beside them the `vllm:*` series that dashboards,
KEDA scalers and the inference gateway read, with vLLM's names, label names (`model_name`, `engine`) and bucket edges.
Latency and token-count histograms are recorded per request by the API layer; engine gauges and counters follow the
engine's published stats at scrape time.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

if TYPE_CHECKING:
    from appliance.engine.request import RequestOutput

disable_created_metrics()  # no *_created series, as in vLLM

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)
_TBT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
# vLLM's own edges, so that its dashboards' quantiles read the same
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                     20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                    40.0, 80.0)
VLLM_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                    480.0, 960.0, 1920.0, 7680.0)


def vllm_token_buckets(max_model_len: int) -> tuple[int, ...]:
    """vLLM's edges of its per-request token histograms: 1, 2, 5, 10, 20, 50, ... up to the context length."""
    edges, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return tuple(edges)
            edges.append(mantissa * scale)
        scale *= 10


_ENGINE_COUNTERS = ("num_preemptions", "partition_switches", "prefill_layers_launched", "prefill_pauses")


class TokenHistogram(Collector):
    """A histogram fed once a token (the time between tokens): an observation is appended to a list, and the list is
    folded into the buckets at once (numpy) when /metrics is read or it grows long; served as prometheus_client's
    Histogram serves one. Observed and collected on one thread, the event loop's (no lock): its observe takes 0.2
    against Histogram's 1.0-1.1 us (a 2-core CPU, folds included), for every streamed token."""

    FOLD_AT = 4096  # observations kept before they are folded anyway (no scrape for a while)

    def __init__(self, registry: CollectorRegistry, name: str, doc: str, labels: dict[str, str],
                 buckets: tuple[float, ...]) -> None:
        self.name, self.doc, self.labels = name, doc, labels
        self.edges = np.asarray(buckets, dtype=np.float64)  # (+Inf after them)
        self.le = [floatToGoString(e) for e in buckets] + ["+Inf"]
        self.counts = np.zeros(len(buckets) + 1, dtype=np.int64)
        self.sum = 0.0
        self._values: list[float] = []
        registry.register(self)

    def observe(self, value: float, count: int = 1) -> None:
        """`count` observations of `value`."""
        values = self._values
        if count == 1:
            values.append(value)
        else:
            values.extend([value] * count)
        if len(values) >= self.FOLD_AT:
            self._fold()

    def _fold(self) -> None:
        if not self._values:
            return
        values, self._values = np.asarray(self._values), []
        where = np.searchsorted(self.edges, values, side="left")  # the first edge >= the value (le)
        self.counts += np.bincount(where, minlength=len(self.counts))
        self.sum += float(values.sum())

    def describe(self) -> list[HistogramMetricFamily]:
        return [HistogramMetricFamily(self.name, self.doc, labels=list(self.labels))]

    def collect(self):
        self._fold()
        cumulative, total = np.cumsum(self.counts).tolist(), self.sum
        family = HistogramMetricFamily(self.name, self.doc, labels=list(self.labels))
        family.add_metric(list(self.labels.values()), list(zip(self.le, cumulative)), total)
        yield family


class _Family:
    """One registry's metrics under one prefix and label set."""

    def __init__(self, registry: CollectorRegistry, prefix: str, labels: dict[str, str]) -> None:
        self.registry, self.prefix, self.labels = registry, prefix, labels

    def hist(self, name: str, doc: str, buckets: tuple[float, ...]):
        return Histogram(self.prefix + name, doc, list(self.labels), registry=self.registry,
                         buckets=buckets).labels(**self.labels)

    def gauge(self, name: str, doc: str):
        return Gauge(self.prefix + name, doc, list(self.labels), registry=self.registry).labels(**self.labels)

    def token_hist(self, name: str, doc: str, buckets: tuple[float, ...]) -> TokenHistogram:
        return TokenHistogram(self.registry, self.prefix + name, doc, self.labels, buckets)

    def counter(self, name: str, doc: str):
        return Counter(self.prefix + name, doc, list(self.labels), registry=self.registry).labels(**self.labels)

    def by_reason(self, name: str, doc: str) -> Counter:
        return Counter(self.prefix + name, doc, [*self.labels, "finished_reason"], registry=self.registry)


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        mx = _Family(self.registry, "muxd:", {"model_name": model_name})
        vl = _Family(self.registry, "vllm:", {"model_name": model_name, "engine": "0"})
        self._families = (mx, vl)
        self._vl = vl
        # vLLM's request-shape histograms in tokens, by name; set_context makes them (their edges end at the context)
        self.request_tokens: dict[str, Histogram] = {}
        self.request_n = vl.hist("request_params_n", "Histogram of the n request parameter.", (1, 2, 5, 10, 20))
        self.ttft = (mx.hist("time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS),
                     vl.hist("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                             VLLM_TTFT_BUCKETS))
        self.tbt = (mx.token_hist("inter_token_latency_seconds", "Time between consecutive output tokens.",
                                  _TBT_BUCKETS),
                    vl.token_hist("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                                  VLLM_ITL_BUCKETS))
        self.e2e = (mx.hist("e2e_request_latency_seconds", "End-to-end request latency.", _LATENCY_BUCKETS),
                    vl.hist("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                            VLLM_E2E_BUCKETS))
        # a request's phases as vLLM splits its latency: waiting, prefill (admitted to first token), decode (first
        # token to last), inference (admitted to last token), and its mean time per output token
        self.phases = {name: vl.hist(f"request_{name}_time_seconds", doc, VLLM_E2E_BUCKETS) for name, doc in (
            ("queue", "Histogram of time spent in WAITING phase for request."),
            ("prefill", "Histogram of time spent in PREFILL phase for request."),
            ("decode", "Histogram of time spent in DECODE phase for request."),
            ("inference", "Histogram of time spent in RUNNING phase for request."))}
        self.step_tokens = vl.hist("iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                   (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384))
        self.request_tpot = vl.hist("request_time_per_output_token_seconds",
                                    "Histogram of time_per_output_token_seconds per request.", VLLM_ITL_BUCKETS)
        running = "Requests prefilling or decoding."
        waiting = "Requests waiting to be scheduled."
        usage = "Fraction of KV-cache pages in use (1 = full)."
        self._gauges = {
            "num_running": (mx.gauge("num_requests_running", running), vl.gauge("num_requests_running", running)),
            "num_waiting": (mx.gauge("num_requests_waiting", waiting), vl.gauge("num_requests_waiting", waiting)),
            "kv_usage": (mx.gauge("kv_cache_usage_perc", usage), vl.gauge("kv_cache_usage_perc", usage)),
            "free_pages": (mx.gauge("kv_cache_free_pages", "KV-cache pages free or reclaimable from the prefix "
                                    "cache."),),
            # prefill-decode multiplexing: the partition in use
            "decode_sms": (mx.gauge("decode_sms", "SMs of the partition decode ran on last (0 without "
                                    "partitions)."),),
            "allocator_reserved_bytes": (mx.gauge("gpu_allocator_reserved_bytes", "Device memory the CUDA caching "
                                                  "allocator holds (0 without a memory budget to keep)."),),
            "allocator_budget_bytes": (mx.gauge("gpu_allocator_budget_bytes", "What --gpu-memory-utilization "
                                                "leaves the caching allocator (0 without one)."),),
        }
        self.prompt_tokens = (mx.counter("prompt_tokens", "Prompt tokens of finished requests."),
                              vl.counter("prompt_tokens", "Number of prefill tokens processed."))
        self.cached_tokens = (mx.counter("cached_prompt_tokens", "Prompt tokens served from the prefix cache."),)
        self.cache_queries = (vl.counter("prefix_cache_queries", "Prefix cache queries, in terms of number of "
                                         "queried tokens."),)
        self.cache_hits = (vl.counter("prefix_cache_hits", "Prefix cache hits, in terms of number of cached "
                                      "tokens."),)
        self.generation_tokens = (mx.counter("generation_tokens", "Generated tokens."),
                                  vl.counter("generation_tokens", "Number of generation tokens processed."))
        preempted = "Requests preempted (pages freed, to be recomputed) when the KV cache ran out."
        self._engine_counters = {
            "num_preemptions": (mx.counter("num_preemptions", preempted), vl.counter("num_preemptions", preempted)),
            "partition_switches": (mx.counter("partition_switches", "Times decode moved to another SM partition."),),
            "prefill_layers_launched": (mx.counter("prefill_layers_launched", "Prefill layer ranges launched, in "
                                                   "layers."),),
            "prefill_pauses": (mx.counter("prefill_pauses", "Prefill batches paused between layers for a more "
                                          "urgent prompt (mux)."),),
            "allocator_releases": (mx.counter("gpu_allocator_releases", "Times the engine, idle with the caching "
                                              "allocator over its budget, gave the unused blocks back."),),
        }
        # the mux planner's closed loop, per SLO class and metric (tbt, ttft), both as fractions of the target
        control = [*mx.labels, "slo_class", "metric"]
        self._mx_labels = mx.labels
        self.headroom = Gauge("muxd:slo_planning_headroom", "The planner plans to this fraction of the SLO target.",
                              control, registry=self.registry)
        self.observed = Gauge("muxd:slo_observed_tail", "The contract's percentile of recent gaps or first tokens, "
                              "as a fraction of the target.", control, registry=self.registry)
        # the interpreter's garbage collector (engine/gc_pauses.py): a full collection stalls every stream
        gen = [*mx.labels, "generation"]
        self.gc_collections = Counter("muxd:gc_collections", "Garbage collections of the server process, by "
                                      "generation (2: full).", gen, registry=self.registry)
        self.gc_seconds = Counter("muxd:gc_pause_seconds", "Time the server process spent in garbage "
                                  "collections, by generation.", gen, registry=self.registry)
        # the interpreter's two busy threads: the engine's loop and the event loop (HTTP, streaming, metrics); while
        # one runs Python the other waits for the interpreter lock, so their CPU seconds say how much they contend
        self.thread_cpu = Counter("muxd:thread_cpu_seconds", "CPU time of the engine thread and of the server's "
                                  "event loop thread.", [*mx.labels, "thread"], registry=self.registry)
        self._seen: dict[str, float] = {}
        self._success = (mx.by_reason("request_success", "Finished requests by finish reason."),
                         vl.by_reason("request_success", "Count of successfully processed requests."))

    def set_context(self, max_model_len: int) -> None:
        """vLLM's per-request token histograms, whose edges end at the context length (known once the engine is
        built, before the first request)."""
        if not self.request_tokens:
            edges = vllm_token_buckets(max_model_len)
            self.request_tokens = {name: self._vl.hist(f"request_{name}", doc, edges) for name, doc in (
                ("prompt_tokens", "Number of prefill tokens processed."),
                ("generation_tokens", "Number of generation tokens processed."),
                ("params_max_tokens", "Histogram of the max_tokens request parameter."),
                ("max_num_generation_tokens", "Histogram of maximum number of requested generation tokens."),
                ("prefill_kv_computed_tokens", "Histogram of new KV tokens computed during prefill (excluding "
                                               "cached tokens)."))}

    def request_done(self, out: RequestOutput, timer: TokenTimer, max_tokens: int | None = None) -> None:
        """A finished choice: its final output, the timer of its tokens and the max_tokens it was sent with."""
        reason, prompt, cached, generated = (out.finish_reason, out.num_prompt_tokens, out.num_cached_tokens,
                                             out.num_output_tokens)
        elapsed = time.monotonic() - timer.started
        self._observe_phases(elapsed, None if timer.first is None else timer.first - timer.started, out.queued_s,
                             generated)
        if self.request_tokens:
            shape = {"prompt_tokens": prompt, "generation_tokens": generated, "params_max_tokens": max_tokens,
                     "prefill_kv_computed_tokens": prompt - cached}
            for name, value in shape.items():
                if value is not None:
                    self.request_tokens[name].observe(value)
        for metric in self.e2e:
            metric.observe(elapsed)
        for metrics, value in ((self.prompt_tokens, prompt), (self.cached_tokens, cached), (self.cache_queries, prompt),
                               (self.cache_hits, cached), (self.generation_tokens, generated)):
            for metric in metrics:
                metric.inc(value)
        for family, counter in zip(self._families, self._success):
            counter.labels(finished_reason=reason or "abort", **family.labels).inc()

    def step_done(self, outputs: list[RequestOutput]) -> None:
        """An engine step's outputs: its tokens as vLLM counts an iteration's, the tokens it generated and the prompts
        whose prefill it finished (their first token)."""
        tokens = 0
        for out in outputs:
            new = len(out.new_token_ids)
            tokens += new + (out.num_prompt_tokens if new and out.num_output_tokens == new else 0)
        self.step_tokens.observe(tokens)

    def prompt_done(self, n: int, longest: int) -> None:
        """The choices of one prompt all finished: how many it had (n) and the most tokens one generated."""
        self.request_n.observe(n)
        if self.request_tokens:
            self.request_tokens["max_num_generation_tokens"].observe(longest)

    def _observe_phases(self, elapsed: float, ttft: float | None, queued: float | None, generated: int) -> None:
        if queued is not None:
            self.phases["queue"].observe(queued)
            self.phases["inference"].observe(max(0.0, elapsed - queued))
            if ttft is not None:
                self.phases["prefill"].observe(max(0.0, ttft - queued))
        if ttft is not None:
            self.phases["decode"].observe(elapsed - ttft)
            if generated > 1:
                self.request_tpot.observe((elapsed - ttft) / (generated - 1))

    def first_token(self, seconds: float) -> None:
        for metric in self.ttft:
            metric.observe(seconds)

    def between_tokens(self, seconds: float, count: int) -> None:
        for metric in self.tbt:
            metric.observe(seconds, count)

    def render(self, stats: dict[str, float]) -> bytes:
        for key, gauges in self._gauges.items():
            for gauge in gauges:
                gauge.set(stats.get(key, 0))
        for key, counters in self._engine_counters.items():
            self._follow(key, int(stats.get(key, 0)), counters)
        for name, metrics in stats.get("control", {}).items():
            for metric, state in metrics.items():
                self.headroom.labels(slo_class=name, metric=metric, **self._mx_labels).set(state["headroom"])
                if state.get("observed_tail") is not None:
                    self.observed.labels(slo_class=name, metric=metric, **self._mx_labels).set(state["observed_tail"])
        for thread, total in (("engine", stats.get("engine_cpu_s", 0.0)), ("event_loop", time.thread_time())):
            self._follow(f"cpu_{thread}", total, (self.thread_cpu.labels(thread=thread, **self._mx_labels),))
        pauses = stats.get("gc") or {}
        for counter, key in ((self.gc_collections, "collections"), (self.gc_seconds, "seconds")):
            for gen, total in enumerate(pauses.get(key, ())):
                self._follow(f"gc_{key}_{gen}", total, (counter.labels(generation=str(gen), **self._mx_labels),))
        return generate_latest(self.registry)

    def _follow(self, key: str, total: float, counters) -> None:
        """The engine counts; its counters follow it (by what it counted since the last scrape)."""
        for counter in counters:
            counter.inc(max(0, total - self._seen.get(key, 0)))
        self._seen[key] = max(total, self._seen.get(key, 0))


class TokenTimer:
    """Feeds TTFT and time-between-tokens of one request into the histograms as its outputs arrive."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.started = time.monotonic()
        self.first: float | None = None  # when its first token came
        self._last: float | None = None

    def tokens(self, count: int) -> None:
        if count <= 0:
            return
        now = time.monotonic()
        if self._last is None:
            self.first = now
            self.metrics.first_token(now - self.started)
            count -= 1
        if count and self._last is not None:
            self.metrics.between_tokens((now - self._last) / count, count)
        self._last = now
