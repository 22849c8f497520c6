"""`muxd bench compare`: two hand-built summary.csv files (measured, simulated) read back, capacities (interpolated
on the condition missed), the simulation's error, capacity ratios, the common rate, and the Markdown and PNG written."""
from __future__ import annotations

import csv
from pathlib import Path

import pytest
from typer.testing import CliRunner

from appliance.bench import compare as cmp
from appliance.cli.main import app
from appliance.errors import ConfigError

COLUMNS = ("policy", "request_rate", "passed", "slo_attainment", "contract_tbt_ms", "p99_ttft_ms", "p99_itl_ms",
           "target_slo_attainment", "target_contract_tbt_ms", "trace")
# policy, rate, passed, attainment, contract TBT percentile (ms), p99 TTFT (ms)
MEASURED = [("mux", 1, True, 1.0, 20, 300), ("mux", 2, True, 0.995, 22, 500), ("mux", 3, False, 0.965, 24, 1500),
            ("chunked", 0.5, True, 1.0, 45, 250), ("chunked", 1, False, 1.0, 55, 260),
            ("chunked", 2, False, 0.9, 70, 2000),
            ("serial", 0.5, True, 1.0, 40, 240), ("serial", 1, False, 1.0, 140, 250),
            ("serial", 2, False, 0.95, 400, 900)]
SIMULATED = [("mux", 1, True, 1.0, 18, 280), ("mux", 2, True, 1.0, 19, 450), ("mux", 3, False, 0.96, 21, 1400),
             ("chunked", 0.5, True, 1.0, 44, 240), ("chunked", 1, False, 1.0, 56, 250),
             ("serial", 0.5, True, 1.0, 30, 230), ("serial", 1, True, 1.0, 45, 240),
             ("serial", 2, False, 1.0, 95, 260)]


def write_csv(path: Path, points, targets: bool = True) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    with (path / "summary.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(COLUMNS if targets else COLUMNS[:7])
        for policy, rate, passed, att, tbt, ttft in points:
            row = [policy, rate, passed, att, tbt, ttft, tbt + 1]
            writer.writerow(row + ([0.99, 50.0, "traces/azure_code_2023.csv"] if targets else []))
    return path


@pytest.fixture
def dirs(tmp_path):
    return write_csv(tmp_path / "measured", MEASURED), write_csv(tmp_path / "simulated", SIMULATED)


def test_capacities_errors_and_ratios(dirs):
    measured, simulated = cmp.read_summary(dirs[0]), cmp.read_summary(dirs[1] / "summary.csv")
    assert measured.target == 0.99 and measured.tbt_target == 50.0 and measured.trace.endswith("azure_code_2023.csv")
    m = {p: c.estimate for p, c in measured.curves.items()}
    s = {p: c.estimate for p, c in simulated.curves.items()}
    assert list(m) == ["mux", "chunked", "serial"]
    # mux misses attainment (0.995 -> 0.965), chunked and serial the TBT percentile (attainment stays 100 %)
    assert (m["mux"].on, m["chunked"].on, m["serial"].on) == ("slo_attainment", "contract_tbt_ms", "contract_tbt_ms")
    assert m["mux"].highest_pass == 2 and m["mux"].best == pytest.approx(2 + 0.005 / 0.03)
    assert m["chunked"].best == pytest.approx(0.75) and m["serial"].best == pytest.approx(0.55)
    assert s["mux"].best == pytest.approx(2.25) and s["chunked"].best == pytest.approx(0.75)
    assert s["serial"].highest_pass == 1 and s["serial"].best == pytest.approx(1.1)
    assert cmp.error_pct(m["mux"], s["mux"]) == pytest.approx(100 * (2.25 / (2 + 1 / 6) - 1))
    assert cmp.error_pct(m["chunked"], s["chunked"]) == pytest.approx(0.0)
    assert cmp.error_pct(m["serial"], s["serial"]) == pytest.approx(100.0)
    assert cmp.ratios(measured, "mux") == {"chunked": pytest.approx((2 + 1 / 6) / 0.75),
                                            "serial": pytest.approx((2 + 1 / 6) / 0.55)}
    assert cmp.ratios(simulated, "mux") == {"chunked": pytest.approx(3.0), "serial": pytest.approx(2.25 / 1.1)}
    # rates measured for all three: 1 and 2; at 2 mux still keeps the SLO
    assert cmp.common_rate(measured)[0] == 2
    assert cmp.common_rate(measured, at_rate=0.5) == (0.5, "the rate asked for (--at-rate)")


def test_compare_writes_markdown_and_plot(dirs, tmp_path):
    out = tmp_path / "report"
    result = CliRunner().invoke(app, ["bench", "compare", str(dirs[0]), str(dirs[1]), "--out", str(out)],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    text = (out / "comparison.md").read_text()
    assert text.startswith("## Goodput: azure_code_2023.csv")
    rows: dict[str, list[str]] = {}  # the first row of each name: the capacity table, then the ratios
    for line in text.splitlines():
        if line.startswith("| "):
            rows.setdefault(line.split("|")[1].strip(), [c.strip() for c in line.split("|")[2:-1]])
    assert rows["mux"][:6] == ["2.17", "interpolated on slo_attainment between 2 and 3 req/s", "2.25",
                               "interpolated on slo_attainment between 2 and 3 req/s", "+3.8 %", "yes"]
    assert rows["serial"][0] == "0.55" and rows["serial"][2] == "1.1" and rows["serial"][4:6] == ["+100.0 %", "no"]
    assert rows["chunked"][4:6] == ["+0.0 %", "yes"]
    assert rows["mux / chunked"] == ["2.89x", "3.00x"] and rows["mux / serial"] == ["3.94x", "2.05x"]
    assert "At 2 req/s (the highest rate measured for every policy at which at least one kept the SLO)" in text
    # at 2 req/s: mux measured and simulated; chunked measured only (the simulation stopped at 1 req/s)
    latency = [line for line in text.splitlines() if line.startswith("| chunked |")][-1]
    assert [c.strip() for c in latency.split("|")[2:-1]] == ["90.0", "-", "2000", "-", "71.0", "-", "no / -"]
    assert (out / "attainment_measured_vs_simulated.png").read_bytes()[:4] == b"\x89PNG"
    assert "comparison.md" in result.output


def test_compare_reads_old_files_with_an_attainment_and_refuses_bad_ones(tmp_path):
    old = write_csv(tmp_path / "old", MEASURED, targets=False)
    with pytest.raises(ConfigError, match="pass --attainment"):
        cmp.read_summary(old)
    assert cmp.read_summary(old, attainment=0.99).curves["mux"].estimate.best == pytest.approx(2 + 1 / 6)
    with pytest.raises(ConfigError, match="no such file"):
        cmp.read_summary(tmp_path / "nowhere")
    (tmp_path / "bad.csv").write_text("policy,request_rate\nmux,1\n")
    with pytest.raises(ConfigError, match="missing column"):
        cmp.read_summary(tmp_path / "bad.csv")
    (tmp_path / "bad2.csv").write_text("policy,request_rate,passed,slo_attainment\nmux,fast,True,1.0\n")
    with pytest.raises(ConfigError, match="bad2.csv:2"):
        cmp.read_summary(tmp_path / "bad2.csv", attainment=0.9)
    result = CliRunner().invoke(app, ["bench", "compare", str(tmp_path / "nowhere"), str(old)])
    assert result.exit_code == 2 and "no such file" in result.output
