"""Capacity search: the bracketing + bisection logic on a known step, and `muxd bench sweep` against a fake server
whose latency grows with load (capacity exactly 1 / service time)."""
from __future__ import annotations

import csv
import json
import math

import pytest
from fake_server import FakeServer
from typer.testing import CliRunner

from appliance.bench.sweep import find_capacity
from appliance.cli.main import app
from appliance.errors import ConfigError


def step(capacity: float, calls: list[float]):
    def measure(rate: float) -> dict:
        calls.append(rate)
        return {"slo_attainment": 1.0 if rate <= capacity else 0.5}
    return measure


def test_bracketing_then_bisection_finds_the_step():
    calls: list[float] = []
    res = find_capacity(step(7.3, calls), target=0.9, start_rate=1.0, tolerance=0.02, max_points=20)
    assert calls[:5] == [1.0, 2.0, 4.0, 8.0, 6.0]       # doubling until a failure, then bisection
    assert 7.3 / 1.02 <= res.capacity <= 7.3 and res.bracketed
    hi = min(p.rate for p in res.points if not p.passed)
    assert (hi - res.capacity) / res.capacity <= 0.02
    down: list[float] = []
    res = find_capacity(step(0.3, down), target=0.9, start_rate=4.0, tolerance=0.05)
    assert down[:5] == [4.0, 2.0, 1.0, 0.5, 0.25] and 0.3 / 1.05 <= res.capacity <= 0.3


def test_capacity_bounds():
    res = find_capacity(step(0.001, []), target=0.9, start_rate=1.0, min_rate=0.1)
    assert res.capacity is None and [p.rate for p in res.points] == [1.0, 0.5, 0.25, 0.125, 0.1]
    res = find_capacity(step(100.0, []), target=0.9, start_rate=10.0, max_rate=30.0)
    assert res.capacity == 30.0 and not res.bracketed
    res = find_capacity(step(50.0, []), target=0.9, start_rate=1.0, max_points=3)
    assert len(res.points) == 3 and res.capacity == 4.0
    with pytest.raises(ConfigError, match="--attainment"):
        find_capacity(step(1, []), target=1.5, start_rate=1.0)
    with pytest.raises(ConfigError, match="needs an SLO"):
        find_capacity(lambda rate: {"slo_attainment": None}, target=0.9, start_rate=1.0)


def test_sweep_finds_the_capacity_of_a_fake_server(tmp_path):
    service = 0.05  # one request at a time, 50 ms each: capacity 20 req/s
    out = tmp_path / "sweep"
    for attempt in range(2):  # a replay is real time: a host stall of a second under a loaded CI fails a point
        with FakeServer(service) as server:
            result = CliRunner().invoke(app, [
                "bench", "sweep", "--url", server.url, "--tokenizer", "embedded", "--num-prompts", "20",
                "--input-len", "8", "--output-len", "2", "--request-rate", "10", "--burstiness", "inf",
                "--goodput", "ttft:150", "--attainment", "0.9", "--start-rate", "16", "--min-rate", "5",
                "--tolerance", "0.1", "--result-dir", str(out), "--save-detailed", "--no-progress"],
                env={"COLUMNS": "160"})
        assert result.exit_code == 0, result.output
        sweep = json.loads((out / "sweep.json").read_text())[0]
        if 18.0 <= sweep["capacity"] <= 24.0:
            break
    # up to 20 req/s nothing queues (TTFT = 50 ms); above, each request waits (50 ms - gap) longer than the one
    # before, and 90% of 20 requests stay within 150 ms only up to about 22.7 req/s
    assert 18.0 <= sweep["capacity"] <= 24.0, result.output
    assert sweep["bracketed"]
    rows = list(csv.DictReader((out / "summary.csv").open()))
    assert len(rows) == len(sweep["points"]) >= 3
    assert {"request_rate", "passed", "slo_attainment", "request_goodput", "p99_ttft_ms"} <= set(rows[0])
    for row in rows:
        assert (row["passed"] == "True") == (float(row["slo_attainment"]) >= 0.9)
        assert float(row["completed"]) == 20
        # each point's whole result, per-request arrays included (--save-detailed)
        point = json.loads(next((out / "points").glob(f"*-{float(row['request_rate']):g}.json")).read_text())
        assert point["slo_attainment"] == float(row["slo_attainment"]) and len(point["ttfts"]) == 20
    assert len(list((out / "points").iterdir())) == len(rows)
    assert (out / "attainment_vs_rate.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "capacity" in result.output and "muxd bench sweep" in result.output


def test_replay_draws_the_timeline_a_server_exposes(tmp_path):
    with FakeServer(0.002) as server:
        result = CliRunner().invoke(app, [
            "bench", "--url", server.url, "--tokenizer", "embedded", "--num-prompts", "5", "--input-len", "8",
            "--output-len", "3", "--request-rate", "50", "--result-dir", str(tmp_path), "--no-progress"])
    assert result.exit_code == 0, result.output
    pngs = list(tmp_path.glob("timeline-*.png"))
    assert len(pngs) == 1 and pngs[0].read_bytes()[:4] == b"\x89PNG"
    report = json.loads((tmp_path / "result.json").read_text())
    assert report["completed"] == 5 and report["total_output_tokens"] == 15
    assert not math.isnan(report["mean_ttft_ms"])


def test_timeline_plot_reads_the_executor_timeline(tmp_path):
    from appliance.bench.plots import timeline_plot
    from appliance.engine.timeline import Timeline

    timeline = Timeline()
    for step in range(4):
        t = step * 0.01
        timeline.span("decode", "decode partition", t, t + 0.004)
        timeline.span("prefill L0-2", "prefill partition", t, t + 0.009)
    timeline.instant("merge", "prefill partition")
    assert timeline_plot(timeline.chrome_trace()["traceEvents"], tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"
    assert timeline_plot([{"ph": "i", "ts": 1.0, "pid": 1, "tid": 0}], tmp_path / "none.png") is None


def test_sweep_needs_an_slo():
    result = CliRunner().invoke(app, ["bench", "sweep", "--url", "http://127.0.0.1:9", "--tokenizer", "embedded"])
    assert result.exit_code == 2 and "needs an SLO" in result.output
