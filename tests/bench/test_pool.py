"""`muxd bench pool`: slices of one replay judged as one. A single point pooled gives back its own verdict; two
simulated slices pool to the counts and percentiles of all their requests; hand-made points check the arithmetic;
points that cannot be pooled are refused with the reason."""
from __future__ import annotations

import csv
import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from appliance.bench.pool import pool, read_point
from appliance.cli.main import app
from appliance.errors import ConfigError
from appliance.slo.contract import load_contract

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "configs" / "models" / "llama-3.1-8b"
TRACE = ROOT / "tests" / "data" / "azure_code_2023_head200.csv"
CHAT = ROOT / "configs" / "slo" / "chat.yaml"
runner = CliRunner()


def _slice(tmp_path: Path, skip: int, n: int, rate: float = 2.0) -> Path:
    out = tmp_path / f"slice-{skip}"
    args = ["bench", "sweep", "--simulate", "--trace", str(TRACE), "--skip", str(skip), "--max-requests", str(n),
            "--max-model-len", "8192", "--model", str(MODEL), "--gpu", "h200", "--slo", str(CHAT),
            "--policies", "mux", "--rates", str(rate), "--save-detailed", "--result-dir", str(out), "--no-progress",
            "--device-spread", "0"]  # one replay: its per-request arrays are the verdict's
    result = runner.invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    (point,) = (out / "points").glob("*.json")
    return point


def test_slices_of_a_simulated_replay_pool_to_all_their_requests(tmp_path):
    contract = load_contract(CHAT)
    first, second = _slice(tmp_path, 0, 30), _slice(tmp_path, 30, 30)
    a, b = read_point(first), read_point(second)
    alone = pool([a], contract)  # one point pooled is that point's own verdict
    assert alone.requests == 30 and alone.attainment == pytest.approx(a["slo_attainment"])
    assert alone.ttft_ok == pytest.approx(a["contract_ttft_ok"]) and alone.tbt_ms == pytest.approx(a["contract_tbt_ms"])
    assert alone.ttft_ms["p99"] == pytest.approx(a["p99_ttft_ms"]) and alone.passed == a["contract_met"]
    assert alone.tbt_first_gap_ms == pytest.approx(a["contract_tbt_first_gap_ms"])
    assert alone.tbt_later_gaps_ms == pytest.approx(a["contract_tbt_later_gaps_ms"])
    both = pool([a, b], contract)
    assert both.requests == 60 and both.good == a["good_requests"] + b["good_requests"]
    gaps = np.concatenate([np.concatenate([np.asarray(x) for x in p["itls"] if x]) for p in (a, b)]) * 1e3
    assert both.tbt_ms == pytest.approx(np.percentile(gaps, contract.slo_for(None).tbt_percentile))
    out = tmp_path / "pooled.json"
    result = runner.invoke(app, ["bench", "pool", str(first), str(second), "--slo", str(CHAT), "--out", str(out)],
                           env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "60 requests in 2 slices" in result.output
    saved = json.loads(out.read_text())
    assert saved["requests"] == 60 and saved["contract_tbt_ms"] == pytest.approx(both.tbt_ms)
    assert saved["passed"] == both.passed and saved["sources"] == [str(first), str(second)]


def _point(ttfts, itls, good, ttft_ok, rate=1.0, policy="chunked", errors=None) -> dict:
    return {"policy": policy, "request_rate": rate, "ttfts": ttfts, "itls": itls, "good_requests": good,
            "errors": errors or [""] * len(ttfts), "contract_ttft_ok": ttft_ok}


def test_the_pooled_arithmetic_and_verdict():
    contract = load_contract(CHAT)  # p99 TBT <= 50 ms, attainment 0.99
    fast = _point([0.1] * 99 + [0.0], [[0.01] * 10] * 99 + [[]], good=99, ttft_ok=0.99,
                  errors=[""] * 99 + ["refused"])
    slow = _point([0.2] * 100, [[0.01] * 9 + [0.2]] * 100, good=100, ttft_ok=1.0)
    p = pool([fast, slow], contract)
    assert p.requests == 200 and p.good == 199 and p.attainment == pytest.approx(0.995)
    assert p.ttft_ok == pytest.approx(199 / 200)
    # 1,990 gaps, 100 of them 200 ms (5 %): the p99 gap is one of them; the failed request's TTFT is left out
    assert p.tbt_ms == pytest.approx(200.0) and p.ttft_ms["p50"] == pytest.approx(200.0)
    # the slow gaps are the last ones, none a first token's
    assert p.tbt_first_gap_ms == pytest.approx(10.0) and p.tbt_later_gaps_ms == pytest.approx(200.0)
    assert not p.passed and set(p.misses) == {"tbt"}
    assert pool([fast], contract).passed  # 99 of 100 good, the failed one counted: exactly the 99 % the contract asks
    assert pool([fast, slow], contract, attainment=0.999).misses.keys() == {"tbt", "attainment"}


def test_points_that_cannot_be_pooled_are_refused(tmp_path):
    contract = load_contract(CHAT)
    with pytest.raises(ConfigError, match="different rates"):
        pool([_point([0.1], [[0.01]], 1, 1.0), _point([0.1], [[0.01]], 1, 1.0, rate=2.0)], contract)
    with pytest.raises(ConfigError, match="different policies"):
        pool([_point([0.1], [[0.01]], 1, 1.0), _point([0.1], [[0.01]], 1, 1.0, policy="mux")], contract)
    with pytest.raises(ConfigError, match="nothing to pool"):
        pool([], contract)
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"policy": "mux", "request_rate": 1.0, "good_requests": 3}))
    with pytest.raises(ConfigError, match="--save-detailed"):
        read_point(bare)
    result = runner.invoke(app, ["bench", "pool", str(bare), "--slo", str(CHAT)], env={"COLUMNS": "200"})
    assert result.exit_code == 2 and "--save-detailed" in result.output
    result = runner.invoke(app, ["bench", "pool", str(tmp_path / "none.json"), "--slo", str(CHAT)])
    assert result.exit_code == 2 and "no such file" in result.output


def test_a_gzipped_point_reads_as_the_plain_one(tmp_path):
    point = _point([0.1, 0.2], [[0.01, 0.02], [0.03]], good=2, ttft_ok=1.0)
    plain, packed = tmp_path / "p.json", tmp_path / "p.json.gz"
    plain.write_text(json.dumps(point))
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    assert read_point(packed) == read_point(plain) == point


def _point_requests(src: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "point_requests.py"), str(src), str(out)],
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True)


def test_one_row_per_request_from_a_point(tmp_path):
    """scripts/point_requests.py: the rows kept beside measured summaries, in milliseconds on the replay's clock."""
    point = _point([0.1, 0.25, 0.05], [[0.01, 0.03], [], [0.02] * 99 + [0.2]], good=3, ttft_ok=1.0)
    point.update(start_times=[10.0, 10.5, 12.25], input_lens=[100, 7, 40], output_lens=[3, 1, 101])
    src, out = tmp_path / "p.json.gz", tmp_path / "p.requests.csv"
    src.write_bytes(gzip.compress(json.dumps(point).encode()))
    done = _point_requests(src, out)
    assert done.returncode == 0, done.stderr
    rows = list(csv.reader(out.open()))
    assert rows[0] == ["start_s", "input_tokens", "output_tokens", "ttft_ms", "p99_tbt_ms", "max_tbt_ms"]
    assert rows[1] == ["0.000", "100", "3", "100.0", f"{np.percentile([10.0, 30.0], 99):.1f}", "30.0"]
    assert rows[2] == ["0.500", "7", "1", "250.0", "", ""]  # one token: no gap to report
    assert rows[3][:4] == ["2.250", "40", "101", "50.0"] and rows[3][5] == "200.0"
    assert float(rows[3][4]) == pytest.approx(np.percentile([20.0] * 99 + [200.0], 99), abs=0.05)
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"policy": "mux", "request_rate": 1.0, "good_requests": 3}))
    done = _point_requests(bare, out)
    assert done.returncode == 2 and "--save-detailed" in done.stderr and "Traceback" not in done.stderr
