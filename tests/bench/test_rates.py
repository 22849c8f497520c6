"""`muxd bench sweep --rates`: the flag parsed and refused when wrong, the capacity read off explicit points (highest
pass, interpolated crossing), and a sweep at explicit rates on the simulated executor writing every point."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from appliance.bench.rates import Criterion, estimate, measure_rates, parse_rates
from appliance.bench.report import capacity_lines
from appliance.bench.sweep import SweepPoint
from appliance.cli.main import app
from appliance.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "configs" / "models" / "llama-3.1-8b"
TRACE = ROOT / "tests" / "data" / "azure_code_2023_head200.csv"
CHAT = ROOT / "configs" / "slo" / "chat.yaml"
runner = CliRunner()


def test_rates_parse_for_every_policy_or_per_policy():
    plan = parse_rates("2, 0.5,1")
    assert plan.default == (0.5, 1.0, 2.0) and plan.per_policy == {}
    assert plan.for_policy("mux") == plan.for_policy(None) == (0.5, 1.0, 2.0)
    plan = parse_rates("mux=3,2 chunked=0.5;serial=0.25,0.3")
    assert plan.default is None
    assert plan.per_policy == {"mux": (2.0, 3.0), "chunked": (0.5,), "serial": (0.25, 0.3)}
    plan.check(["mux", "chunked", "serial"])
    mixed = parse_rates("1,2 mux=4")
    assert mixed.for_policy("mux") == (4.0,) and mixed.for_policy("serial") == (1.0, 2.0)


@pytest.mark.parametrize("text, words", [
    ("", "got nothing"), ("  ", "got nothing"), ("1,,2", "empty entry"), ("1,", "empty entry"),
    ("fast", "'fast' in 'fast' is not a number"), ("1,two", "is not a number"), ("0", "finite number > 0"),
    ("-1", "finite number > 0"), ("inf", "finite number > 0"), ("nan", "finite number > 0"),
    ("1,1.0", "given twice"), ("mux=1 mux=2", "'mux' is given twice"), ("=1,2", "no policy name"),
    ("1 2", "more than one list"),
])
def test_bad_rates_name_the_flag(text, words):
    with pytest.raises(ConfigError, match="--rates") as err:
        parse_rates(text)
    assert words in str(err.value)


def test_rate_plan_must_cover_the_policies():
    with pytest.raises(ConfigError, match="names layerwise, which --policies does not sweep"):
        parse_rates("mux=1 layerwise=2").check(["mux", "serial"])
    with pytest.raises(ConfigError, match="no rates for policy 'serial'"):
        parse_rates("mux=1").check(["mux", "serial"])
    with pytest.raises(ConfigError, match="no --policies given"):
        parse_rates("mux=1").check([])
    parse_rates("1,2").check([])  # one target, no policy names: the bare list


def point(rate: float, passed: bool, attainment: float = 1.0, tbt: float = 10.0) -> SweepPoint:
    return SweepPoint(rate, attainment, passed, {"slo_attainment": attainment, "contract_tbt_ms": tbt})


CONDITIONS = [Criterion("slo_attainment", 0.99), Criterion("contract_tbt_ms", 50.0)]


def test_capacity_is_the_highest_pass_and_the_crossing_is_interpolated():
    # attainment 1.0 at 2 req/s, 0.95 at 4: crosses 0.99 a fifth of the way, at 2.4 req/s
    e = estimate([point(4, False, 0.95), point(1, True), point(2, True, 1.0)], CONDITIONS)
    assert e.highest_pass == 2 and e.between == (2, 4) and e.on == "slo_attainment"
    assert e.interpolated == pytest.approx(2.4) and e.best == pytest.approx(2.4)
    assert "interpolated on slo_attainment between 2 and 4" in e.how
    # attainment kept, TBT percentile missed: 40 ms -> 90 ms crosses 50 ms at 1 + 0.2 * (3 - 1)
    e = estimate([point(1, True, tbt=40.0), point(3, False, tbt=90.0)], CONDITIONS)
    assert e.on == "contract_tbt_ms" and e.interpolated == pytest.approx(1.4)
    # both missed: the earlier crossing counts (attainment at 1.5 req/s, TBT at 1 + 10 / 60)
    e = estimate([point(1, True, 1.0, 40.0), point(2, False, 0.98, 100.0)], CONDITIONS)
    assert e.on == "contract_tbt_ms" and e.interpolated == pytest.approx(1 + 1 / 6)


def test_capacity_without_a_bracket_or_a_pass():
    e = estimate([point(1, True), point(2, True)], CONDITIONS)
    assert e.highest_pass == 2 and e.interpolated is None and not e.bracketed and "lower bound" in e.how
    e = estimate([point(1, False, 0.5), point(2, False, 0.4)], CONDITIONS)
    assert e.highest_pass is None and e.best is None and e.how == "no rate passed"
    # a failure no known condition explains (e.g. the TTFT percentile, not recorded): bracketed, not interpolated
    e = estimate([point(1, True), point(2, False)], CONDITIONS)
    assert e.highest_pass == 1 and e.bracketed and e.interpolated is None and e.how == "highest passing rate"
    # not monotone: a failing rate below the highest pass does not lower the capacity
    e = estimate([point(1, False, 0.9), point(2, True), point(3, False, 0.97)], CONDITIONS)
    assert e.highest_pass == 2 and e.between == (2, 3)
    assert e.failed_below == (1,) and e.how.endswith("; a lower rate failed (1 req/s)")


def test_capacity_line_names_a_failing_rate_below_the_highest_pass():
    """The measured serial sweep on Azure failed p99 TBT at 0.09 req/s and passed at 0.1: the line must not claim
    that no tested rate failed."""
    res = measure_rates(lambda r: {"slo_attainment": 1.0, "contract_tbt_ms": 51.9 if r < 0.095 else 50.0},
                        (0.09, 0.1), 0.99, label="serial", passes=lambda s: s["contract_tbt_ms"] <= 50.0)
    (line,) = capacity_lines([res])
    assert "capacity 0.100 req/s" in line and "no higher tested rate failed" in line
    assert "a lower rate failed (0.09 req/s)" in line and "no tested rate failed" not in line
    res = measure_rates(lambda r: {"slo_attainment": 1.0}, (1.0, 2.0), 0.99, label="mux")
    (line,) = capacity_lines([res])
    assert line.endswith("(a lower bound: no higher tested rate failed)")


def test_measure_rates_measures_exactly_the_rates_given():
    calls: list[float] = []

    def measure(rate: float) -> dict:
        calls.append(rate)
        return {"slo_attainment": 1.0 if rate <= 3 else 0.9}

    res = measure_rates(measure, (1.0, 2.0, 3.0, 5.0), 0.95, label="mux")
    assert calls == [1.0, 2.0, 3.0, 5.0] and res.mode == "rates" and res.capacity == 3.0 and res.bracketed
    assert res.estimate.interpolated == pytest.approx(3 + 0.05 / 0.1 * 2)
    with pytest.raises(ConfigError, match="--attainment"):
        measure_rates(measure, (1.0,), 1.5)


@pytest.mark.parametrize("extra, words", [
    (["--rates", "1,2", "--start-rate", "3"], "--start-rate"),
    (["--rates", "1,2", "--max-points", "4", "--tolerance", "0.1"], "--tolerance, --max-points"),
    (["--rates", ""], "--rates: expected request rates"),
    (["--rates", "1,-2"], "--rates: every rate must be"),
    (["--rates", "mux=1", "--policies", "mux,serial"], "no rates for policy 'serial'"),
])
def test_sweep_refuses_bad_rates(tmp_path, extra, words):
    args = ["bench", "sweep", "--simulate", "--trace", str(TRACE), "--max-requests", "10", "--model", str(MODEL),
            "--slo", str(CHAT), "--result-dir", str(tmp_path), "--no-progress", *extra]
    result = runner.invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 2 and words in result.output, result.output
    assert not (tmp_path / "summary.csv").exists()


def test_simulated_sweep_at_explicit_rates_writes_every_point(tmp_path):
    rates = {"mux": [0.25, 1.0, 4.0, 64.0], "serial": [0.25, 1.0, 4.0]}
    args = ["bench", "sweep", "--simulate", "--trace", str(TRACE), "--max-requests", "40", "--max-model-len",
            "8192", "--model", str(MODEL), "--gpu", "h200", "--slo", str(CHAT), "--attainment", "0.99",
            "--policies", "mux,serial", "--rates", "mux=64,4,1,0.25 serial=0.25,1,4",
            "--result-dir", str(tmp_path), "--no-progress"]
    result = runner.invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    rows = list(csv.DictReader((tmp_path / "summary.csv").open()))
    for policy, expected in rates.items():
        mine = [r for r in rows if r["policy"] == policy]
        assert [float(r["request_rate"]) for r in mine] == expected
        assert all(float(r["completed"]) + float(r["failed"]) == 40 for r in mine)
    assert {r["target_slo_attainment"] for r in rows} == {"0.99"}
    assert {r["target_contract_tbt_ms"] for r in rows} == {"50.0"} and {r["trace"] for r in rows} == {str(TRACE)}
    sweeps = {s["policy"]: s for s in json.loads((tmp_path / "sweep.json").read_text())}
    for policy, s in sweeps.items():
        assert s["mode"] == "rates"
        passed = [p["request_rate"] for p in s["points"] if p["passed"]]
        assert s["capacity"] == (max(passed) if passed else None)
        if s["interpolated_capacity"] is not None:
            lo, hi = s["interpolated_between"]
            assert lo == s["capacity"] and lo <= s["interpolated_capacity"] <= hi
    # at 64 req/s 40 requests of up to 8k tokens overload one GPU: mux must fail there, so its capacity is bracketed
    assert sweeps["mux"]["bracketed"] and sweeps["mux"]["capacity"] is not None
    assert "(the highest measured rate that passed)" in result.output
    assert (tmp_path / "attainment_vs_rate.png").read_bytes()[:4] == b"\x89PNG"
