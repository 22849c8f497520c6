"""TokenHistogram (server/metrics.py): the time between tokens served as prometheus_client's Histogram serves it,
from observations folded at scrape time (or when many wait)."""
from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from appliance.server.metrics import VLLM_ITL_BUCKETS, TokenHistogram

LABELS = {"model_name": "m", "engine": "0"}


def served(registry: CollectorRegistry) -> tuple[list[str], dict]:
    text = generate_latest(registry).decode()
    heads = [line for line in text.splitlines() if line.startswith("#")]
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    return heads, samples


@pytest.mark.parametrize("fold_at", [TokenHistogram.FOLD_AT, 7])  # folded at scrape, or along the way
def test_served_as_prometheus_clients_histogram_serves_it(monkeypatch, fold_at):
    monkeypatch.setattr(TokenHistogram, "FOLD_AT", fold_at)
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    reference = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                          list(LABELS), registry=theirs, buckets=VLLM_ITL_BUCKETS).labels(**LABELS)
    mine = TokenHistogram(ours, "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                          LABELS, VLLM_ITL_BUCKETS)
    rng = random.Random(0)
    # values on the edges themselves, between them, beyond the last one; some observed several times at once
    values = [*VLLM_ITL_BUCKETS, 0.0, 1e-4, 100.0, *(rng.expovariate(20) for _ in range(500))]
    for round_ in range(2):  # two scrapes: counts go on from the first
        for v in values:
            count = rng.choice((1, 1, 1, 3))
            for _ in range(count):
                reference.observe(v)
            mine.observe(v, count)
        (their_heads, their_samples), (our_heads, our_samples) = served(theirs), served(ours)
        assert our_heads == their_heads
        assert our_samples.keys() == their_samples.keys()
        for key, value in their_samples.items():
            if key[0].endswith("_sum"):
                assert our_samples[key] == pytest.approx(value, rel=1e-12)
            else:
                assert our_samples[key] == value, key
