"""Prefill on a partition beside decode: the slowdown is fitted as flat + per 1k tokens of span, refined online from
measured launches, and the simulator hands the planner its launches as the engine hands it the executor's. Mixed
steps (prompt chunks beside decode on all SMs) and prefill layers on all SMs after decode are refined online the
same way."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from appliance.bench.capacity import SimulatedBench, kv_pages
from appliance.bench.simulate import SimConfig
from appliance.config import SchedulerSettings
from appliance.model_zoo.config import ModelConfig
from appliance.predictor.predictor import partition_choices
from appliance.predictor.roofline import DEVICES
from appliance.predictor.shapes import DecodeLoad, PrefillItem
from appliance.predictor.split import MIN_OBSERVATIONS, ONLINE_WINDOW, SplitSlowdown, fit, span_k
from appliance.predictor.synthetic import SyntheticGPU, synthetic_profile
from appliance.slo.contract import load_contract
from appliance.workload import shaping as wl
from appliance.workload.shaping import spread_ties
from appliance.workload.traces import load_trace

ROOT = Path(__file__).resolve().parents[2]
MODEL = ModelConfig.from_file(ROOT / "configs" / "models" / "llama-3.1-8b" / "config.json")


def test_the_fit_recovers_flat_and_slope_and_falls_back_to_one_ratio():
    rng = np.random.default_rng(0)
    solo = rng.uniform(5, 50, 200)
    span = rng.uniform(0, 32, 200)
    measured = solo * (1.05 + 0.01 * span) * rng.normal(1, 0.01, 200)
    flat, slope = fit(solo, span, measured)
    assert flat == pytest.approx(1.05, abs=0.01) and slope == pytest.approx(0.01, abs=0.001)
    # faster with longer spans (a negative slope) is not a contention model: one flat ratio instead
    flat, slope = fit(solo, span, solo * (1.5 - 0.01 * span))
    assert slope == 0.0 and flat == pytest.approx(float((solo * (1.5 - 0.01 * span)).sum() / solo.sum()))
    assert fit(solo[:MIN_OBSERVATIONS - 1], span[:MIN_OBSERVATIONS - 1], measured[:MIN_OBSERVATIONS - 1]) is None
    assert fit(solo, span, solo * 20) is None  # 20x: not a slowdown a profile describes


def test_online_refinement_replaces_the_profiled_slowdown():
    split = SplitSlowdown(1.2, 0.0)
    items = [PrefillItem(2048, 8000)]
    assert split.factor(items) == pytest.approx(1.2) and span_k(items) == pytest.approx(10.048)
    for i in range(31):
        batch = [PrefillItem(1024 * (1 + i % 4), 4000 * (i % 6))]
        split.observe(10.0, batch, 10.0 * (1.0 + 0.02 * span_k(batch)))
    assert split.flat == 1.2  # no fit before REFIT_EVERY launches
    split.observe(10.0, [PrefillItem(1024, 0)], 10.0 * (1.0 + 0.02 * 1.024))
    assert split.flat == pytest.approx(1.0, abs=0.01) and split.per_1k == pytest.approx(0.02, abs=0.001)
    # launches that ran faster than their solo figure never make the planner optimistic
    for i in range(32):
        split.observe(10.0, [PrefillItem(1024, 0)], 7.0)
    assert split.flat < 0.8 and split.factor([PrefillItem(1024, 0)]) == 1.0


def test_a_stall_is_not_a_slowdown():
    split = SplitSlowdown()
    split.observe(10.0, [PrefillItem(1024, 0)], 500.0)  # 50x: a first launch compiling, a host hiccup
    split.observe(10.0, [PrefillItem(1024, 0)], 12.0)
    assert [m for _, _, m in split.window] == [12.0]


def test_the_predictor_learns_how_long_mixed_steps_run_while_serving():
    predictor = synthetic_profile(SyntheticGPU(MODEL, DEVICES["h100"]), partition_choices(132),
                                  "llama-3.1-8b").predictor(MODEL.num_layers, "profile")
    items, load = [PrefillItem(1024, 0)], DecodeLoad(16, 32000)
    profiled = predictor.mixed_ms(items, load)
    for _ in range(31):
        predictor.observe_mixed(items, load, profiled * 1.25)
    assert predictor.mixed_ms(items, load) == profiled  # no fit before REFIT_EVERY steps
    predictor.observe_mixed(items, load, profiled * 1.25)
    assert predictor.mixed_ms(items, load) == pytest.approx(profiled * 1.25)


class SlowSplitGPU(SyntheticGPU):
    """A GPU whose prefill runs 1.4x slower on a partition (decode beside it) than the profile measured alone."""

    def prefill_ms(self, items, sms=None):
        solo = super().prefill_ms(items, sms)
        return solo * 1.4 if sms is not None and sms < self.sm_count else solo


def test_the_simulated_planner_learns_the_split_slowdown_from_its_launches():
    gpu = SlowSplitGPU(MODEL, DEVICES["h100"])
    predictor = synthetic_profile(SyntheticGPU(MODEL, DEVICES["h100"]), partition_choices(132),
                                  "llama-3.1-8b").predictor(MODEL.num_layers, "profile")
    assert predictor.split.flat == 1.0
    contract = load_contract(ROOT / "configs" / "slo" / "long-context.yaml")
    # prefill on the split alone: temporal steps would run most of these long prompts on all SMs instead
    bench = SimulatedBench(contract, predictor, SimConfig(num_pages=kv_pages(MODEL, DEVICES["h100"])), truth=gpu,
                           options=SchedulerSettings(temporal_prefill=False))
    specs = spread_ties(load_trace(ROOT / "tests" / "data" / "mooncake_conversation_head200.jsonl"), seed=0)[:60]
    run = bench.run("mux", specs, 1.25)
    assert run.result.spatial_steps > 0
    learned = run.planner.predictor.split
    assert len(learned.window) >= MIN_OBSERVATIONS
    assert learned.factor([PrefillItem(4096, 0)]) == pytest.approx(1.4, rel=0.05)


class SlowMixedGPU(SyntheticGPU):
    """A GPU whose mixed steps run 1.5x longer while serving than the profile measured."""

    def mixed_ms(self, items, load):
        return super().mixed_ms(items, load) * 1.5


def test_mux_sizes_its_mixed_chunks_to_the_mixed_steps_it_measured():
    gpu = SlowMixedGPU(MODEL, DEVICES["h100"])
    predictor = synthetic_profile(SyntheticGPU(MODEL, DEVICES["h100"]), partition_choices(132),
                                  "llama-3.1-8b").predictor(MODEL.num_layers, "profile")
    contract = load_contract(ROOT / "configs" / "slo" / "chat-queue.yaml")
    bench = SimulatedBench(contract, predictor, SimConfig(num_pages=kv_pages(MODEL, DEVICES["h100"])), truth=gpu,
                           options=SchedulerSettings(mixed_chunks=True))
    specs = load_trace(ROOT / "tests" / "data" / "azure_code_2023_head200.csv")
    run = bench.run("mux", specs, 2.0)
    stats = run.planner.stats
    assert stats.chunk_steps > 0 and stats.chunk_steps + stats.aggregated_steps >= 32  # mixed steps, measured
    learned = run.planner.predictor.mixed
    assert len(learned.window) >= MIN_OBSERVATIONS
    # (the profile is a fit of the synthetic GPU: it puts mixed steps about 12 % over it, so not exactly 1.5)
    assert 1.2 < learned.factor([PrefillItem(1024, 0)]) < 1.45
    solo, span, measured = (np.array(x) for x in zip(*learned.window))
    refined = solo * np.maximum(1.0, learned.flat + learned.per_1k * span)
    assert np.abs(refined / measured - 1).mean() < 0.5 * np.abs(solo / measured - 1).mean()
    snapshot = run.report.summary["planner"]  # the simulated result JSON keeps what the planner learned
    assert snapshot["mixed"]["observations"] == len(learned.window) and snapshot["mixed"]["flat"] == learned.flat
    assert snapshot["stats"]["chunk_steps"] == stats.chunk_steps
    # the replay learned on its own copy: the next one starts from the profile, as a fresh server does
    assert not predictor.mixed.window and not predictor.split.window
    assert bench.run("mux", specs, 1.5).planner.predictor is not run.planner.predictor


def test_the_predictor_learns_prefill_on_all_sms_faster_or_slower_than_profiled():
    predictor = synthetic_profile(SyntheticGPU(MODEL, DEVICES["h100"]), partition_choices(132),
                                  "llama-3.1-8b").predictor(MODEL.num_layers, "profile")
    items = [PrefillItem(1024, 0)]
    full, split = predictor.prefill_ms(items), predictor.prefill_ms(items, 64)
    per_layer = predictor.prefill_solo_ms(items, None, 4)
    for _ in range(32):  # four layers at a time, as temporal steps run them
        predictor.observe_full(items, 4, per_layer * 0.85)
    # unlike a slowdown beside decode, prefill on all SMs may run faster than the profile measured it
    assert predictor.prefill_ms(items) == pytest.approx(full * 0.85)
    assert predictor.prefill_ms(items, 64) == split  # the split has its own factor
    for _ in range(ONLINE_WINDOW):  # the latest steps only
        predictor.observe_full(items, 4, per_layer * 1.3)
    assert predictor.prefill_ms(items) == pytest.approx(full * 1.3)
    predictor.observe_full(items, 0, 5.0)  # nothing launched: nothing learned
    predictor.observe_full([], 4, 5.0)
    assert len(predictor.full.window) == ONLINE_WINDOW and predictor.full._since_fit == 0


class FastFullGPU(SyntheticGPU):
    """A GPU whose prefill on all SMs runs at 0.8x the profile's time while serving."""

    def prefill_ms(self, items, sms=None):
        solo = super().prefill_ms(items, sms)
        return solo * 0.8 if sms is None or sms >= self.sm_count else solo


def test_the_simulated_planner_learns_prefill_on_all_sms_from_its_temporal_steps():
    gpu = FastFullGPU(MODEL, DEVICES["h100"])
    predictor = synthetic_profile(SyntheticGPU(MODEL, DEVICES["h100"]), partition_choices(132),
                                  "llama-3.1-8b").predictor(MODEL.num_layers, "profile")
    contract = load_contract(ROOT / "configs" / "slo" / "chat-queue.yaml")
    bench = SimulatedBench(contract, predictor, SimConfig(num_pages=kv_pages(MODEL, DEVICES["h100"])), truth=gpu)
    inp, out = (wl.LengthDist.parse(x) for x in wl.preset("chat-short"))
    run = bench.run("mux", wl.synthetic(300, 10.0, inp, out, seed=1))  # short prompts: layers on all SMs go faster
    assert run.planner.stats.temporal_steps >= MIN_OBSERVATIONS
    learned = run.planner.predictor.full
    assert len(learned.window) >= MIN_OBSERVATIONS
    assert 0.7 < learned.factor([PrefillItem(2048, 0)]) < 0.9  # (the profile is a fit: not exactly 0.8)
    assert run.report.summary["planner"]["full"]["observations"] == len(learned.window)
    assert not predictor.full.window  # the replay learned on its own copy
