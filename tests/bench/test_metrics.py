"""Metrics, attainment and goodput on a hand-made timeline whose answers are worked out by hand."""
from __future__ import annotations

import pytest

from appliance.errors import ConfigError
from appliance.workload.metrics import (
    GoodputSLO,
    RequestTimeline,
    good_flags,
    parse_goodput,
    request_metrics,
    summarize,
)
from appliance.workload.traces import RequestSpec


def timelines() -> list[RequestTimeline]:
    return [
        RequestTimeline(0.0, [0.1, 0.2, 0.3, 0.4], prompt_tokens=10, index=0),        # A
        RequestTimeline(1.0, [1.5, 1.55, 1.6], prompt_tokens=20, index=1),             # B
        RequestTimeline(2.0, [2.05], prompt_tokens=5, index=2),                        # C: one output token
        RequestTimeline(2.5, [], prompt_tokens=7, error="HTTP 500: boom", index=3),    # D: failed
        # E: sent 50 ms late; three chunks carried five tokens
        RequestTimeline(3.0, [3.2, 3.3, 3.9], output_tokens=5, prompt_tokens=30, sent=3.05, index=4),
    ]


SPECS = [RequestSpec(0.0, 10, 4), RequestSpec(1.0, 2000, 3), RequestSpec(2.0, 5, 1), RequestSpec(2.5, 7, 2),
         RequestSpec(3.0, 30, 5)]


def test_per_request_metrics():
    a, b, c, _, e = timelines()
    ma = request_metrics(a)
    assert (ma.ttft, ma.e2el, ma.tpot) == pytest.approx((0.1, 0.4, 0.1))
    assert ma.itls == pytest.approx((0.1, 0.1, 0.1))
    assert request_metrics(b).tpot == pytest.approx(0.05)
    assert request_metrics(c).tpot == 0.0 and request_metrics(c).itls == ()
    me = request_metrics(e)
    assert (me.ttft, me.e2el, me.lag) == pytest.approx((0.2, 0.9, 0.05))  # latency counts from the schedule
    assert me.tpot == pytest.approx(0.7 / 4)                                 # 5 tokens, not 3 chunks
    with pytest.raises(ValueError, match="did not complete"):
        request_metrics(timelines()[3])


def test_summary_with_vllm_keys_and_known_values():
    slo = parse_goodput(["ttft:300", "tpot:120"])
    r = summarize(timelines(), slo=slo)
    assert r["duration"] == pytest.approx(3.9)  # first scheduled arrival -> last token
    assert (r["completed"], r["failed"]) == (4, 1)
    assert r["total_input_tokens"] == 65 and r["total_output_tokens"] == 13
    assert r["request_throughput"] == pytest.approx(4 / 3.9)
    assert r["output_throughput"] == pytest.approx(13 / 3.9)
    assert r["total_token_throughput"] == pytest.approx(78 / 3.9)
    # good: A (ttft 100, tpot 100) and C (ttft 50, tpot 0); B misses TTFT, E misses TPOT, D failed
    assert r["good_requests"] == 2
    assert r["request_goodput"] == pytest.approx(2 / 3.9)
    assert r["slo_attainment"] == pytest.approx(2 / 5)
    assert r["mean_ttft_ms"] == pytest.approx(212.5)
    assert r["median_ttft_ms"] == pytest.approx(150.0) and r["p50_ttft_ms"] == pytest.approx(150.0)
    assert r["p99_ttft_ms"] == pytest.approx(491.0)   # sorted 50,100,200,500: position 0.99 * 3 = 2.97
    assert r["mean_tpot_ms"] == pytest.approx((100 + 50 + 175) / 3)  # the one-token request has no TPOT
    assert r["mean_itl_ms"] == pytest.approx(1100 / 7)
    assert r["p90_itl_ms"] == pytest.approx(300.0)    # gaps sorted 50,50,100,100,100,100,600: 0.9*6 = 5.4
    assert r["mean_e2el_ms"] == pytest.approx(487.5)
    assert r["std_e2el_ms"] > 0
    assert (r["mean_client_lag_ms"], r["max_client_lag_ms"]) == pytest.approx((12.5, 50.0))
    assert r["slo"] == "ttft:300 tpot:120"


def test_boundaries_and_every_gap_target():
    # vLLM counts a request that equals its target as good
    assert good_flags(timelines()[:1], parse_goodput(["ttft:100"])) == [True]
    assert good_flags(timelines()[:1], parse_goodput(["ttft:99.9"])) == [False]
    # tbt bounds every gap: E's 600 ms gap fails although its TPOT is 175 ms
    flags = good_flags(timelines(), GoodputSLO({"tbt": 150}))
    assert flags == [True, True, True, False, False]
    assert summarize(timelines(), slo=parse_goodput(["e2el:500"]))["good_requests"] == 2  # A and C


def test_without_slo_no_goodput_and_detail_arrays():
    r = summarize(timelines(), detailed=True)
    assert r["request_goodput"] is None and r["slo_attainment"] is None
    assert r["output_lens"] == [4, 3, 1, 0, 5]
    assert r["ttfts"] == pytest.approx([0.1, 0.5, 0.05, 0.0, 0.2])
    assert r["errors"][3] == "HTTP 500: boom"
    empty = summarize([RequestTimeline(0.0, error="refused")], slo=parse_goodput(["ttft:1"]))
    assert (empty["completed"], empty["request_throughput"], empty["slo_attainment"]) == (0, 0.0, 0.0)


class PerClass:
    """A contract-like SLO: long prompts get a looser TTFT target (the plug-in point for YAML contracts)."""

    def targets_for(self, spec):
        return {"ttft": 600.0 if spec is not None and spec.prompt_len >= 1000 else 300.0}


def test_per_request_targets_plug_in():
    assert good_flags(timelines(), PerClass(), SPECS) == [True, True, True, False, True]
    assert summarize(timelines(), slo=PerClass(), specs=SPECS)["good_requests"] == 4
    assert good_flags(timelines(), PerClass()) == [True, False, True, False, True]  # no specs: default class


@pytest.mark.parametrize("pairs, message", [
    (["ttft=300"], "unknown metric 'ttft=300'"), (["itl:5"], "unknown metric 'itl'"),
    (["tpot:fast"], "needs a target in milliseconds"), (["e2el:-1"], "needs a target"),
])
def test_parse_goodput_errors(pairs, message):
    with pytest.raises(ConfigError, match=message):
        parse_goodput(pairs)


def test_parse_goodput_forms():
    assert parse_goodput([]) is None
    assert parse_goodput(["ttft:300 tpot:50"]).targets == {"ttft": 300.0, "tpot": 50.0}
    assert parse_goodput(["ttft:300,e2el:2000"]).targets == {"ttft": 300.0, "e2el": 2000.0}


def test_vllm_peak_keys_and_latencies():
    r = summarize(timelines(), detailed=True)
    # token arrivals per second from the first arrival: A's four in [0, 1) s, then 3, 1 and E's three chunks
    assert r["max_output_tokens_per_s"] == 4.0
    assert r["max_concurrent_requests"] == 1  # A, B, C and E never overlap (D failed)
    assert r["latencies"] == pytest.approx([0.4, 0.6, 0.05, 0.0, 0.9])  # E2E per request, in seconds
    overlapping = [RequestTimeline(0.0, [0.5, 1.0]), RequestTimeline(0.2, [0.6]), RequestTimeline(1.0, [1.2])]
    assert summarize(overlapping)["max_concurrent_requests"] == 2  # the first ends as the third starts
    empty = summarize([RequestTimeline(0.0, error="refused")])
    assert (empty["max_output_tokens_per_s"], empty["max_concurrent_requests"]) == (0.0, 0)
