"""Closed-loop tail control (engine/planners/control.py): the controller on its own, and the mux planner holding the
contract's TBT percentile on the simulated executor when the GPU runs 20 % slower or faster than its profile says,
and when the host launches prefill layers slower than its model says."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

import appliance.predictor.host as host_module
from appliance.bench.capacity import SimulatedBench, kv_pages
from appliance.bench.run import BenchOptions
from appliance.bench.simulate import SimConfig, Simulator
from appliance.bench.simulated import simulated_bench
from appliance.config import SchedulerSettings
from appliance.engine.planners.control import TailController
from appliance.errors import ConfigError
from appliance.model_zoo.config import ModelConfig
from appliance.predictor.predictor import partition_choices
from appliance.predictor.profile import load_predictor, save_profile
from appliance.predictor.roofline import DEVICES
from appliance.predictor.synthetic import SyntheticGPU, synthetic_profile
from appliance.slo.attainment import evaluate
from appliance.slo.contract import load_contract
from appliance.workload import shaping as wl
from appliance.workload.shaping import spread_ties
from appliance.workload.traces import load_trace

ROOT = Path(__file__).resolve().parents[2]


def test_tightens_fast_on_overshoot_and_relaxes_slowly():
    c = TailController(percentile=99)
    start = c.headroom
    c.observe([1.2] * 100)  # one decode step of 100 rows, 20 % over the target: a clear cut at once
    cut = c.headroom
    assert cut < start * 0.96
    c.observe([0.5] * 100)  # a calm step of the same size gives back a ninety-ninth of that
    assert cut < c.headroom < cut * (start / cut) ** (1 / 50)
    assert c.state()["samples"] == 200 and c.state()["over_setpoint"] == 100


def test_settles_where_the_percentile_sits_at_the_setpoint():
    """Gaps proportional to the planning target, with a spread: the headroom settles where 1 % of them exceed the
    setpoint (the contract's p99 at 0.9 x the target), from below and from above."""
    rng = np.random.default_rng(0)
    for start in (0.4, 1.8):
        c = TailController(percentile=99, headroom=start)
        for _ in range(3000):  # steps of 64 rows: each gap is headroom x a lognormal spread (predictor error)
            c.observe(list(c.headroom * 0.5 * rng.lognormal(0.0, 0.25, 64)))
        exceed = np.mean(c.headroom * 0.5 * rng.lognormal(0.0, 0.25, 200_000) > c.setpoint)
        assert 0.005 < exceed < 0.02


def test_headroom_stays_within_its_bounds():
    c = TailController(min_headroom=0.4)
    for _ in range(200):
        c.observe([3.0] * 512)
    assert c.headroom == 0.4
    c = TailController()
    for _ in range(2000):
        c.observe([0.1] * 512)
    assert c.headroom == c.max_headroom


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    model = ModelConfig.from_file(ROOT / "configs" / "models" / "llama-3.1-8b" / "config.json")
    gpu = SyntheticGPU(model, DEVICES["h100"])  # stands in for the GPU
    path = tmp_path_factory.mktemp("profile") / "llama-3.1-8b-h100.json"
    save_profile(synthetic_profile(gpu, partition_choices(132), "llama-3.1-8b"), path)
    predictor = load_predictor(path, model, "NVIDIA H100 80GB HBM3")
    contract = load_contract(ROOT / "configs" / "slo" / "chat-queue.yaml")
    inp, out = (wl.LengthDist.parse(x) for x in wl.preset("chat-short"))
    specs = wl.synthetic(400, 14.0, inp, out, seed=1)  # short prompts at a rate where the host and the tail matter
    return model, gpu, predictor, contract, specs


def replay(rig, error: float, control: bool, mixed_chunks: bool = False, host_error: float = 0.0,
           host_spread: float = 0.0):
    """One replay under mux (`--mixed-chunks` as asked: off, decode runs beside prefill on the SM split), judged;
    the simulated GPU `error` and the simulated host `host_error` slower than the planner's models say."""
    model, gpu, predictor, contract, specs = rig
    bench = SimulatedBench(contract, predictor, SimConfig(num_pages=kv_pages(model, DEVICES["h100"])), truth=gpu,
                           device_error=error, host_error=host_error,
                           options=SchedulerSettings(mixed_chunks=mixed_chunks))
    planner = bench.planner("mux")
    planner.options.control = control
    host = predictor.host.scaled(1.0 + host_error)
    result = Simulator(planner, bench.timer, bench.sim, host=host, host_spread=host_spread).run(specs)
    return evaluate(contract, result.timelines, specs), planner


@pytest.mark.parametrize("error,mixed_chunks", [(0.2, False), (-0.2, False), (0.2, True)])
def test_mux_keeps_the_contract_when_the_gpu_is_not_what_the_profile_says(rig, error, mixed_chunks):
    report, planner = replay(rig, error, control=True, mixed_chunks=mixed_chunks)
    assert report.met and report.tbt_ms <= 50.0, report.reasons
    state = planner.snapshot()["control"]["default"]["tbt"]
    assert state["samples"] > 10_000 and state["headroom"] != 0.85


def test_without_the_loop_a_slower_gpu_breaks_the_tbt_target(rig):
    """The same replay open loop (planning to the target itself): the test above is not passing by luck."""
    report, _ = replay(rig, 0.2, control=False)
    assert report.tbt_ms > 50.0


def test_mux_keeps_the_contract_when_the_host_launches_slower_than_modelled(rig, monkeypatch):
    """A host 8x slower than its model (a busy serving process launching prefill layers): the planner learns the
    launches' time from what it measures and keeps the TBT target; planning by the model alone, it does not."""
    report, planner = replay(rig, 0.0, control=True, host_error=7.0)
    assert report.met and report.tbt_ms <= 50.0, report.reasons
    assert planner.snapshot()["host"]["per_layer_ms"] >= 8 * rig[2].host.per_layer_ms - 1e-9
    monkeypatch.setattr(host_module, "MIN_LAUNCHES", 10**9)  # never learned
    report, planner = replay(rig, 0.0, control=True, host_error=7.0)
    assert report.tbt_ms > 50.0 and planner.snapshot()["host"]["per_layer_ms"] == rig[2].host.per_layer_ms


def test_launch_times_spread_around_the_model_are_drawn_reproducibly_and_learned(rig):
    """A host whose launches vary (lognormal around 4x the model): the planner sees each launch's own time, plans
    with a line above 98 in a hundred of them, and keeps the contract; the same seed replays the same run."""
    (report, planner), (again, _) = (replay(rig, 0.0, control=True, host_error=3.0, host_spread=0.5)
                                     for _ in range(2))
    assert report.met and report.tbt_ms <= 50.0, report.reasons
    assert report.tbt_ms == again.tbt_ms and report.summary == again.summary
    layers, ms = np.array(planner.predictor.launches.windows[False]).T  # eager launches (no graphs here)
    per_layer = ms / layers
    assert per_layer.max() > 3 * per_layer.min()  # a spread, not one figure
    host = planner.predictor.host
    assert np.mean(ms <= host.launch_ms + host.per_layer_ms * layers + 1e-9) == pytest.approx(
        host_module.LAUNCH_QUANTILE, abs=0.02)


@pytest.mark.parametrize("rate", [0.8, 1.5])
def test_past_capacity_mux_misses_on_ttft_and_holds_tbt(rig, rate):
    """Long conversational prompts offered faster than the GPU prefills them: first tokens run late, and the TBT
    controller still holds its percentile under the target (it gives prefill no ground for late first tokens: doing
    so held a lower percentile, and p99 TBT reached 56 ms here at 0.6 req/s, which the planner now serves within the
    contract)."""
    model, gpu, predictor, contract, _ = rig
    specs = spread_ties(load_trace(ROOT / "tests" / "data" / "mooncake_conversation_head200.jsonl"), seed=0)
    bench = SimulatedBench(contract, predictor, SimConfig(num_pages=kv_pages(model, DEVICES["h100"])), truth=gpu)
    report = bench.run("mux", specs, rate).report
    assert not report.met and report.ttft_ok < contract.attainment
    assert report.tbt_ms <= 50.0


def test_planning_from_the_prior_keeps_the_contract_on_a_profiled_gpu():
    """`--planner-prior`: no profile of the model on this GPU, as a server meets it (mux by default). The planner
    starts from the roofline prior, which puts decode steps and long prefills within about 10 % of what the shipped
    H100 profile measured and short prefills up to 1.5x under it; the simulated GPU and host are that profile's. The
    controller keeps the contract from there, as it does planning from the profile; planning open loop from the
    prior breaks the TBT target."""
    contract = load_contract(ROOT / "configs" / "slo" / "chat-queue.yaml")
    profile = ROOT / "appliance" / "predictor" / "profiles" / "llama-3.1-8b-h100.json"
    opts = BenchOptions(model=str(ROOT / "configs" / "models" / "llama-3.1-8b"), profile=profile, planner_prior=True,
                        slo=contract)
    bench, cfg, notes = simulated_bench(opts, "h100")
    assert bench.predictor.source == "roofline prior" and "profile" in bench.truth.predictor.source
    assert any("--planner-prior" in n for n in notes)
    assert bench.host == bench.truth.predictor.host != bench.predictor.host  # the host as profiled, not the prior's
    inp, out = (wl.LengthDist.parse(x) for x in wl.preset("chat-short"))
    specs = wl.synthetic(300, 11.0, inp, out, seed=2)
    report = bench.run("mux", specs).report
    assert report.met and report.tbt_ms <= 50.0, report.reasons
    profiled, _, _ = simulated_bench(dataclasses.replace(opts, planner_prior=False), "h100")
    assert profiled.run("mux", specs).report.met
    planner = bench.planner("mux")
    planner.options.control = False
    result = Simulator(planner, bench.timer, bench.sim, host=bench.host).run(specs)
    assert evaluate(contract, result.timelines, specs).tbt_ms > 50.0


def test_planner_prior_needs_a_profile_to_run_against(tmp_path):
    opts = BenchOptions(model=str(ROOT / "configs" / "models" / "llama-3.1-8b"), profile=tmp_path / "none.json",
                        planner_prior=True)
    with pytest.raises(ConfigError, match="--planner-prior"):
        simulated_bench(opts, "h100")
