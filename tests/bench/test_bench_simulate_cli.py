"""`muxd bench --simulate`: per policy p99 TTFT/TBT, attainment against the contract and capacity, no GPU."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from typer.testing import CliRunner

from appliance.cli.main import app
from appliance.model_zoo.config import ModelConfig
from appliance.predictor.predictor import partition_choices
from appliance.predictor.profile import save_profile
from appliance.predictor.roofline import DEVICES
from appliance.predictor.synthetic import SyntheticGPU, synthetic_profile

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "configs" / "models" / "llama-3.1-8b"
TRACE = ROOT / "tests" / "data" / "mooncake_conversation_head200.jsonl"
SLO = ROOT / "configs" / "slo" / "chat-queue.yaml"
runner = CliRunner()


def synthetic_profile_file(tmp_path: Path) -> Path:
    """A profile of the synthetic H100 for the 8B shapes (a known latency function, no GPU)."""
    profile = tmp_path / "profile.json"
    gpu = SyntheticGPU(ModelConfig.from_file(MODEL / "config.json"), DEVICES["h100"])
    save_profile(synthetic_profile(gpu, partition_choices(132), "llama-3.1-8b"), profile)
    return profile


def test_simulate_prints_capacity_per_policy(tmp_path):
    profile = synthetic_profile_file(tmp_path)
    args = ["bench", "--simulate", "--policies", "mux,serial", "--trace", str(TRACE), "--max-requests", "20",
            "--spread-ties", "--model", str(MODEL), "--profile", str(profile), "--gpu", "h100",
            "--slo", str(ROOT / "configs" / "slo" / "long-context.yaml"), "--result-dir", str(tmp_path / "out")]
    result = runner.invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for word in ("p99 TTFT", "p99 TBT", "attainment", "capacity", "mux", "serial", f"profile {profile}"):
        assert word in result.output
    saved = json.loads((tmp_path / "out" / "simulated.json").read_text())
    by_policy = {r["policy"]: r for r in saved["results"]}
    assert set(by_policy) == {"mux", "serial"}
    for r in by_policy.values():
        assert r["completed"] == 20 and r["capacity"] is not None and r["capacity_points"]
        assert r["contract_met"] == (r["capacity"] >= r["offered_rate"] * 0.999)  # capacity search agrees
    assert by_policy["mux"]["capacity"] >= by_policy["serial"]["capacity"]


def test_simulate_refuses_what_it_cannot_do():
    base = ["bench", "--simulate", "--trace", str(TRACE), "--model", str(MODEL)]
    for extra, words in ((["--url", "http://127.0.0.1:1"], "--simulate replays"),
                         (["--goodput", "ttft:500"], "pass --slo FILE"),
                         (["--policies", "fastest"], "fastest"),
                         (["--slo", str(SLO), "--device-error", "-1"], "--device-error must be in"),
                         (["--slo", str(SLO), "--host-error", "11"], "--host-error must be in"),
                         (["--slo", str(SLO), "--host-spread", "3"], "--host-spread must be in"),
                         (["--slo", str(SLO), "--device-spread", "0.5"], "--device-spread must be in"),
                         (["--slo", str(SLO), "--device-spread", "-0.1"], "--device-spread must be in"),
                         (["--slo", str(SLO), "--planner-prior", "--profile", str(ROOT / "no-such-profile.json")],
                          "no profile of this model")):
        result = runner.invoke(app, base + extra, env={"COLUMNS": "200"})
        assert result.exit_code != 0 and words in result.output, result.output
    result = runner.invoke(app, [w for w in base if w != "--simulate"] + ["--planner-prior"], env={"COLUMNS": "200"})
    assert result.exit_code != 0 and "--planner-prior plans a simulated replay" in result.output, result.output



def test_simulate_honours_mux_mixed_chunks(tmp_path):
    from appliance.bench.run import BenchOptions
    from appliance.bench.simulated import simulated_bench

    profile = synthetic_profile_file(tmp_path)
    args = ["bench", "--simulate", "--policies", "mux", "--trace", str(TRACE), "--max-requests", "8", "--model",
            str(MODEL), "--profile", str(profile), "--slo", str(ROOT / "configs" / "slo" / "long-context.yaml"),
            "--serve-args=--mixed-chunks", "--result-dir", str(tmp_path / "out")]
    result = runner.invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "--mixed-chunks" in result.output
    for serve_args, on in ((["--mixed-chunks"], True), (["--chunk-budget", "512", "--mixed-chunks"], True),
                           ([], False)):
        bench, _, _ = simulated_bench(BenchOptions(model=str(MODEL), profile=profile, serve_args=serve_args), "h100")
        assert bench.planner("mux").options.mixed_chunks is on


def test_simulate_honours_the_engine_limits_of_its_serve_args(tmp_path):
    """--max-num-seqs, --max-waiting, the KV pool's size and page and prefix caching reach the simulated engine as
    they would reach `muxd serve`; a replay that runs more requests than the seats queues the rest."""
    from appliance.bench.run import BenchOptions
    from appliance.bench.simulated import simulated_bench
    from appliance.workload.traces import load_trace

    profile = synthetic_profile_file(tmp_path)
    default, _, _ = simulated_bench(BenchOptions(model=str(MODEL), profile=profile), "h100")
    assert (default.sim.max_num_seqs, default.sim.max_waiting, default.sim.enable_prefix_caching) == (256, 4096, True)
    args = ["--max-num-seqs", "3", "--max-waiting", "50", "--no-prefix-caching", "--num-gpu-blocks-override", "4000",
            "--block-size", "32"]
    bench, _, notes = simulated_bench(BenchOptions(model=str(MODEL), profile=profile, serve_args=args), "h100")
    sim = bench.sim
    assert (sim.max_num_seqs, sim.max_waiting, sim.enable_prefix_caching, sim.num_pages, sim.page_size) == (
        3, 50, False, 4000, 32)
    assert any("3 sequences at once" in n for n in notes)
    halved, _, _ = simulated_bench(BenchOptions(model=str(MODEL), profile=profile,
                                                serve_args=["--gpu-memory-utilization", "0.5"]), "h100")
    assert halved.sim.num_pages < default.sim.num_pages
    burst = [dataclasses.replace(s, arrival=0.0) for s in load_trace(TRACE)[:12]]
    three = simulated_bench(BenchOptions(model=str(MODEL), profile=profile, serve_args=["--max-num-seqs", "3"]),
                            "h100")[0].run("mux", burst)
    every = default.run("mux", burst)
    assert all(t.error is None for t in three.result.timelines + every.result.timelines)
    assert three.result.end_time > every.result.end_time  # three seats: the burst's decodes take turns


def test_simulate_notes_prompts_longer_than_the_profile_measured(tmp_path):
    profile = synthetic_profile_file(tmp_path)
    raw = json.loads(profile.read_text())
    raw["measured"] = {"prefill_new": 1000, "prefill_kv": 1000}
    profile.write_text(json.dumps(raw))
    args = ["bench", "--simulate", "--policies", "mux", "--trace", str(TRACE), "--max-requests", "10", "--spread-ties",
            "--model", str(MODEL), "--profile", str(profile), "--gpu", "h100", "--slo", str(SLO),
            "--result-dir", str(tmp_path / "out")]
    result = runner.invoke(app, args, env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    notes = json.loads((tmp_path / "out" / "simulated.json").read_text())["notes"]
    longer = [n for n in notes if "longer than the profile measured (1000 tokens)" in n]
    assert len(longer) == 1 and longer[0].endswith("(profile longer prompts with `muxd profile --trace` of this "
                                                   "workload)")
    assert int(longer[0].split()[0]) >= 1


def test_simulate_saves_its_steps_as_the_engine_logs_them(tmp_path):
    """`--save-steps` with `--simulate`: every simulated step and prefill launch in each sweep point's JSON (the
    engine step log's keys, virtual time), the one replay as profiled; `bench diagnose` will not calibrate from it."""
    profile = synthetic_profile_file(tmp_path)
    out = tmp_path / "sweep"
    args = ["bench", "sweep", "--simulate", "--policies", "mux,chunked", "--trace", str(TRACE), "--max-requests", "20",
            "--spread-ties", "--model", str(MODEL), "--profile", str(profile), "--gpu", "h100", "--slo", str(SLO),
            "--rates", "2", "--save-steps", "--result-dir", str(out), "--no-progress"]
    result = runner.invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for policy in ("mux", "chunked"):
        point = json.loads((out / "points" / f"{policy}-2.json").read_text())
        steps, prefills = point["steps"], point["prefills"]
        assert point["simulated"] is True and steps
        assert sum(s["decode"] for s in steps) >= point["total_output_tokens"] - point["completed"]
        times = [s["t"] for s in steps]
        assert times == sorted(times) and times[-1] <= point["duration"] + 1
        for s in steps:
            assert {"mode", "layers", "prefill_tokens", "waiting", "headroom", "launch_ms"} <= set(s)
            assert s["launch_ms"] >= 0 and s.get("device_ms", 0) >= 0
        if policy == "mux":  # prefill launched layer range by layer range, on a partition or after decode
            assert prefills or any("after_ms" in s for s in steps)
            assert all(p["ms"] > 0 and p["layers"] > 0 for p in prefills)
        else:  # chunked runs prefill inside its mixed steps
            assert any(s["mixed"] for s in steps) and not prefills
    refused = runner.invoke(app, ["bench", "diagnose", "--from-steps", str(out / "points" / "mux-2.json"),
                                  "--profile", str(profile), "--model", str(MODEL)], env={"COLUMNS": "200"})
    assert refused.exit_code != 0 and "simulated replay" in refused.output, refused.output


def test_simulate_plans_for_the_gpu_the_profile_was_measured_on(tmp_path):
    """Without --gpu, a --profile measured on an H200 is used as such (not set aside for an H100's roofline prior);
    --gpu h100 still sets it aside, saying why."""
    profile = tmp_path / "profile-h200.json"
    gpu = SyntheticGPU(ModelConfig.from_file(MODEL / "config.json"), DEVICES["h200"])
    save_profile(synthetic_profile(gpu, partition_choices(132), "llama-3.1-8b"), profile)
    args = ["bench", "--simulate", "--policies", "serial", "--trace", str(TRACE), "--max-requests", "10",
            "--spread-ties", "--model", str(MODEL), "--profile", str(profile), "--slo", str(SLO)]
    result = runner.invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert f"profile {profile}" in result.output and "roofline prior" not in result.output
    result = runner.invoke(app, [*args, "--gpu", "h100"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "using the roofline prior for H100" in " ".join(result.output.split())


def test_sweep_reports_the_contracts_stricter_attainment(tmp_path):
    """A contract asking 99 % of requests beats the default --attainment 0.9: the capacity line and sweep.json name
    the target the points were judged against, not the option's."""
    profile = synthetic_profile_file(tmp_path)
    out = tmp_path / "sweep"
    args = ["bench", "sweep", "--simulate", "--policies", "serial", "--trace", str(TRACE), "--max-requests", "10",
            "--spread-ties", "--model", str(MODEL), "--profile", str(profile), "--gpu", "h100", "--slo", str(SLO),
            "--rates", "0.5", "--result-dir", str(out), "--no-progress"]
    result = runner.invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "99% attainment" in text and "90% attainment" not in text, text
    sweep = json.loads((out / "sweep.json").read_text())
    assert [s["target_attainment"] for s in sweep] == [0.99]


def test_simulate_tunes_chunked_on_an_idle_gpu_when_everything_arrives_at_once(tmp_path):
    """A synthetic workload without --request-rate arrives all at once: chunked's budget is then the one `muxd serve`
    takes (the largest whose step meets TBT on an idle GPU), not the least one, which a burst of every request
    would leave whatever rate the sweep replays; with a rate, it is tuned on the workload at that rate."""
    profile = synthetic_profile_file(tmp_path)
    base = ["bench", "sweep", "--simulate", "--policies", "chunked", "--input-len", "2000", "--output-len", "64",
            "--num-prompts", "40", "--model", str(MODEL), "--profile", str(profile), "--gpu", "h100", "--slo",
            str(SLO), "--rates", "1", "--no-progress"]
    result = runner.invoke(app, [*base, "--result-dir", str(tmp_path / "a")], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "on an idle GPU" in text, text
    budget = int(text.split("chunked budget ")[1].split()[0])
    point = json.loads((tmp_path / "a" / "points" / "chunked-1.json").read_text())
    assert point["chunk_budget"] == budget > 128
    result = runner.invoke(app, [*base, "--request-rate", "1", "--result-dir", str(tmp_path / "b")],
                           env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "at its own times" in " ".join(result.output.split())
