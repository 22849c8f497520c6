"""`muxd profile` on the CPU (the null partition): the grid's order and ranges, a profile written within the budget
and loaded by the server's predictor, held-out errors, resuming an interrupted run, and clear errors."""
from __future__ import annotations

import dataclasses
import gzip
import json
import logging
import time
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import appliance.profile.calibrate as calibrate
import appliance.profile.profiler as profiler
from appliance.cli.main import app
from appliance.cli.profile import _calibration, calibration_requests
from appliance.config import Config
from appliance.engine.compile import cache_dir
from appliance.engine.factory import build_engine
from appliance.engine.graphs import capture_sizes
from appliance.engine.planners.registry import tune_chunk_budget
from appliance.errors import ConfigError
from appliance.model_zoo.config import ModelConfig
from appliance.predictor.catalog import BUNDLED, cache_profile, find_profile
from appliance.predictor.profile import load_predictor, model_shape, read_profile, serving_range
from appliance.predictor.roofline import DEVICES
from appliance.predictor.shapes import PrefillItem
from appliance.predictor.solo import fit_solo
from appliance.predictor.synthetic import SyntheticGPU
from appliance.profile.calibrate import calibrate_serving, serving_factors
from appliance.profile.grid import Point, Ranges, plan_points, reused_tokens
from appliance.profile.profiler import (
    NOISY_SPREAD,
    SAMPLES_FORMAT,
    ProfileResult,
    read_samples,
    refit_profile,
    run_profile,
    samples_path_for,
)
from appliance.profile.timer import StepTimer
from appliance.workload.traces import RequestSpec, load_trace

DATA = Path(__file__).parent.parent / "data"
EMBEDDED = Path(__file__).resolve().parents[2] / "appliance" / "model_zoo" / "embedded"
REPO = Path(__file__).resolve().parents[2]
SMALL = Ranges(prefill_new=(16, 48, 96), prefill_reused=(0, 64), decode_batch=(1, 4, 8), decode_context=(16, 64),
               contended_new=(32,), contended_batch=(4,), contended_context=(32,), mixed_new=(16, 32, 64),
               mixed_batch=(1, 4))


def test_grid_puts_the_fit_core_first_then_held_out_points_then_the_rest():
    points = plan_points(Ranges(), 132, [16, 32, 48], holdout=2)
    keys = [p.key for p in points]
    assert len(keys) == len(set(keys))
    kinds = {(p.kind, p.sms) for p in points}
    # prefill on every prefill partition and all SMs, decode on every decode partition and all SMs, contention per split
    assert {("prefill", s) for s in (132, 116, 100, 84)} <= kinds
    assert {("decode", s) for s in (16, 32, 48, 132)} <= kinds
    assert {("contended", s) for s in (16, 32, 48)} == {k for k in kinds if k[0] == "contended"}
    first_held = next(i for i, p in enumerate(points) if p.holdout)
    last_held = max(i for i, p in enumerate(points) if p.holdout)
    core = points[:first_held]
    # the core alone fits every partition: >= 4 prefill samples (4 terms), >= 3 decode samples (3 terms)
    for s in (132, 116, 100, 84):
        assert sum(p.kind == "prefill" and p.sms == s for p in core) >= 4
    for s in (16, 32, 48, 132):
        assert sum(p.kind == "decode" and p.sms == s for p in core) >= 3
    # and the mixed step (one forward on all SMs) has its 5 terms
    assert sum(p.kind == "mixed" and p.sms == 132 for p in core) >= 5
    assert {p.sms for p in points if p.kind == "mixed"} == {132}
    assert all(not p.holdout for p in points[last_held + 1:])
    assert sum(p.holdout for p in points) == 2 * (4 + 4 + 1) + 3


def test_a_workload_without_prefix_hits_has_the_fit_core_first_too():
    """A trace with no prefix-cache hits (reused is (0,)) collapses the core's prompts with a cached part onto those
    without; other prompt lengths stand in, so that a budget that runs out after the core still leaves a fit (it
    once left 3 prefill samples a partition for a 4-term fit, and `muxd profile --trace` of Azure code failed)."""
    ranges = Ranges.from_lengths([128, 500, 1500, 3000, 7400, 2000], [10] * 6, [0] * 6)
    assert ranges.prefill_reused == (0,)
    points = plan_points(ranges, 132, [16, 32], holdout=1)
    core = points[:next(i for i, p in enumerate(points) if p.holdout)]
    for s in (132, 116, 100):
        assert len({p.new for p in core if p.kind == "prefill" and p.sms == s}) >= 4

    def ms(p: Point) -> float:  # a step time of the fit's form, scaled with the SMs
        if p.kind == "prefill":
            return 132 / p.sms * (2.0 + 0.1 * p.new / 1e3 + 0.02 * (p.new / 1e3) ** 2)
        return 132 / p.sms * (5.0 + 0.05 * p.batch + 0.002 * p.batch * p.context / 1e3)

    model = fit_solo([p.sample(ms(p)) for p in core if p.kind in ("prefill", "decode")])
    for s in (132, 116, 100):
        unseen = Point("prefill", s, 5000, 0)
        assert model.prefill_ms(unseen.items, s) == pytest.approx(ms(unseen), rel=0.02)


def test_a_log_cut_short_leaves_its_short_partitions_to_their_neighbours(tmp_path, caplog):
    """Samples of a run whose budget ran out two points into a partition's prefill: the profile fits the others and
    says which partition the narrower one beside it stands in for, instead of refusing to fit at all."""
    model = ModelConfig.from_file(REPO / "configs" / "models" / "llama-3.1-8b" / "config.json")
    gpu = SyntheticGPU(model, DEVICES["h100"])
    points = [p for p in plan_points(Ranges(), 132, [16, 32], holdout=0) if p.kind in ("prefill", "decode")]
    cut = [p for p in points if (p.kind, p.sms) != ("prefill", 116)]
    cut += [p for p in points if (p.kind, p.sms) == ("prefill", 116)][:2]
    header = {"format": SAMPLES_FORMAT, "model": "llama-3.1-8b", "shape": model_shape(model),
              "gpu": "NVIDIA H100 80GB HBM3", "sm_count": 132, "decode_partitions": [16, 32], "decode_plan": None,
              "prefill_plan": None}
    log_path = tmp_path / "p.json.samples.jsonl"
    log_path.write_text("\n".join([json.dumps(header)] + [json.dumps({
        **dataclasses.asdict(p), "ms": gpu.prefill_ms(p.items, p.sms) if p.kind == "prefill"
        else gpu.decode_ms(p.load, p.sms)}) for p in cut]) + "\n")
    with caplog.at_level(logging.WARNING, logger="muxd.profile"):
        refit_profile(log_path, tmp_path / "p.json", model)
    profile = read_profile(tmp_path / "p.json")
    assert "116" not in profile.prefill and {"100", "132"} <= set(profile.prefill)
    assert "prefill on 116 SMs: too few samples to fit" in caplog.text
    predictor = profile.predictor(model.num_layers, "cut")
    items = [PrefillItem(2048, 0)]
    assert predictor.prefill_ms(items, 116) == pytest.approx(predictor.prefill_ms(items, 100))


def test_mixed_steps_are_measured_over_the_longest_cached_prefix():
    """Chunks attending over a long cached prefix (a prefix-cache hit, or a long prompt's earlier chunks) are in the
    grid, the fit's core among them: a mixed fit made over short prefixes has no term for them."""
    for ranges, far in ((Ranges(), 16384),                                    # the longest hit
                        (Ranges(prefill_new=(256, 4096), prefill_reused=(0,)), 4096 - 1536)):  # no hits: chunks
        points = plan_points(ranges, 132, [16, 32], holdout=2)
        mixed = [p for p in points if p.kind == "mixed"]
        first_held = next(i for i, p in enumerate(points) if p.holdout)
        assert any(p.reused == far for p in points[:first_held] if p.kind == "mixed")
        assert max(p.reused for p in mixed) == far
        assert {p.reused for p in mixed if not p.holdout} >= {0, far}


def test_ranges_follow_the_trace_and_the_server_limits():
    specs = load_trace(DATA / "mooncake_conversation_head200.jsonl")
    reused = reused_tokens(specs)
    assert reused[0] == 0 and any(r > 0 for r in reused)  # later turns reuse earlier prefixes
    assert all(0 <= r < s.prompt_len for r, s in zip(reused, specs))
    ranges = Ranges.from_lengths([s.prompt_len for s in specs], [s.output_len for s in specs], reused)
    assert ranges.prefill_reused[0] == 0 and len(ranges.prefill_reused) >= 2
    clipped = ranges.clipped(4096, 64, 16384)
    assert max(clipped.prefill_new) == 4096 and max(clipped.decode_batch) == 64
    # a batch beside a prefill leaves the prompt a sequence of the server's 64
    assert max(clipped.contended_batch) <= 63 and max(clipped.mixed_batch) <= 63
    assert max(clipped.decode_context) <= 16384 and max(clipped.prefill_reused) + 4096 < 16384
    assert len(clipped.prefill_new) == len(ranges.prefill_new)  # capped, the grid keeps its resolution
    kv = 400_000  # a pool that cannot hold 64 requests of 16k tokens: such points are never planned
    points = plan_points(clipped, 132, [16, 64], holdout=2, kv_tokens=kv)
    assert points and all(p.tokens <= kv for p in points)
    # instead, the largest batch of the longest context that the pool holds: the fit reaches a full pool
    longest = max(clipped.decode_context)
    full = kv // (longest + 16)
    assert full < max(clipped.decode_batch)
    for s in (16, 64, 132):
        assert any(p.kind == "decode" and p.sms == s and (p.batch, p.context) == (full, longest) for p in points)
    for s in (16, 64, 132):  # the decode fit still has its core on every partition
        assert sum(p.kind == "decode" and p.sms == s and not p.holdout for p in points) >= 3


@pytest.fixture(scope="module")
def timer(llama_checkpoint):
    path, _ = llama_checkpoint
    engine = build_engine(Config.flat(model=path, num_gpu_blocks_override=256, max_num_seqs=8,
                                                              enable_prefix_caching=False))
    return StepTimer(engine, reps=1, decode_steps=2)


@pytest.fixture(scope="module")
def held_out_profile(timer, tmp_path_factory):
    """The SMALL grid profiled with two held-out points per phase: (its points, the run's result); the tests using it
    only read what it wrote."""
    points = plan_points(SMALL, timer.sm_count, timer.decode_partitions, holdout=2)
    out = tmp_path_factory.mktemp("held-out") / "tiny-cpu.json"
    return points, run_profile(timer, points, out, model_name="tiny", budget_s=300, started=time.perf_counter())


@pytest.fixture(scope="module")
def full_profile(timer, tmp_path_factory):
    """The SMALL grid profiled with no point held out (the run's result); the tests using it only read what it
    wrote."""
    points = plan_points(SMALL, timer.sm_count, timer.decode_partitions, holdout=0)
    out = tmp_path_factory.mktemp("full") / "p.json"
    return run_profile(timer, points, out, model_name="tiny", budget_s=300, started=time.perf_counter())


def test_profile_is_written_loaded_and_scored_on_held_out_points(timer, held_out_profile):
    points, result = held_out_profile
    out = result.path
    assert result.measured == len(points) and result.skipped_budget == 0
    assert not timer.engine.scheduler.requests and timer.engine.pool.num_free_pages == timer.engine.pool.num_pages
    assert result.errors["prefill_n"] == 2 and result.errors["decode_n"] == 2 and result.errors["mixed_n"] == 2
    assert 0 <= result.errors["decode_mean"] <= result.errors["decode_max"]
    saved = json.loads(out.read_text())
    assert saved["fit"]["samples_holdout"] == 6 and "holdout_prefill_max" in saved["fit"]
    assert len(saved["mixed"]) == 6  # the mixed step has its own fit (chunked prefill's step)
    predictor = load_predictor(out, timer.engine.model.config, "cpu")
    assert predictor.source.startswith("profile")  # the server takes it (not the roofline prior)
    assert predictor.prefill_ms(Point("prefill", timer.sm_count, 96).items, timer.sm_count) > 0
    # on the CPU every step is short: each prefill and mixed point was measured twice more and keeps the median
    lines = [json.loads(x) for x in samples_path_for(out).read_text().splitlines()[1:]]
    short = [p for p in points if p.kind in ("prefill", "mixed")]
    assert result.revisited == 2 * len(short) and len(lines) == len(points) + result.revisited
    last = {}
    for row in lines:
        last[(row["kind"], row["sms"], row["new"], row["reused"], row["batch"], row["context"])] = row
    repeated = [row for row in last.values() if "runs" in row]
    assert len(repeated) == len(short)
    assert all(len(row["runs"]) == 3 and row["ms"] == sorted(row["runs"])[1] for row in repeated)
    # how far each repeated point's runs spread is reported, and kept in the profile
    spreads = sorted(max(row["runs"]) / min(row["runs"]) - 1 for row in repeated)
    assert sorted(result.spread) == pytest.approx(spreads)
    saved = json.loads(out.read_text())
    assert saved["fit"]["repeat_spread_median"] == pytest.approx(float(np.median(spreads)))
    assert saved["fit"]["repeat_spread_p90"] == pytest.approx(float(np.percentile(spreads, 90)))
    assert result.noisy == (result.spread_p90 > NOISY_SPREAD)
    resumed = read_samples(samples_path_for(out), json.loads(samples_path_for(out).read_text().splitlines()[0]))
    assert all(resumed[p.key][1] == pytest.approx(sorted(r["runs"])[1]) for p in short for r in repeated
               if (r["kind"], r["sms"], r["new"], r["reused"], r["batch"], r["context"]) ==
               (p.kind, p.sms, p.new, p.reused, p.batch, p.context))


def test_calibration_replays_under_chunked_and_measures_serving_against_the_profile(timer, full_profile,
                                                                                    monkeypatch, caplog):
    # (on the CPU the engine is not multiplexed: only the chunked replay runs; tests/gpu/test_profile_mux.py has mux)
    # the serial replay idles after each request it replays alone (0.2 s each); a shorter idle keeps them alone
    monkeypatch.setattr(calibrate, "SERIAL_IDLE_S", 0.02)
    result = full_profile
    engine = timer.engine
    planner = engine.scheduler.planner
    predictor = result.profile.predictor(engine.model.config.num_layers, "profile")
    specs = [RequestSpec(arrival=i * 0.05, prompt_len=24 + 8 * (i % 5), output_len=40) for i in range(24)]
    # a second workload: longer prompts, sharing a prefix of two 64-token blocks as a conversation's turns do
    longer = [RequestSpec(arrival=0.2 * i, prompt_len=160 + 16 * i, output_len=8, hash_ids=(7, 8, 9 + i),
                          block_size=64) for i in range(4)]
    schedule = engine.scheduler.schedule
    factors, steps, prefills = calibrate_serving(engine, [(specs, 400.0), (longer, 100.0)], predictor)
    assert engine.scheduler.planner is planner and engine.scheduler.schedule == schedule  # all put back
    assert not engine.scheduler.requests and engine.pool.num_free_pages == engine.pool.num_pages
    # over MIN_STEPS steps; the mixed steps' floor where the profile fitted a mixed model (it depends on the timings).
    # The decode factor is measured and kept, or, where a busy machine timed the profile and the replay at different
    # speeds (0.44 once, with two other processes on two cores), reported as out of the range a profile keeps
    assert set(factors) <= {"decode", "prefill", "prefill_full", "mixed_floor"}
    assert "decode" in factors or "decode came out" in caplog.text
    assert any(s.get("mixed") and "pred_ms" in s for s in steps)  # it ran chunked prefill, predicted step by step
    # both workloads' steps are in the fit: decode rows of the longer prompts hold over 100 cached tokens each (the
    # first workload's at most 96); whether their prefills share a step with decode rows depends on the timings
    assert max(s["ctx"] / s["decode"] for s in steps if s.get("decode") and "ctx" in s) > 100
    # the replays ran with the prefix cache on, as the server does (their computed pages were cached), and the
    # profiler's engine caches nothing again after them
    assert engine.pool.num_cached_pages > 0 and not engine.pool.enable_prefix_caching
    chunked = {k: v for k, v in factors.items() if k != "prefill_full"}
    assert chunked == pytest.approx({k: v for k, v in serving_factors(steps, predictor).items()
                                     if serving_range(k)[0] <= v <= serving_range(k)[1]})


def test_an_interrupted_run_resumes_with_the_missing_points_only(timer, held_out_profile, tmp_path):
    points, first = held_out_profile
    out = tmp_path / "p.json"
    log = samples_path_for(out)
    lines = samples_path_for(first.path).read_text().splitlines()  # a whole run's log, cut as an interruption cuts it
    log.write_text("\n".join(lines[:6]) + "\n" + lines[6][:10])  # five samples and one cut short
    result = run_profile(timer, points, out, model_name="tiny", budget_s=300, started=time.perf_counter(),
                         resume=True)
    assert result.resumed == 5 and result.measured == len(points) - 5 and out.is_file()
    assert len(read_samples(log, json.loads(lines[0]))) == len(points)


def test_a_budget_too_small_for_the_fit_keeps_the_samples_and_says_resume(timer, tmp_path):
    points = plan_points(SMALL, timer.sm_count, timer.decode_partitions)
    out = tmp_path / "p.json"
    with pytest.raises(ConfigError, match="--resume"):
        run_profile(timer, points, out, model_name="tiny", budget_s=0.0, started=time.perf_counter())
    assert samples_path_for(out).is_file() and not out.exists()


def test_samples_of_another_gpu_are_not_resumed(timer, tmp_path):
    log = tmp_path / "p.json.samples.jsonl"
    log.write_text(json.dumps({"format": "muxd-profile-samples", "shape": {}, "gpu": "H100", "sm_count": 132,
                               "decode_partitions": [16]}) + "\n")
    with pytest.raises(ConfigError, match="measured with shape"):
        run_profile(timer, [], tmp_path / "p.json", model_name="tiny", budget_s=10, started=time.perf_counter(),
                    resume=True)


@pytest.mark.parametrize("args, message", [
    (["--budget-minutes", "0"], "--budget-minutes must be > 0"),
    (["--holdout", "-1"], "--holdout must be >= 0"),
    (["--out", "/nonexistent-dir/p.json"], "does not exist"),
    (["--calibrate-rate", "1"], "--calibrate-rate replays --calibrate-trace or --trace"),
    (["--calibrate-rate", "1", "--calibrate-trace", "/nonexistent.csv"], "/nonexistent.csv: no such file"),
    (["--calibrate-rate", "0.01", "--trace", str(DATA / "azure_code_2023_head200.csv"), "--budget-minutes", "1"],
     "leave nothing of --budget-minutes"),
    (["--calibrate-trace", str(DATA / "azure_code_2023_head200.csv")], "pass --calibrate-rate too"),
    (["--calibrate-rate", "1", "--calibrate-rate", "2", "--calibrate-rate", "3",
      "--calibrate-trace", str(DATA / "azure_code_2023_head200.csv"),
      "--calibrate-trace", str(DATA / "mooncake_conversation_head200.jsonl")],
     "--calibrate-rate is given 3 times for 2 calibration traces"),
    (["--calibrate-rate", "1", "--calibrate-requests", "0", "--trace", str(DATA / "azure_code_2023_head200.csv")],
     "--calibrate-requests >= 1"),
])
def test_profile_command_rejects_bad_flags(args, message, tmp_path):
    base = ["profile", "--out", str(tmp_path / "p.json"), "--device", "cpu"]
    result = CliRunner().invoke(app, base + args)
    assert result.exit_code == 2 and message in result.output


def test_profile_command_calibrates_on_another_trace(tmp_path, monkeypatch):
    monkeypatch.setenv("MUXD_CACHE_DIR", str(tmp_path / "cache"))  # the profile it caches: for no later test
    monkeypatch.setattr(calibrate, "SERIAL_IDLE_S", 0.02)  # as above: the idle after each request replayed alone
    # the command's wiring, not the revisits themselves (the test of run_profile counts those): one more run of each
    # short point is enough for their spread to be reported
    monkeypatch.setattr(profiler, "REVISITS", 1)
    out = tmp_path / "p.json"
    result = CliRunner().invoke(app, [
        "profile", "--out", str(out), "--device", "cpu", "--no-progress", "--budget-minutes", "3",
        "--trace", str(DATA / "mooncake_conversation_head200.jsonl"),
        "--calibrate-trace", str(DATA / "azure_code_2023_head200.csv"), "--calibrate-trace", "chat-short",
        "--calibrate-rate", "20", "--calibrate-requests", "8", "--max-model-len", "2048",
        "--max-num-batched-tokens", "512", "--max-num-seqs", "8", "--holdout", "0", "--seed", "3"])
    assert result.exit_code == 0, result.output
    assert "calibrating: 8 requests of" in result.output and "serving factors" in result.output
    assert "calibrating: 8 requests of chat-short at 20/s" in result.output  # a named workload, no file
    saved = json.loads(out.read_text())
    # on the CPU the short points are measured again when the budget leaves time (a busy machine may leave none);
    # either way the output says what happened
    if "repeat_spread_median" in saved["fit"]:
        assert f"their runs differ by {saved['fit']['repeat_spread_median']:.1%} at the median" in result.output
    else:
        assert "repeated points: none (no short point to repeat, or the budget left no time to)" in result.output
    # the mixed steps' floor too where the CPU profile fitted a mixed model (it depends on the timings)
    assert set(saved["serving"]) <= {"decode", "prefill", "mixed_floor"}
    assert load_predictor(out, ModelConfig.from_file(EMBEDDED / "config.json"), "cpu").serving == saved["serving"]
    # the calibration's logs are kept beside the profile, and fit the same factors again offline
    steps, prefills = (out.with_name(f"p.json.calibration-{kind}.json") for kind in ("steps", "prefills"))
    assert f"the calibration's logs: {steps}" in result.output.replace("\n", "")
    again = tmp_path / "again.json"
    refit = CliRunner().invoke(app, ["bench", "diagnose", "--profile", str(out), "--from-steps", str(steps),
                                     "--from-prefills", str(prefills), "--write-serving", str(again)])
    assert refit.exit_code == 0, refit.output
    assert json.loads(again.read_text())["serving"] == pytest.approx(saved["serving"])


def test_a_calibration_replays_a_trace_file_or_a_named_workload():
    chat = calibration_requests("chat-short", 60)
    assert len(chat) == 60 and 400 < float(np.median([s.prompt_len for s in chat])) < 2500
    assert calibration_requests("chat-short", 60) == chat  # seeded: every profile calibrates on the same requests
    assert len(calibration_requests(str(DATA / "azure_code_2023_head200.csv"), 7)) == 7
    assert _calibration(["chat-short"], [2.0], [60]) == [("chat-short", 2.0, 60)]
    with pytest.raises(ConfigError, match="no-such.csv: no such file .*chat-short"):
        _calibration(["no-such.csv"], [1.0], [10])


def test_a_profile_whose_repeated_runs_disagree_is_called_noisy(tmp_path):
    calm = ProfileResult(tmp_path / "p.json", tmp_path / "p.json.samples.jsonl", spread=[0.01] * 9 + [0.3])
    busy = ProfileResult(tmp_path / "p.json", tmp_path / "p.json.samples.jsonl", spread=[0.01] * 8 + [0.3, 0.5])
    assert not calm.noisy and busy.noisy and busy.spread_median == pytest.approx(0.01)
    assert not ProfileResult(tmp_path / "p.json", tmp_path / "p.json.samples.jsonl").noisy  # nothing repeated


def test_chunked_without_a_budget_is_tuned_from_the_profile(full_profile, llama_checkpoint, caplog):
    """What `muxd serve --policy chunked --profile FILE` runs: the largest budget whose step the profile keeps within
    the contract's TBT target; an explicit --chunk-budget, or no profile, keeps vLLM's --max-num-batched-tokens."""
    out = full_profile.path
    path, _ = llama_checkpoint
    common = dict(model=str(path), policy="chunked", max_num_batched_tokens=8192)
    assert Config.flat(**common, profile=str(out)).scheduler.tuned_chunk_budget is None
    assert Config.flat(**common).scheduler.tuned_chunk_budget == 8192
    assert Config.flat(**common, profile=str(out), chunk_budget=96).scheduler.tuned_chunk_budget == 96
    with caplog.at_level(logging.INFO, logger="muxd.engine"):
        engine = build_engine(Config.flat(**common, profile=str(out)))
    predictor = load_predictor(out, engine.model.config, "cpu")
    budget = engine.scheduler.planner.token_budget
    assert budget == tune_chunk_budget(predictor, engine.contract.slo_for(None).tbt_ms, hi=8192, host=predictor.host)
    # (a fast CPU may fit every budget up to the largest within the target: the tuning is the line above)
    assert 16 <= budget <= 8192 and f"a budget of {budget} tokens" in caplog.text


def test_refit_fits_a_committed_gpu_log_again_with_the_decode_kernels_waves(tmp_path):
    """`muxd profile --refit`: measures nothing, fits the log's samples with today's model form, keeps the serving
    block of the profile beside the log; this log predates recording the plan, so it gets the H200 engine's."""
    base = REPO / "docs/data/profile-llama-3.1-8b-h200-2026-11-22.json"
    out = tmp_path / "refit.json"
    log = base.with_suffix(".samples.jsonl")
    result = CliRunner().invoke(app, ["profile", "-m", str(REPO / "configs/models/llama-3.1-8b"), "--out", str(out),
                                      "--refit", str(log)])
    assert result.exit_code == 0, result.output
    assert "fitted again from the 467 samples" in result.output and "worst point: measured / predicted" in result.output
    old, new = json.loads(base.read_text()), json.loads(out.read_text())
    assert new["decode_plan"] == {"total_sms": 132, "kv_heads": 8, "page_size": 16, "graph_sizes": capture_sizes(256),
                                  "kernel": "flashinfer"}  # the engine of its day
    assert all(len(c) == 4 for c in new["decode"].values()) and new["serving"] == old["serving"]
    assert new["prefill"].keys() == old["prefill"].keys()  # only decode's form changed
    assert all(v == pytest.approx(old["prefill"][k], rel=1e-9) for k, v in new["prefill"].items())
    assert new["fit"]["holdout_decode_max"] < old["fit"]["holdout_decode_max"]
    wrong = CliRunner().invoke(app, ["profile", "--out", str(out), "--refit", str(log)])
    assert wrong.exit_code == 2 and "measured for model shape" in wrong.output
    for text, message in (("", "no samples log to refit"), ("not json\n", "not a muxd profile samples log"),
                          ('{"format": "muxd-profile-samples"}\n', "not a muxd profile samples log")):
        bad = tmp_path / "bad.samples.jsonl"
        bad.write_text(text)
        result = CliRunner().invoke(app, ["profile", "--out", str(out), "--refit", str(bad)])
        assert result.exit_code == 2 and message in result.output, result.output


def test_refit_of_a_cpu_run_reproduces_its_profile(timer, held_out_profile, tmp_path):
    out = held_out_profile[1].path
    assert json.loads(samples_path_for(out).read_text().splitlines()[0])["decode_plan"] is None  # no flashinfer
    again = refit_profile(samples_path_for(out), tmp_path / "again.json", timer.engine.model.config)
    first, second = json.loads(out.read_text()), json.loads((tmp_path / "again.json").read_text())
    assert first["decode_plan"] is None and second["decode_plan"] is None
    for key in ("prefill", "decode"):
        assert first[key].keys() == second[key].keys()
        assert all(v == pytest.approx(first[key][k], rel=1e-9, abs=1e-12) for k, v in second[key].items()), key
    assert second["mixed"] == pytest.approx(first["mixed"], rel=1e-9, abs=1e-12)
    assert again.errors == pytest.approx({k[len("holdout_"):]: v for k, v in first["fit"].items()
                                          if k.startswith("holdout_")})
    # the point each phase missed most, with what was measured and predicted (printed by muxd profile)
    assert set(again.worst) == {"prefill", "decode", "mixed"}
    for kind, (point, measured, predicted) in again.worst.items():
        assert point.kind == kind and point.holdout
        assert abs(predicted - measured) / measured == pytest.approx(again.errors[f"{kind}_max"])


def test_prefills_are_profiled_padded_to_gemm_buckets_timed_first_and_a_resume_keeps_them(timer, tmp_path):
    from appliance.predictor.gemm_table import GemmTable, bucket_sizes

    points = plan_points(SMALL, timer.sm_count, timer.decode_partitions, holdout=1)
    out = tmp_path / "p.json"
    run_profile(timer, points, out, model_name="tiny", budget_s=300, started=time.perf_counter())
    head = json.loads(samples_path_for(out).read_text().splitlines()[0])
    table = GemmTable.from_dict(head["gemm"])
    assert table.rows == bucket_sizes(timer.engine.config.scheduler.max_num_batched_tokens)
    assert set(table.ms) == {timer.sm_count} and json.loads(out.read_text())["gemm"] == head["gemm"]
    assert timer.executor.pad_rows(0)(40) == table.padded_rows(40, timer.sm_count)  # samples ran padded
    # a resumed run keeps the table its samples were padded by (here: another one written into the log)
    other = GemmTable((16, 4096), {timer.sm_count: (2.0, 1.0)})
    lines = samples_path_for(out).read_text().splitlines()
    # (each resume below measures the run's last three points again, padded as its log says)
    kept = lines[1:len(points) - 2]
    samples_path_for(out).write_text("\n".join([json.dumps({**head, "gemm": other.to_dict()}), *kept]) + "\n")
    run_profile(timer, points, out, model_name="tiny", budget_s=300, started=time.perf_counter(), resume=True)
    assert json.loads(out.read_text())["gemm"] == other.to_dict()
    assert timer.executor.pad_rows(0)(40) == 4096
    again = refit_profile(samples_path_for(out), tmp_path / "again.json", timer.engine.model.config)
    assert again.profile.gemm == other.to_dict()
    # a log from before GEMM tables resumes without padding, as its samples ran
    samples_path_for(out).write_text("\n".join([json.dumps({k: v for k, v in head.items() if k != "gemm"}),
                                                *kept]) + "\n")
    run_profile(timer, points, out, model_name="tiny", budget_s=300, started=time.perf_counter(), resume=True)
    assert json.loads(out.read_text())["gemm"] is None and timer.executor.pad_rows(0) is None
    # samples measured with prefill graphs (none run on the CPU) are not resumed without them
    graphs = GemmTable((16, 4096), {timer.sm_count: (2.0, 1.0)}, graph_rows=512)
    samples_path_for(out).write_text("\n".join([json.dumps({**head, "gemm": graphs.to_dict()}), *kept]) + "\n")
    with pytest.raises(ConfigError, match="prefill graphs up to 512 rows.*--prefill-graph-rows 512"):
        run_profile(timer, points, out, model_name="tiny", budget_s=300, started=time.perf_counter(), resume=True)


def test_refit_of_a_gpu_log_with_gemm_buckets_adds_the_prefill_kernels_waves(tmp_path):
    """A log measured with prefills padded to GEMM buckets (it records the table) and before the prefill attention
    plan was recorded: the refit gets the H200's FA3 plan, and the held-out prefill points fit better."""
    base = REPO / "docs/data/profile-llama-3.1-8b-h200-buckets-seed2-2026-11-22.json"
    log = base.with_name(base.name + ".samples.jsonl")
    again = refit_profile(log, tmp_path / "refit.json", ModelConfig.from_file(
        REPO / "configs/models/llama-3.1-8b/config.json"))
    old, new = json.loads(base.read_text()), json.loads((tmp_path / "refit.json").read_text())
    from appliance.predictor.gemm_table import GemmTable

    logged = json.loads(log.read_text().splitlines()[0])["gemm"]
    assert GemmTable.from_dict(new["gemm"]) == GemmTable.from_dict(logged) == GemmTable.from_dict(old["gemm"])
    assert new["prefill_plan"] == {"total_sms": 132, "qo_heads": 32, "tile_q": 128} and old.get("prefill_plan") is None
    assert all(len(c) == 6 for c in old["prefill"].values())
    # the plan's term where it predicts samples left out of the fit better (all partitions but 100 SMs')
    assert sum(len(c) == 7 for c in new["prefill"].values()) == 7 and all(len(c) >= 6 for c in new["prefill"].values())
    assert new["fit"]["holdout_prefill_mean"] < old["fit"]["holdout_prefill_mean"]
    # the point a model linear in new x cached tokens missed by a quarter: two waves of query tiles on 52 SMs
    point = Point("prefill", 52, 159, 19679, holdout=True)
    measured = read_samples(log, json.loads(log.read_text().splitlines()[0]))[point.key][1]
    predicted = again.profile.predictor(32, "profile").prefill_solo_ms(point.items, 52)
    assert abs(predicted - measured) / measured < 0.05


def test_refit_of_a_partition_profiled_at_a_few_sizes_keeps_the_terms_that_predict_between_them(tmp_path):
    """The H100 profile measured each partition's prefill at six sizes; with all seven terms its all-SM fit put the
    time on the attention plan's term and a constant, 29.7 % off a held-out 1,962-token prompt (51.1 ms measured).
    Choosing each partition's terms by how well fits that leave one sample out predict it keeps the GEMM term and
    halves the held-out error."""
    log = tmp_path / "h100.json.samples.jsonl"
    with gzip.open(REPO / "docs/data/profile-llama-3.1-8b-h100-2026-11-25.samples.jsonl.gz", "rt") as f:
        log.write_text(f.read())
    again = refit_profile(log, tmp_path / "refit.json", ModelConfig.from_file(
        REPO / "configs/models/llama-3.1-8b/config.json"))
    a, b, c, d, h, q = again.profile.prefill["132"]  # no attention plan term on all SMs
    assert q > 0 and again.errors["prefill_max"] < 0.15
    point = Point("prefill", 132, 1962, 0, holdout=True)
    predicted = again.profile.predictor(32, "profile").prefill_solo_ms(point.items, 132)
    assert abs(predicted - 51.15) / 51.15 < 0.1


def test_serving_with_a_bucket_profile_pads_prefills_and_answers_as_serial(timer, full_profile, llama_checkpoint):
    """`muxd serve --policy mux --profile FILE`: the profile's GEMM buckets reach the executor, which pads prefill
    launches by them; the tokens are those of serial execution and no page is lost."""
    from appliance.engine.request import SamplingParams

    out = full_profile.path
    path, _ = llama_checkpoint
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = [[3 + i * 5 % 97 for i in range(n)] for n in (7, 45, 20)]
    config = dict(num_gpu_blocks_override=128, enable_prefix_caching=False)
    mux = build_engine(Config.flat(model=path, policy="mux", profile=str(out), **config))
    pad = mux.executor.pad_rows(0)
    table = mux.predictor.gemm
    assert pad is not None and table is not None and pad(45) == table.padded_rows(45, timer.sm_count) >= 45
    serial = build_engine(Config.flat(model=path, **config)).generate(prompts, greedy)
    assert [c.token_ids for c in mux.generate(prompts, greedy)] == [c.token_ids for c in serial]
    assert mux.pool.num_free_pages == mux.pool.num_pages


def test_serve_finds_the_profile_muxd_profile_cached_and_the_default_policy_is_serial_on_a_cpu(timer, full_profile,
                                                                                              llama_checkpoint,
                                                                                              tmp_path, monkeypatch):
    """`muxd profile` keeps a copy of its profile under the cache directory, keyed by the model's shapes, the GPU and
    the muxd version; `muxd serve --policy mux` without --profile loads it. Without --policy, a CPU serves serial."""
    monkeypatch.setenv("MUXD_CACHE_DIR", str(tmp_path / "cache"))  # its own: later tests' engines must not find it
    path, _ = llama_checkpoint
    out = full_profile.path
    model = timer.engine.model.config
    assert find_profile(model, "cpu", cache_dir()) is None  # nothing cached yet, and no shipped profile fits
    cached = cache_profile(out, model, "cpu", cache_dir())
    assert cached.parent == cache_dir() / "profiles" and find_profile(model, "cpu", cache_dir()) == cached
    assert find_profile(model, "NVIDIA H200", cache_dir()) is None  # another GPU: not this profile
    engine = build_engine(Config.flat(model=path, policy="mux", num_gpu_blocks_override=64))
    assert engine.predictor.source == f"profile {cached}"
    default = build_engine(Config.flat(model=path, num_gpu_blocks_override=64))
    assert Config().scheduler.policy == "auto" and default.config.scheduler.policy == "serial"


def test_a_shipped_profile_is_found_by_what_it_describes():
    """The H200 profile shipped inside muxd describes Llama-3.1-8B's shapes on an H200, whatever its file name."""
    model = ModelConfig.from_file(REPO / "configs" / "models" / "llama-3.1-8b" / "config.json")
    found = find_profile(model, "NVIDIA H200", Path("/nonexistent"))
    assert found is not None and found.parent == BUNDLED
    assert find_profile(model, "NVIDIA A100-SXM4-80GB", Path("/nonexistent")) is None
    assert load_predictor(found, model, "NVIDIA H200").source == f"profile {found}"
    # a simulation names the GPU by its kind: the shipped profile of that kind, none for a kind without one; serving
    # keeps to the exact name CUDA reports
    assert find_profile(model, "h200", Path("/nonexistent"), by_kind=True) == found
    assert find_profile(model, "h200", Path("/nonexistent")) is None
    assert find_profile(model, "a100", Path("/nonexistent"), by_kind=True) is None


def test_a_simulation_without_a_profile_plans_with_the_one_found_for_its_gpu(tmp_path, monkeypatch):
    from appliance.bench.run import BenchOptions
    from appliance.bench.simulated import simulated_bench

    monkeypatch.setenv("MUXD_CACHE_DIR", str(tmp_path))
    model = str(REPO / "configs" / "models" / "llama-3.1-8b")
    bench, _, _ = simulated_bench(BenchOptions(model=model), "h200")
    assert bench.predictor.source.startswith("profile ") and "llama-3.1-8b-h200" in bench.predictor.source
    bench, _, _ = simulated_bench(BenchOptions(model=model), "cpu")  # no profile of this model on a CPU
    assert bench.predictor.source.startswith("roofline")
