"""pdmux beside mux and chunked: the simulator runs it on a trace slice (every plan on one of its stream groups,
forward_count layers per launch) and reports it; `muxd bench sweep --policies mux,pdmux,chunked` runs all three
simulated and measured (in process, the tiny model on the CPU). The numbers are printed (run with -s)."""
from __future__ import annotations

import csv
from pathlib import Path

import pytest
from typer.testing import CliRunner

from appliance.bench.capacity import SimulatedBench, kv_pages
from appliance.bench.simulate import SimConfig
from appliance.cli.main import app
from appliance.model_zoo.config import ModelConfig
from appliance.predictor.predictor import partition_choices
from appliance.predictor.profile import load_predictor, save_profile
from appliance.predictor.roofline import DEVICES
from appliance.predictor.synthetic import SyntheticGPU, synthetic_profile
from appliance.slo.contract import load_contract
from appliance.workload.traces import load_trace

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "configs" / "models" / "llama-3.1-8b"
TRACE = ROOT / "tests" / "data" / "azure_code_2023_head200.csv"
CHAT_QUEUE = ROOT / "configs" / "slo" / "chat-queue.yaml"


@pytest.fixture
def bench(tmp_path_factory):
    model = ModelConfig.from_file(MODEL / "config.json")
    gpu = SyntheticGPU(model, DEVICES["h100"])
    path = tmp_path_factory.mktemp("profile") / "llama-3.1-8b-h100.json"
    save_profile(synthetic_profile(gpu, partition_choices(132), "llama-3.1-8b"), path)
    predictor = load_predictor(path, model, "NVIDIA H100 80GB HBM3")
    return SimulatedBench(load_contract(CHAT_QUEUE), predictor, SimConfig(num_pages=kv_pages(model, DEVICES["h100"])),
                          truth=gpu)


def test_simulator_runs_pdmux_on_a_trace_slice(bench):
    specs = load_trace(TRACE)[:120]
    planner = bench.planner("pdmux")
    plans = []
    inner = planner.plan
    planner.plan = lambda sched: plans.append(inner(sched)) or plans[-1]
    bench.planner = lambda policy: planner  # this replay's planner, recorded
    run = bench.run("pdmux", specs, rate=1.0)
    report, result = run.report, run.result
    print(f"\npdmux on {len(specs)} Azure code requests at 1 req/s: p99 TTFT {report.summary['p99_ttft_ms']:.0f} "
          f"ms, p99 TBT {report.tbt_ms:.1f} ms, attainment {report.attainment:.1%}, {result.steps} steps")
    print("groups:", "; ".join(g.describe() for g in planner.groups))
    assert all(tl.error is None and len(tl.token_times) == s.output_len for tl, s in zip(result.timelines, specs))
    splits = {(g.decode_sms, g.prefill_sms) for g in planner.groups[1:-1]}
    spatial = [p for p in plans if p.decode_sms is not None]
    assert spatial and all((p.decode_sms, p.prefill_sms) in splits for p in spatial)
    assert all(p.prefill_sms == 132 and p.decode_sms is None for p in plans if p.prefill and not p.decode)
    for p in (p for p in plans if p.prefill):  # every launch: forward_count layers of its batch, or the rest
        first, tokens = p.prefill[0], sum(w.num_tokens for w in p.prefill)
        assert first.layer_end - first.layer_start in (planner.forward_count(tokens, 32), 32 - first.layer_start)
    stats = run.report.summary["planner"]["stats"]
    assert stats["batches"] > 1 and stats["switches"] > 0 and len(stats["steps_per_group"]) >= 3
    assert result.spatial_steps == sum(1 for p in plans if p.spatial and not p.empty)  # prefill queued on a stream


def test_sweep_simulates_mux_pdmux_and_chunked(tmp_path):
    args = ["bench", "sweep", "--simulate", "--trace", str(TRACE), "--max-requests", "30", "--model", str(MODEL),
            "--gpu", "h200", "--slo", str(CHAT_QUEUE), "--policies", "mux,pdmux,chunked", "--rates", "0.5,2",
            "--result-dir", str(tmp_path), "--no-progress"]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "pdmux stream groups" in result.output and "all-prefill (132 SMs)" in result.output
    rows = list(csv.DictReader((tmp_path / "summary.csv").open()))
    assert sorted({r["policy"] for r in rows}) == ["chunked", "mux", "pdmux"]
    assert all(float(r["completed"]) == 30 for r in rows if r["policy"] == "pdmux")
    # chunked's budget, tuned from the workload (no --chunk-budget), is in every chunked point
    budgets = [int(r["chunk_budget"]) for r in rows if r["policy"] == "chunked"]
    assert len(budgets) == 2 and budgets[0] == budgets[1] and budgets[0] % 128 == 0
    assert not any(r["chunk_budget"] for r in rows if r["policy"] != "chunked")


def test_sweep_measures_mux_pdmux_and_chunked_in_process(llama_checkpoint, tmp_path):
    path, _ = llama_checkpoint
    args = ["bench", "sweep", "--in-process", "--model", str(path), "--num-prompts", "6", "--input-len", "20",
            "--output-len", "5", "--policies", "mux,pdmux,chunked", "--rates", "50", "--slo",
            str(ROOT / "configs" / "slo" / "chat.yaml"), "--result-dir", str(tmp_path), "--no-progress"]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    rows = list(csv.DictReader((tmp_path / "summary.csv").open()))
    assert sorted(r["policy"] for r in rows) == ["chunked", "mux", "pdmux"]
    assert all(float(r["completed"]) == 6 for r in rows)


def test_a_served_sweep_prints_each_point_s_replay_notes(llama_checkpoint, tmp_path):
    """What a replay notes (failed requests and their errors, short outputs, skipped idle time) shows beside each
    point of a served sweep, as `muxd bench` shows it beside its table."""
    path, _ = llama_checkpoint
    args = ["bench", "sweep", "--in-process", "--model", str(path), "--num-prompts", "4", "--input-len", "20",
            "--output-len", "3", "--policies", "mux", "--rates", "2", "--max-idle", "0", "--slo",
            str(ROOT / "configs" / "slo" / "chat.yaml"), "--result-dir", str(tmp_path), "--no-progress"]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "note (mux at 2 req/s): --max-idle 0: " in result.output, result.output
