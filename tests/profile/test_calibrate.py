"""Serving calibration: factors from a step log are measured over predicted time per phase; the profile keeps them
(validated); the simulator's clock applies them while the planner does not, and never feeds its online refinement
back into the clock."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from appliance.bench.capacity import SimulatedBench
from appliance.bench.simulate import ServingClock, SimConfig
from appliance.errors import ConfigError
from appliance.model_zoo.config import ModelConfig
from appliance.predictor.predictor import partition_choices
from appliance.predictor.profile import read_profile, save_profile
from appliance.predictor.roofline import DEVICES
from appliance.predictor.shapes import DecodeLoad, PrefillItem
from appliance.predictor.synthetic import SyntheticGPU, synthetic_profile
from appliance.profile.calibrate import MIN_STEPS, full_prefill_factor, mixed_floor, serving_factors
from appliance.profile.diagnose import _mixed_host
from appliance.slo.contract import default_contract
from appliance.workload.metrics import RequestTimeline

ROOT = Path(__file__).resolve().parents[2]
MODEL = ModelConfig.from_file(ROOT / "configs" / "models" / "llama-3.1-8b" / "config.json")


@pytest.fixture(scope="module")
def profile():
    return synthetic_profile(SyntheticGPU(MODEL, DEVICES["h100"]), partition_choices(132), "llama-3.1-8b")


def test_factors_are_measured_over_predicted_time_per_phase(profile):
    p = profile.predictor(MODEL.num_layers, "profile")
    steps = []
    for i in range(MIN_STEPS):
        load = DecodeLoad(1 + i, (1 + i) * 1000)
        steps.append({"launch_ms": 1.1 * p.decode_ms(load), "mixed": False, "decode": 1 + i, "ctx": 1000 * (1 + i),
                      "layers": 0})
        items = [PrefillItem(256 * (1 + i), 512)]
        steps.append({"launch_ms": 1.25 * p.mixed_ms(items, load), "mixed": True, "decode": 1 + i,
                      "ctx": 1000 * (1 + i), "items": [[256 * (1 + i), 512]]})
    # decode beside a prefill, and steps without a measurement, do not count
    steps.append({"launch_ms": 1e6, "mixed": False, "decode": 4, "ctx": 4000, "beside": 1})
    steps.append({"mixed": False, "decode": 4, "ctx": 4000})
    factors = serving_factors(steps, p)
    assert factors["decode"] == pytest.approx(1.1) and factors["prefill"] == pytest.approx(1.25)
    assert "prefill_split" not in factors
    assert serving_factors(steps[:4], p) == {}  # too few steps of either phase
    # prefill launches on a partition's prefill SMs give prefill_split; those on all SMs do not count
    launches = [{"ms": 1.4 * p.prefill_solo_ms([PrefillItem(512 * (1 + i), 1024)], 100, 4), "prefill_sms": 100,
                 "layers": 4, "items": [[512 * (1 + i), 1024]], "beside": i % 2 == 0} for i in range(MIN_STEPS)]
    launches.append({"ms": 1e6, "prefill_sms": p.sm_count, "layers": 4, "items": [[512, 0]], "beside": False})
    factors = serving_factors(steps, p, launches)
    assert factors["prefill_split"] == pytest.approx(1.4) and factors["prefill"] == pytest.approx(1.25)
    assert "prefill_full" not in factors


def test_a_mixed_step_takes_the_floor_it_shows_while_serving_not_the_profiled_one(profile):
    """The profiler reads a short mixed step's host launch time (its floor h'); served by the overlapped loop, short
    chunks take their device time. The floor is refitted from the served steps (none where they show none, the
    measured one where they do), the mixed steps' factor is measured against it, and the profile keeps both: its
    predictor plans with the served floor."""
    floored = profile.model_copy(update={"mixed": [1e-6, 1e-6, 0.02, 1e-4, 5.0, 25.0]})
    p = floored.predictor(MODEL.num_layers, "profile")
    loads = [(PrefillItem(64 * (1 + i), 256 * i), DecodeLoad(1 + i % 4, 2000 * (1 + i % 4))) for i in range(40)]
    gpu = [p.latency.mixed_gpu_ms([item], load) for item, load in loads]
    assert min(gpu) < 10 and max(gpu) > 40  # half the steps under the profile's floor of 25 ms

    def steps(device) -> list[dict]:
        # a step's wall in the overlapped loop may fall short of its device time (timed from the tokens before it)
        return [{"launch_ms": (0.5 if i % 2 else 1.1) * ms, "device_ms": ms, "mixed": True, "decode": load.batch_size,
                 "ctx": load.reused_tokens, "items": [[item.new, item.reused]]}
                for i, ((item, load), ms) in enumerate(zip(loads, device))]

    none = steps([0.9 * g for g in gpu])  # no floor: every step 0.9 of the model's time
    assert mixed_floor(none, p) == {"mixed_floor": 0.0}
    factors = serving_factors(none, p)
    assert factors["mixed_floor"] == 0.0 and factors["prefill"] == pytest.approx(
        sum((1.0 if i % 2 else 1.1) * 0.9 * g for i, g in enumerate(gpu)) / sum(gpu))
    shown = steps([max(12.0, 0.9 * g) for g in gpu])  # a floor of 12 ms
    floor = mixed_floor(shown, p)["mixed_floor"]
    assert 12.0 / 0.9 * 0.9 < floor < 12.0 / 0.9 * 1.1
    assert mixed_floor(none[:MIN_STEPS - 1], p) == {} and mixed_floor(none, profile.predictor(32, "profile")) == {}
    # a profile whose floor was fitted away finds it again where the steps show one
    unfloored = floored.model_copy(update={"serving": {"mixed_floor": 0.0}}).predictor(MODEL.num_layers, "profile")
    assert mixed_floor(shown, unfloored)["mixed_floor"] == pytest.approx(floor, rel=0.05)
    kept = floored.model_copy(update={"serving": {"mixed_floor": 0.0}}).predictor(MODEL.num_layers, "profile")
    item, load = loads[0]
    assert kept.mixed_ms([item], load) == pytest.approx(gpu[0]) and p.mixed_ms([item], load) == 25.0
    with pytest.raises(ValueError, match="mixed_floor floor -1.0 is outside 0..1000"):
        type(floored).model_validate({**floored.model_dump(), "serving": {"mixed_floor": -1.0}})


def test_prefill_on_all_sms_is_measured_from_temporal_steps_after_decode(profile):
    """mux's temporal steps time their prefill layers after decode (`after_ms`): prefill_full is their total over the
    profile's all-SM figure for those layers; it wins over the serial replay's where both are measured."""
    p = profile.predictor(MODEL.num_layers, "profile")
    steps = [{"launch_ms": 30.0, "mixed": False, "decode": 8, "ctx": 8000, "layers": 4 + i % 8,
              "after_items": [[700 + 50 * i, 0], [300, 128]],
              "after_ms": 2.1 * p.prefill_solo_ms([PrefillItem(700 + 50 * i, 0), PrefillItem(300, 128)], None,
                                                  4 + i % 8)} for i in range(MIN_STEPS)]
    assert serving_factors(steps, p)["prefill_full"] == pytest.approx(2.1)
    assert "prefill_full" not in serving_factors(steps[:MIN_STEPS - 1], p)  # too few
    untimed = [{**s, "after_ms": None} for s in steps]  # a temporal step that was not timed does not count
    assert "prefill_full" not in serving_factors(untimed, p)


def test_whole_prompt_prefill_is_measured_from_the_first_tokens_of_requests_served_alone(profile):
    p = profile.predictor(MODEL.num_layers, "profile")

    def served(arrival: float, prompt: int, factor: float, outputs: int = 4) -> RequestTimeline:
        first = arrival + factor * p.prefill_solo_ms([PrefillItem(prompt, 0)]) / 1e3
        return RequestTimeline(arrival=arrival, prompt_tokens=prompt, token_times=[first + 0.01 * k
                                                                                   for k in range(outputs)])

    alone = [served(10.0 * i, 512 * (1 + i % 7), 0.9) for i in range(MIN_STEPS + 1)]
    # a request that arrives while another is still answering, or one whose first token comes after the next
    # request's arrival (alone[3] here), was not alone: it does not count
    crowded = [served(alone[3].arrival + 0.001, 4096, 3.0), served(300.0, 8192, 3.0), served(300.001, 256, 3.0)]
    failed = RequestTimeline(arrival=400.0, prompt_tokens=1024, error="boom")
    factor = full_prefill_factor(alone + crowded + [failed], p)["prefill_full"]
    assert factor == pytest.approx(0.9)
    assert full_prefill_factor(alone[:MIN_STEPS - 1], p) == {}  # too few
    assert "prefill_full" not in full_prefill_factor(alone[:MIN_STEPS] + crowded, p)  # alone[3] does not count


def test_the_clock_applies_the_host_factors_and_the_planner_does_not(profile, tmp_path):
    path = tmp_path / "p.json"
    save_profile(profile.model_copy(update={"serving": {"decode": 1.1, "prefill": 1.2}}), path)
    predictor = read_profile(path).predictor(MODEL.num_layers, "profile")
    bench = SimulatedBench(default_contract(), predictor, SimConfig(num_pages=4096))
    clock = bench.timer
    assert isinstance(clock, ServingClock)
    items, load = [PrefillItem(2048, 0)], DecodeLoad(8, 8000)
    assert clock.prefill_ms(items) == pytest.approx(1.2 * predictor.prefill_ms(items))
    assert clock.mixed_ms(items, load) == pytest.approx(1.2 * predictor.mixed_ms(items, load))
    assert clock.decode_ms(load, 32, items) == pytest.approx(1.1 * predictor.decode_ms(load, 32, items))
    # prefill on a partition: the split slowdown (none measured here), which is the planner's as well
    assert clock.prefill_ms(items, 100) == pytest.approx(predictor.prefill_ms(items, 100))
    assert predictor.prefill_ms(items, 100) == pytest.approx(predictor.prefill_solo_ms(items, 100))
    before = clock.decode_ms(load, 32, items)
    for _ in range(16):  # the planner learns a larger slowdown online; the clock stays what the GPU is
        predictor.observe_decode(load, 32, items, 3 * predictor.decode_ms(load, 32, items))
    assert predictor.decode_ms(load, 32, items) > before / 1.1
    assert clock.decode_ms(load, 32, items) == pytest.approx(before)
    # a whole prompt on all SMs takes prefill_full where the profile has it; mixed steps keep the prefill factor
    save_profile(profile.model_copy(update={"serving": {"decode": 1.1, "prefill": 1.2, "prefill_full": 0.9}}), path)
    full = ServingClock(read_profile(path).predictor(MODEL.num_layers, "profile"))
    assert full.prefill_ms(items) == pytest.approx(0.9 * predictor.prefill_solo_ms(items))
    assert full.prefill_ms(items, predictor.sm_count) == pytest.approx(0.9 * predictor.prefill_solo_ms(items))
    # the planner starts from the same factor and refines it online
    assert full.predictor.prefill_ms(items) == pytest.approx(0.9 * predictor.prefill_solo_ms(items))
    assert full.mixed_ms(items, load) == pytest.approx(1.2 * predictor.mixed_ms(items, load))
    # a profile without factors: the predictor is its own clock
    plain = SimulatedBench(default_contract(), profile.predictor(MODEL.num_layers, "p"), SimConfig(num_pages=4096))
    assert not isinstance(plain.timer, ServingClock)


def test_the_split_slowdown_is_planned_with_and_the_clock_keeps_the_profiled_one(profile, tmp_path):
    path = tmp_path / "p.json"
    save_profile(profile.model_copy(update={"serving": {"prefill": 1.2, "prefill_split": 1.05,
                                                        "prefill_split_per_1k": 0.01}}), path)
    predictor = read_profile(path).predictor(MODEL.num_layers, "profile")
    clock = ServingClock(predictor)
    short, long = [PrefillItem(2048, 0)], [PrefillItem(4096, 20000)]  # spans of 2,048 and 24,096 tokens
    for items, factor in ((short, 1.05 + 0.01 * 2.048), (long, 1.05 + 0.01 * 24.096)):
        assert predictor.prefill_ms(items, 100) == pytest.approx(factor * predictor.prefill_solo_ms(items, 100))
        assert clock.prefill_ms(items, 100) == pytest.approx(predictor.prefill_ms(items, 100))
        # on all SMs there is no decode beside the prefill: the host factor, no split slowdown
        assert predictor.prefill_ms(items) == pytest.approx(predictor.prefill_solo_ms(items))
        assert clock.prefill_ms(items) == pytest.approx(1.2 * predictor.prefill_solo_ms(items))
    for i in range(64):  # the GPU turns out slower beside decode: the planner learns it, the clock stays
        items = [PrefillItem(1024 * (1 + i % 8), 4096 * (i % 5))]
        solo = predictor.prefill_solo_ms(items, 100) * 4 / MODEL.num_layers
        predictor.observe_prefill(items, 4, 100, solo * 1.5)
    assert predictor.split.flat == pytest.approx(1.5) and predictor.split.per_1k == pytest.approx(0.0, abs=1e-9)
    assert clock.prefill_ms(long, 100) == pytest.approx((1.05 + 0.01 * 24.096) * predictor.prefill_solo_ms(long, 100))


def test_a_bad_factor_is_refused_by_name(profile, tmp_path):
    path = tmp_path / "p.json"
    raw = json.loads(profile.model_dump_json())
    raw["serving"] = {"decode": 0.01}
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="serving.*decode factor 0.01"):
        read_profile(path)
    raw["serving"] = {"prefil": 1.1}
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="serving"):
        read_profile(path)
    raw["serving"] = {"prefill_split": 1.1, "prefill_split_per_1k": 0.5}  # +50 % per 1k tokens: not a slope
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="prefill_split_per_1k factor 0.5 is outside 0..0.1"):
        read_profile(path)


def test_the_split_learned_while_serving_is_kept_from_replay_results(profile, tmp_path):
    """`muxd bench diagnose --from-results`: the mux planner's online split fits of served replays (a point JSON's
    `planner`, or that object alone), weighted by their launches, into a copy of the profile they were served with."""
    from typer.testing import CliRunner

    from appliance.cli import app

    src = tmp_path / "p.json"
    save_profile(profile.model_copy(update={"serving": {"decode": 1.05}}), src)
    point = tmp_path / "point.json"
    point.write_text(json.dumps({"policy": "mux", "planner": {"split": {"flat": 1.2, "per_1k": 0.004,
                                                                         "observations": 256}}}))
    planner = tmp_path / "planner.json"
    planner.write_text(json.dumps({"split": {"flat": 1.0, "per_1k": 0.0, "observations": 128}}))
    short = tmp_path / "short.json"  # too few launches to say anything: left out
    short.write_text(json.dumps({"split": {"flat": 3.0, "per_1k": 0.05, "observations": 10}}))
    out = tmp_path / "served.json"
    base = ["bench", "diagnose", "--profile", str(src)]
    result = CliRunner().invoke(app, base + ["--write-serving", str(out)] + [
        a for path in (point, planner, short) for a in ("--from-results", str(path))])
    assert result.exit_code == 0, result.output
    serving = read_profile(out).serving
    assert serving["decode"] == 1.05  # the rest of the serving block is kept
    assert serving["prefill_split"] == pytest.approx((256 * 1.2 + 128 * 1.0) / 384)
    assert serving["prefill_split_per_1k"] == pytest.approx(256 * 0.004 / 384)
    split = read_profile(out).predictor(MODEL.num_layers, "profile").split
    assert (split.flat, split.per_1k) == pytest.approx((serving["prefill_split"], serving["prefill_split_per_1k"]))
    # bad input is named
    chunked = tmp_path / "chunked.json"
    chunked.write_text(json.dumps({"policy": "chunked", "request_rate": 1.0}))
    for args, message in ((["--from-results", str(chunked)], "no mux planner's split fit"),
                          (["--from-results", str(short)], "no replay measured 20 or more"),
                          (["--from-results", str(tmp_path / "none.json")], "cannot read it as JSON")):
        result = CliRunner().invoke(app, base + args)
        assert result.exit_code == 2 and message in result.output, result.output
    result = CliRunner().invoke(app, ["bench", "diagnose", "--from-results", str(point)])
    assert result.exit_code == 2 and "pass --profile" in result.output


def test_serving_factors_from_the_step_log_a_replay_result_holds(profile, tmp_path):
    """`muxd bench diagnose --from-steps` reads a step log (a JSON list) or a replay's result JSON holding one
    (`muxd bench --in-process --save-steps`), and names a file that is neither."""
    from typer.testing import CliRunner

    from appliance.cli import app

    src = tmp_path / "p.json"
    save_profile(profile, src)
    p = read_profile(src).predictor(MODEL.num_layers, "profile")
    steps = [{"launch_ms": 1.3 * p.decode_ms(DecodeLoad(1 + i, 1000 * (1 + i))), "mixed": False, "decode": 1 + i,
              "ctx": 1000 * (1 + i), "layers": 0} for i in range(MIN_STEPS)]
    listed, result, packed = tmp_path / "steps.json", tmp_path / "result.json", tmp_path / "result.json.gz"
    listed.write_text(json.dumps(steps))
    result.write_text(json.dumps({"policy": "mux", "steps": steps, "prefills": []}))
    with gzip.open(packed, "wt") as f:  # a compressed log reads as well
        json.dump({"policy": "mux", "steps": steps, "prefills": []}, f)
    for path in (listed, result, packed):
        out = CliRunner().invoke(app, ["bench", "diagnose", "--profile", str(src), "--from-steps", str(path)])
        assert out.exit_code == 0 and "decode 1.3" in out.output, out.output
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"policy": "mux"}))
    out = CliRunner().invoke(app, ["bench", "diagnose", "--profile", str(src), "--from-steps", str(other)])
    assert out.exit_code == 2 and "neither a list of steps nor a result JSON" in out.output


def test_a_refit_keeps_only_factors_a_profile_may_hold(profile, tmp_path):
    """`muxd bench diagnose --write-serving` keeps what `muxd profile`'s calibration would keep: a factor outside its
    range is reported and left out, so the profile it writes is one muxd reads (it wrote such a factor before)."""
    from typer.testing import CliRunner

    from appliance.cli import app

    src, out = tmp_path / "p.json", tmp_path / "served.json"
    save_profile(profile.model_copy(update={"serving": {"prefill": 1.2}}), src)
    p = read_profile(src).predictor(MODEL.num_layers, "profile")
    steps = tmp_path / "steps.json"
    steps.write_text(json.dumps([{"launch_ms": 0.4 * p.decode_ms(DecodeLoad(1 + i, 1000 * (1 + i))), "mixed": False,
                                  "decode": 1 + i, "ctx": 1000 * (1 + i), "layers": 0} for i in range(MIN_STEPS)]))
    result = CliRunner().invoke(app, ["bench", "diagnose", "--profile", str(src), "--from-steps", str(steps),
                                      "--write-serving", str(out)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "decode came out 0.4 while serving; not kept (outside 0.5..5" in " ".join(result.output.split())
    assert read_profile(out).serving == {"prefill": 1.2}


def test_the_split_slowdown_is_broken_down_by_span_and_the_decode_beside(profile, tmp_path):
    """What the one fitted slowdown averages over: launches binned by attention span and the decode batch planned
    beside them (a log row's `decode_beside`); `muxd bench diagnose --from-prefills` prints the table."""
    from typer.testing import CliRunner

    from appliance.cli import app
    from appliance.profile.calibrate import split_breakdown

    p = profile.predictor(MODEL.num_layers, "profile")

    def launch(new: int, reused: int, batch: float, factor: float) -> dict:
        items = [PrefillItem(new, reused)]
        return {"ms": factor * p.prefill_solo_ms(items, 100, 4), "prefill_sms": 100, "layers": 4, "beside": True,
                "items": [[new, reused]], "decode_beside": {"steps": 3, "batch": batch, "ctx": 1000.0 * batch}}

    rows = ([launch(1000, 0, 4, 1.1)] * 3 + [launch(1000, 0, 64, 1.3)] * 2 + [launch(2000, 18000, 4, 1.2)]
            + [{**launch(1000, 0, 4, 9.0)}]                                 # a stall: left out
            + [{k: v for k, v in launch(1000, 0, 4, 2.0).items() if k != "decode_beside"}])  # an older log's row
    cells = split_breakdown(rows, p)
    assert cells[(0, 1)] == pytest.approx([3, 1.1, 0.0]) and cells[(0, 3)] == pytest.approx([2, 1.3, 0.0])
    assert cells[(3, 1)] == pytest.approx([1, 1.2, 0.9]) and len(cells) == 3
    src, log = tmp_path / "p.json", tmp_path / "prefills.json"
    save_profile(profile, src)
    log.write_text(json.dumps(rows))
    out = CliRunner().invoke(app, ["bench", "diagnose", "--profile", str(src), "--from-prefills", str(log)])
    assert out.exit_code == 0, out.output
    assert "span    <2k, decode batch >32  : 1.300 over 2 launches (0% of their tokens reused)" in out.output


def test_diagnose_prints_the_mixed_steps_launch_host_time_by_graphs(capsys):
    """`muxd bench diagnose` sets a mixed step's launch (host) beside its device time, graph replays and eager
    launches apart: a small model's eager mixed steps are where the GPU waits for the host."""
    steps = [{"mixed": True, "host_launch_ms": 4.0 + i, "device_ms": 6.0, "prefill_graphs": True,
              "prefill_tokens": 1000} for i in range(3)]
    steps += [{"mixed": True, "host_launch_ms": 27.0, "device_ms": 26.0, "prefill_graphs": False,
               "prefill_tokens": 3000}]
    steps += [{"mixed": False, "host_launch_ms": 1.0, "device_ms": 1.2, "prefill_graphs": False, "prefill_tokens": 0},
              {"mixed": True, "prefill_graphs": True, "prefill_tokens": 10}]  # (a decode step; one never launched)
    _mixed_host(steps)
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "  mixed steps' launch host time (replaying graphs): 3 steps, median 5.00 ms, p90 5.80, device median 6.00 "
        "ms; 1000 prompt tokens at the median",
        "  mixed steps' launch host time (eager): 1 step, median 27.00 ms, p90 27.00, device median 26.00 ms; 3000 "
        "prompt tokens at the median"]
