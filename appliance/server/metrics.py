"""Prometheus metrics of the server, named `muxd:*` after vLLM's `vllm:*`: latency histograms recorded per request by
the API layer, and engine gauges refreshed from the engine's published stats at scrape time.
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

disable_created_metrics()  # no *_created series, as in vLLM

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)
_TBT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.registry = registry = CollectorRegistry()
        labels = ["model_name"]
        self._labels = {"model_name": model_name}

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, registry=registry, buckets=buckets).labels(**self._labels)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=registry).labels(**self._labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=registry).labels(**self._labels)

        self.ttft = hist("muxd:time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS)
        self.tbt = hist("muxd:inter_token_latency_seconds", "Time between consecutive output tokens.", _TBT_BUCKETS)
        self.e2e = hist("muxd:e2e_request_latency_seconds", "End-to-end request latency.", _LATENCY_BUCKETS)
        self.running = gauge("muxd:num_requests_running", "Requests prefilling or decoding.")
        self.waiting = gauge("muxd:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("muxd:kv_cache_usage_perc", "Fraction of KV-cache pages in use (1 = full).")
        self.kv_free = gauge("muxd:kv_cache_free_pages", "KV-cache pages free or reclaimable from the prefix cache.")
        self.prompt_tokens = counter("muxd:prompt_tokens", "Prompt tokens of finished requests.")
        self.cached_tokens = counter("muxd:cached_prompt_tokens", "Prompt tokens served from the prefix cache.")
        self.generation_tokens = counter("muxd:generation_tokens", "Generated tokens.")
        self.preemptions = counter("muxd:num_preemptions", "Requests preempted (pages freed, to be recomputed) when "
                                   "the KV cache ran out.")
        self._preemptions_seen = 0
        # prefill-decode multiplexing: the partition in use and how often it moves
        self.decode_sms = gauge("muxd:decode_sms", "SMs of the partition decode ran on last (0 without partitions).")
        self.switches = counter("muxd:partition_switches", "Times decode moved to another SM partition.")
        self.layers = counter("muxd:prefill_layers_launched", "Prefill layer ranges launched, in layers.")
        self.prefill_pauses = counter("muxd:prefill_pauses", "Prefill batches paused between layers for a more "
                                      "urgent prompt (mux).")
        self._seen: dict[str, int] = {}
        # the mux planner's closed loop, per SLO class and metric (tbt, ttft), both as fractions of the target
        self.headroom = Gauge("muxd:slo_planning_headroom", "The planner plans to this fraction of the SLO target.",
                              labels + ["slo_class", "metric"], registry=registry)
        self.observed = Gauge("muxd:slo_observed_tail", "The contract's percentile of recent gaps or first tokens, "
                              "as a fraction of the target.", labels + ["slo_class", "metric"], registry=registry)
        self._success = Counter("muxd:request_success", "Finished requests by finish reason.",
                                labels + ["finished_reason"], registry=registry)

    def request_done(self, reason: str | None, prompt: int, cached: int, generated: int, started: float) -> None:
        self.e2e.observe(time.monotonic() - started)
        self.prompt_tokens.inc(prompt)
        self.cached_tokens.inc(cached)
        self.generation_tokens.inc(generated)
        self._success.labels(finished_reason=reason or "abort", **self._labels).inc()

    def render(self, stats: dict[str, float]) -> bytes:
        self.running.set(stats["num_running"])
        self.waiting.set(stats["num_waiting"])
        self.kv_usage.set(stats["kv_usage"])
        self.kv_free.set(stats["free_pages"])
        total = int(stats.get("num_preemptions", 0))
        self.preemptions.inc(max(0, total - self._preemptions_seen))  # the engine counts; the counter follows it
        self._preemptions_seen = max(total, self._preemptions_seen)
        self.decode_sms.set(stats.get("decode_sms", 0))
        for key, counter in (("partition_switches", self.switches), ("prefill_layers_launched", self.layers),
                             ("prefill_pauses", self.prefill_pauses)):
            total = int(stats.get(key, 0))
            counter.inc(max(0, total - self._seen.get(key, 0)))  # the engine counts; the counters follow it
            self._seen[key] = max(total, self._seen.get(key, 0))
        for name, metrics in stats.get("control", {}).items():
            for metric, state in metrics.items():
                self.headroom.labels(slo_class=name, metric=metric, **self._labels).set(state["headroom"])
                if state.get("observed_tail") is not None:
                    self.observed.labels(slo_class=name, metric=metric, **self._labels).set(state["observed_tail"])
        return generate_latest(self.registry)


class TokenTimer:
    """Feeds TTFT and time-between-tokens of one request into the histograms as its outputs arrive."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.started = time.monotonic()
        self._last: float | None = None

    def tokens(self, count: int) -> None:
        if count <= 0:
            return
        now = time.monotonic()
        if self._last is None:
            self.metrics.ttft.observe(now - self.started)
            count -= 1
        elif count:
            gap = (now - self._last) / count
            for _ in range(count):
                self.metrics.tbt.observe(gap)
        self._last = now
