"""The contract's verdict on a replay: the TBT percentile over every gap, and the same percentile split into the gaps
after first tokens and the others (where a TBT miss comes from)."""
from __future__ import annotations

import pytest

from appliance.slo.attainment import evaluate
from appliance.slo.contract import parse_contract
from appliance.workload.metrics import RequestTimeline
from appliance.workload.traces import RequestSpec

CONTRACT = parse_contract("""\
name: t
attainment: 0.99
targets:
  ttft: {ms: 600}
  tbt: {ms: 50, percentile: 99}
""")


def replay(first_gap: float, later_gap: float, count: int = 100, tokens: int = 20):
    """`count` requests, each with its first token 0.1 s after arrival, then one gap of `first_gap` seconds and
    gaps of `later_gap`."""
    specs, timelines = [], []
    for i in range(count):
        times = [i + 0.1, i + 0.1 + first_gap]
        while len(times) < tokens:
            times.append(times[-1] + later_gap)
        specs.append(RequestSpec(arrival=float(i), prompt_len=100, output_len=tokens))
        timelines.append(RequestTimeline(arrival=float(i), token_times=times, prompt_tokens=100, index=i))
    return timelines, specs


def test_a_tbt_miss_from_the_gaps_after_first_tokens_is_told_apart():
    # one gap in 19 is a first token's: 5.3 % of the gaps at 80 ms puts the p99 over every gap there
    report = evaluate(CONTRACT, *replay(0.080, 0.030))
    assert report.tbt_ms == pytest.approx(80.0) and "tbt" in report.misses
    assert report.tbt_first_gap_ms == pytest.approx(80.0) and report.tbt_later_gaps_ms == pytest.approx(30.0)
    report = evaluate(CONTRACT, *replay(0.030, 0.040))
    assert report.met and report.tbt_first_gap_ms == pytest.approx(30.0)
    assert report.tbt_later_gaps_ms == pytest.approx(40.0) == report.tbt_ms
    one_token, specs = replay(0.030, 0.030, count=3, tokens=1)  # no gap at all
    report = evaluate(CONTRACT, [RequestTimeline(arrival=t.arrival, token_times=t.token_times[:1], prompt_tokens=100)
                                 for t in one_token], specs)
    assert report.tbt_ms == report.tbt_first_gap_ms == report.tbt_later_gaps_ms == 0.0
