"""Acceptance: on a slice of the Mooncake conversation trace with a profile shaped like Llama-3.1-8B on an H100,
`mux` keeps a 50 ms p99 TBT at a rate where `chunked` (its budget tuned to meet TBT on an idle GPU) and `serial` do
not, and has the higher capacity under the long-context contract. The numbers are printed (run with -s)."""
from __future__ import annotations

from pathlib import Path

import pytest

from appliance.bench.capacity import SimulatedBench, kv_pages
from appliance.bench.simulate import SimConfig
from appliance.config import SchedulerSettings
from appliance.engine.planners.mux import MuxPlanner
from appliance.engine.planners.registry import tune_chunk_budget
from appliance.model_zoo.config import ModelConfig
from appliance.predictor.predictor import partition_choices
from appliance.predictor.profile import load_predictor, save_profile
from appliance.predictor.roofline import DEVICES
from appliance.predictor.synthetic import SyntheticGPU, synthetic_profile
from appliance.slo.contract import load_contract
from appliance.workload.shaping import spread_ties
from appliance.workload.traces import load_trace

ROOT = Path(__file__).resolve().parents[2]
POLICIES = ("mux", "chunked", "serial")
RATE = 1.25  # requests/s, about four times the slice's own rate


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    model = ModelConfig.from_file(ROOT / "configs" / "models" / "llama-3.1-8b" / "config.json")
    gpu = SyntheticGPU(model, DEVICES["h100"])  # stands in for the GPU: the simulator's clock
    path = tmp_path_factory.mktemp("profile") / "llama-3.1-8b-h100.json"
    save_profile(synthetic_profile(gpu, partition_choices(132), "llama-3.1-8b"), path)
    predictor = load_predictor(path, model, "NVIDIA H100 80GB HBM3")  # what the planner knows: the fitted profile
    assert predictor.source.startswith("profile")
    contract = load_contract(ROOT / "configs" / "slo" / "long-context.yaml")
    assert contract.slo_for(None).tbt_ms == 50 and contract.slo_for(None).tbt_percentile == 99
    return SimulatedBench(contract, predictor, SimConfig(num_pages=kv_pages(model, DEVICES["h100"])), truth=gpu)


@pytest.fixture(scope="module")
def specs():
    # Mooncake's timestamps come in 3 s steps; spread each step's requests over it instead of sending them at once
    return spread_ties(load_trace(ROOT / "tests" / "data" / "mooncake_conversation_head200.jsonl"), seed=0)


def row(run) -> str:
    s, r = run.report.summary, run.report
    return (f"{run.policy:8s} {run.rate:5.3g} req/s  p99 TTFT {s['p99_ttft_ms']:8.0f} ms  p99 TBT {r.tbt_ms:6.1f} ms"
            f"  attainment {r.attainment:6.1%}  {'meets the contract' if r.met else '; '.join(r.reasons)}")


def test_mux_holds_tbt_where_chunked_and_serial_do_not(bench, specs):
    budget = tune_chunk_budget(bench.timer, 50.0)
    runs = {p: bench.run(p, specs, RATE) for p in POLICIES}
    print(f"\n{len(specs)} requests of mooncake_conversation, chunked budget {budget} tokens")
    for run in runs.values():
        print(row(run))
    mux = runs["mux"]
    assert mux.report.met and mux.report.tbt_ms <= 50.0
    assert mux.result.spatial_steps > 0 and mux.planner.stats.pauses > 0
    for policy in ("chunked", "serial"):
        assert runs[policy].report.tbt_ms > 50.0 and not runs[policy].report.met
    assert all(t.success for t in mux.result.timelines)


def test_mux_launches_stay_within_the_batched_token_budget(bench, specs, monkeypatch):
    """The engine sizes activation memory for --max-num-batched-tokens prefill rows: through this slice (107 of its
    200 prompts are longer than that, up to 120,633 tokens) no mux launch carries more, long prompts prefill in
    passes, and every request still ends."""
    import dataclasses

    plans = []
    inner = MuxPlanner.plan
    monkeypatch.setattr(MuxPlanner, "plan", lambda self, sched: plans.append(inner(self, sched)) or plans[-1])
    run = dataclasses.replace(bench, _runs={}).run("mux", specs, RATE)
    limit = SchedulerSettings().max_num_batched_tokens
    assert max(sum(w.num_tokens for w in p.prefill) for p in plans if p.prefill) <= limit
    assert max(s.prompt_len for s in specs) > 10 * limit
    ends = {(w.request_id, w.token_end) for p in plans for w in p.prefill if w.token_end - w.token_start == limit}
    assert sum((w.request_id, w.token_start) in ends for p in plans for w in p.prefill if w.layer_start == 0) > 10
    assert all(t.success for t in run.result.timelines) and len(run.result.timelines) == len(specs)


def test_mux_has_the_highest_capacity(bench, specs):
    # bisection to within 50 %, or five points: the policies' capacities lie several times apart (each point is a
    # replay, the longest at the lowest rates), and five bracket each of them
    sweeps = {p: bench.capacity(p, specs, start_rate=RATE, tolerance=0.5, max_points=5) for p in POLICIES}
    print()
    for policy, sweep in sweeps.items():
        points = ", ".join(f"{p.rate:.3g}{'+' if p.passed else '-'}" for p in sweep.points)
        print(f"{policy:8s} capacity {sweep.capacity or 0:.3g} req/s  (points: {points})")
    mux = sweeps["mux"].capacity
    assert mux is not None and mux >= RATE
    assert all(sweeps[p].capacity is not None for p in ("chunked", "serial"))  # some rate each keeps
    assert all(mux > (sweeps[p].capacity or 0.0) for p in ("chunked", "serial"))


def test_chunked_tuned_on_the_workload_keeps_tbt(tmp_path):
    """The simulated baseline's budget: the largest (in steps of 128) whose replay of the workload keeps the TBT
    target; one step more breaks it. Idle tuning, which ignores the decode rows and cached context a loaded step
    carries, picks a larger budget that does not."""
    model = ModelConfig.from_file(ROOT / "configs" / "models" / "llama-3.1-8b" / "config.json")
    gpu = SyntheticGPU(model, DEVICES["h100"])
    path = tmp_path / "p.json"
    save_profile(synthetic_profile(gpu, partition_choices(132), "llama-3.1-8b"), path)
    predictor = load_predictor(path, model, "NVIDIA H100 80GB HBM3")
    contract = load_contract(ROOT / "configs" / "slo" / "chat-queue.yaml")
    specs = load_trace(ROOT / "tests" / "data" / "azure_code_2023_head200.csv")[:80]
    bench = SimulatedBench(contract, predictor, SimConfig(num_pages=kv_pages(model, DEVICES["h100"])), truth=gpu)
    budget = bench.tune_chunk_budget(specs, max_requests=80)
    assert bench.options.chunk_budget == budget and budget % 128 == 0
    target = contract.slo_for(None).tbt_ms
    assert bench.run("chunked", specs).report.tbt_ms <= target
    over = SimulatedBench(contract, predictor, bench.sim, truth=gpu,
                          options=SchedulerSettings(chunk_budget=budget + 128))
    assert over.run("chunked", specs).report.tbt_ms > target
    assert tune_chunk_budget(gpu, target) > budget


def test_device_band_pools_three_replays(bench, specs):
    """--device-spread: each rate is judged over the GPU as timed, slower and faster, pooled as slices are: the
    attainment is the share of good requests over all three replays (each replays every request), the TBT
    percentile is taken over all their gaps, and the slower GPU serves no better than the faster one."""
    import dataclasses

    banded = dataclasses.replace(bench, device_spread=0.2, _runs={})
    run = banded.run("mux", specs, RATE)
    summary = run.report.summary
    band = summary["device_band"]
    assert [b["speed"] for b in band] == [1.0, 1.2, 0.8]
    assert run.report.attainment == pytest.approx(sum(b["slo_attainment"] for b in band) / 3)
    assert summary["slo_attainment"] == run.report.attainment
    assert min(b["contract_tbt_ms"] for b in band) <= run.report.tbt_ms <= max(b["contract_tbt_ms"] for b in band)
    assert band[1]["slo_attainment"] <= band[2]["slo_attainment"]
    # (the closed loop holds both tails at its target: the slower GPU's is not lower beyond a hair)
    assert band[1]["contract_tbt_ms"] >= 0.99 * band[2]["contract_tbt_ms"]
    # the replay as timed is the band's first: the same as without a band
    alone = bench.run("mux", specs, RATE).report
    assert band[0]["slo_attainment"] == alone.attainment and band[0]["contract_tbt_ms"] == alone.tbt_ms
    assert "device_band" not in alone.summary
    assert run.report.met == (not run.report.misses)
    # a capacity judged over the band is no higher than one judged as timed. Both searches take three points: as
    # timed, the search above needs no more (its replays are reused); over the band, enough to bracket a capacity
    # below RATE (each point at a low rate is three long replays: six points took most of a minute on a CPU)
    coarse = {"tolerance": 0.5, "max_points": 3}
    judged = banded.capacity("mux", specs, RATE, **coarse)
    assert judged.capacity is not None and judged.bracketed
    assert judged.capacity <= bench.capacity("mux", specs, RATE, **coarse).capacity
