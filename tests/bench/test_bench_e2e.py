"""`muxd bench` end to end against the embedded model: policies side by side (bench starts `muxd serve` per policy)
with the table, JSON and PNGs; the same replay through --url and in process gives the same counts; a Mooncake
replay hits the server's prefix cache; bad flags are refused before anything starts."""
from __future__ import annotations

import json
import socket
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from appliance.bench import launcher
from appliance.bench.launcher import ServerProcess
from appliance.cli.main import app

DATA = Path(__file__).resolve().parents[1] / "data"
AZURE = [
    "--trace", str(DATA / "azure_code_2023_head200.csv"), "--max-requests", "8", "--speedup", "2",
    "--max-model-len", "512", "--goodput", "ttft:5000", "--goodput", "tpot:500", "--no-progress",
]
PNG = b"\x89PNG\r\n\x1a\n"


def bench(*args: str):
    result = CliRunner().invoke(app, ["bench", *args], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return result


@pytest.fixture(scope="module")
def booting(tmp_path_factory):
    """The test's own `muxd serve`, launched at once and waited for only where it is used (it loads meanwhile). Its
    first port is one another process holds (`taken`), as when a port is taken between its choice and the bind."""
    with socket.socket() as holder, pytest.MonkeyPatch.context() as mp:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken, real, drawn = holder.getsockname()[1], launcher.free_port, []
        mp.setattr(launcher, "free_port", lambda: drawn.append(real() if drawn else taken) or drawn[-1])
        server = ServerProcess("embedded", log_dir=tmp_path_factory.mktemp("server"))
        server.taken, server.drawn = taken, drawn
        server.start()
        yield server
        server.stop()


@pytest.fixture
def server(booting):
    booting.wait_ready()
    return booting


def test_a_taken_port_is_replaced(server):
    """The server whose port was taken before its bind started again on another (`muxd bench` launches its servers
    on free ports)."""
    assert server.drawn[0] == server.taken and server.port in server.drawn[1:] and str(server.port) in server.args
    assert httpx.get(server.url + "/ready", timeout=10).status_code == 200


@pytest.fixture(scope="module")
def side_by_side(tmp_path_factory, booting):
    out = tmp_path_factory.mktemp("bench")
    result = bench(*AZURE, "--policies", "serial,layerwise", "--result-dir", str(out), "--save-detailed")
    return out, result.output


def test_policies_side_by_side(side_by_side):
    out, output = side_by_side
    for text in ("serial", "layerwise", "layerwise / serial", "TTFT p99 (ms)", "Request goodput (req/s)"):
        assert text in output
    for policy in ("serial", "layerwise"):  # each server's GET /debug/timeline, drawn
        assert (out / f"timeline-{policy}.png").read_bytes().startswith(PNG)
    serial = json.loads((out / "result-serial.json").read_text())
    layerwise = json.loads((out / "result-layerwise.json").read_text())
    for r, policy in ((serial, "serial"), (layerwise, "layerwise")):
        assert (r["completed"], r["failed"], r["policy"], r["backend"]) == (8, 0, policy, "openai")
        assert r["total_output_tokens"] == sum(r["output_lens"]) == 10 + 8 + 27 + 14 + 12 + 14 + 9 + 23
        assert r["request_goodput"] is not None and 0 <= r["slo_attainment"] <= 1
        for key in ("request_throughput", "output_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
                    "mean_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "p99_itl_ms", "mean_e2el_ms", "duration"):
            assert isinstance(r[key], float) and r[key] > 0, key
    # the same prompts for both: exact lengths, the recorded ones clipped to the 512-token context
    assert serial["input_lens"] == layerwise["input_lens"] == [502, 504, 110, 498, 34, 374, 503, 34]
    comparison = json.loads((out / "comparison.json").read_text())
    assert comparison["baseline"] == "serial"
    assert comparison["ratios"]["layerwise"]["completed"] == 1.0
    for png in ("ttft_cdf.png", "tbt_cdf.png"):
        assert (out / png).read_bytes()[:8] == PNG
    assert (out / "server-serial.log").is_file()


def test_url_and_in_process_replays_match(side_by_side, server, tmp_path):
    out, _ = side_by_side
    launched = json.loads((out / "result-serial.json").read_text())
    result = bench(*AZURE, "--url", server.url, "--tokenizer", "embedded", "--result-dir", str(tmp_path / "url"))
    via_url = json.loads((tmp_path / "url" / "result.json").read_text())
    bench(*AZURE, "--in-process", "--result-dir", str(tmp_path / "local"))
    local = json.loads((tmp_path / "local" / "result.json").read_text())
    for r in (via_url, local):
        for key in ("completed", "failed", "total_input_tokens", "total_output_tokens", "num_prompts"):
            assert r[key] == launched[key], key
    assert via_url["model_id"] == "muxd-embedded" and local["backend"] == "in-process"
    # --max-idle: the same replay without its idle waits, reported on the trace's clock
    bench(*AZURE, "--in-process", "--max-idle", "0", "--speedup", "0.25", "--result-dir", str(tmp_path / "cut"))
    cut = json.loads((tmp_path / "cut" / "result.json").read_text())
    assert (cut["completed"], cut["total_output_tokens"]) == (launched["completed"], launched["total_output_tokens"])
    assert any(n.startswith("--max-idle 0: ") for n in cut["notes"]), cut["notes"]
    assert server.url in result.output
    # chat: the template adds prompt tokens, the outputs are still forced to the recorded lengths
    bench(*AZURE, "--url", server.url, "--tokenizer", "embedded", "--endpoint", "chat", "--max-concurrency", "4",
          "--result-dir", str(tmp_path / "chat"))
    chat = json.loads((tmp_path / "chat" / "result.json").read_text())
    assert (chat["completed"], chat["backend"], chat["max_concurrency"]) == (8, "openai-chat", 4)
    assert chat["total_output_tokens"] == launched["total_output_tokens"]
    assert chat["total_input_tokens"] > launched["total_input_tokens"]


def test_mooncake_replay_exercises_the_prefix_cache(server):
    def cached() -> float:
        text = httpx.get(server.url + "/metrics").text
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith("muxd:cached_prompt_tokens_total"))

    before = cached()
    bench("--url", server.url, "--tokenizer", "embedded", "--trace", str(DATA / "mooncake_conversation_head200.jsonl"),
          "--max-requests", "6", "--request-rate", "20", "--max-model-len", "1100")
    # the six requests share hash id 0 (one 512-token block): every one after the first reuses it from the cache
    assert cached() - before >= 5 * 512


def test_in_process_token_id_prompts_for_a_model_without_tokenizer(llama_checkpoint, tmp_path):
    path, _ = llama_checkpoint  # a tiny random Llama: config.json and weights, no tokenizer.json
    result = bench("--in-process", "--model", str(path), "--num-prompts", "6", "--input-len", "20", "--output-len", "5",
                   "--request-rate", "50", "--policies", "serial,chunked", "--serve-args", "--max-num-seqs 2",
                   "--goodput", "e2el:60000", "--result-dir", str(tmp_path))
    for policy in ("serial", "chunked"):
        r = json.loads((tmp_path / f"result-{policy}.json").read_text())
        assert (r["completed"], r["total_input_tokens"], r["total_output_tokens"]) == (6, 120, 30)
        assert r["backend"] == "in-process" and r["slo_attainment"] == 1.0
    assert "chunked / serial" in result.output
    # a YAML contract as the SLO: per-request targets plus the verdict on the whole run
    contract = Path(__file__).resolve().parents[2] / "configs" / "slo" / "chat.yaml"
    result = bench("--in-process", "--model", str(path), "--num-prompts", "4", "--input-len", "20", "--output-len",
                   "5", "--slo", str(contract), "--result-dir", str(tmp_path / "contract"))
    r = json.loads((tmp_path / "contract" / "result.json").read_text())
    assert r["slo"] == "contract chat" and r["good_requests"] is not None
    assert isinstance(r["contract_met"], bool) and r["contract_met"] == (not r["contract_misses"])
    assert "Contract kept" in result.output and "planner" not in r  # serial: nothing planned online
    # mux: the result keeps what the planner decided and learned online
    bench("--in-process", "--model", str(path), "--num-prompts", "4", "--input-len", "20", "--output-len", "5",
          "--slo", str(contract), "--policies", "mux", "--result-dir", str(tmp_path / "mux"), "--save-steps")
    result = json.loads((tmp_path / "mux" / "result.json").read_text())
    planner = result["planner"]
    assert result["startup"]["kv_pages"] > 0  # what the engine's start decided, beside what it served
    steps = planner["stats"]
    assert sum(steps[k] for k in ("spatial_steps", "aggregated_steps", "chunk_steps", "decode_only_steps",
                                  "prefill_only_steps")) > 0
    assert set(planner) == {"stats", "contention_cells", "split", "mixed", "full", "control", "host"}
    control = planner["control"]["default"]  # the closed loop's state: headroom and the tail it saw, per class
    # 4 gaps of each of 4 requests (and a warm-up)
    assert 0 < control["tbt"]["headroom"] <= 1 and control["tbt"]["samples"] >= 4 * 4
    assert control["ttft"]["samples"] >= 4
    assert planner["mixed"]["observations"] <= steps["aggregated_steps"] + steps["chunk_steps"]
    # in process: the engine's garbage collections during the replay, after its start-up objects were frozen
    pauses = json.loads((tmp_path / "mux" / "result.json").read_text())["gc"]
    assert len(pauses["collections"]) == 3 and min(pauses["collections"]) >= 0 and pauses["frozen"] > 1000
    # and the CPU time of the engine thread and of the event loop (they share one interpreter) over the replay
    threads = json.loads((tmp_path / "mux" / "result.json").read_text())["threads"]
    assert threads["wall_s"] > 0 and threads["engine_cpu_s"] > 0 and threads["event_loop_cpu_s"] > 0
    assert threads["engine_share"] == threads["engine_cpu_s"] / threads["wall_s"]
    # --save-steps: the replay's engine steps (each planned and launched) and prefill launches, for calibration
    logged = json.loads((tmp_path / "mux" / "result.json").read_text())
    assert sum(st["decode"] for st in logged["steps"]) >= 4 * 4 and all("plan_ms" in st for st in logged["steps"])
    assert isinstance(logged["prefills"], list)
    # each step names the requests it prefills: in process, by their place in the workload
    assert {rid for st in logged["steps"] for rid in st["prefill_ids"]} == {f"trace-{i}" for i in range(4)}


def test_save_steps_sets_the_profile_beside_chunked_steps(llama_checkpoint, tmp_path):
    """chunked at a given budget plans without a predictor; --save-steps still sets its --profile's figure beside each
    mixed step (and the decode context it read), so replays of chunked calibrate the profile as mux's do."""
    from appliance.model_zoo.config import ModelConfig
    from appliance.predictor.predictor import partition_choices
    from appliance.predictor.profile import save_profile
    from appliance.predictor.roofline import DEVICES
    from appliance.predictor.synthetic import SyntheticGPU, synthetic_profile

    path, _ = llama_checkpoint
    profile = tmp_path / "profile.json"
    shapes = ModelConfig.from_file(Path(__file__).resolve().parents[2] / "configs/models/llama-3.1-8b/config.json")
    save_profile(synthetic_profile(SyntheticGPU(shapes, DEVICES["h100"]), partition_choices(132), "llama-3.1-8b"),
                 profile)
    bench("--in-process", "--model", str(path), "--num-prompts", "4", "--input-len", "40", "--output-len", "6",
          "--request-rate", "50", "--policies", "chunked", "--serve-args", f"--chunk-budget 16 --profile {profile}",
          "--goodput", "e2el:60000", "--save-steps", "--result-dir", str(tmp_path / "out"))
    steps = json.loads((tmp_path / "out" / "result.json").read_text())["steps"]
    mixed = [s for s in steps if s["mixed"] and s["decode"]]
    assert mixed and all(s["pred_ms"] > 0 and s["items"] and s["ctx"] > 0 for s in mixed)


@pytest.mark.parametrize("args, message", [
    (["--policies", "serial,warp"], "warp not available in this muxd; it serves"),
    (["--url", "http://127.0.0.1:9", "--policies", "serial"], "--policies and --in-process start their own"),
    (["--slo", "contract.yaml"], "--slo"),
    (["--goodput", "ttft"], "--goodput"),
    (["--endpoint", "grpc"], "--endpoint"),
    (["--serve-args", "--port 9000"], "set by muxd bench"),
    (["--in-process", "--serve-args", "--max-num-seqs lots"], "--serve-args"),
    (["--trace", "/nonexistent.csv", "--in-process"], "trace file not found"),
    (["--url", "http://127.0.0.1:9", "--trace", str(DATA / "azure_code_2023_head200.csv")], "--tokenizer"),
    (["--window", "9:3"], "--window"),
    (["--max-idle", "-1"], "--max-idle must be >= 0"),
    (["--save-steps"], "give --in-process"),
    (["--routers", "slo,roundrobin"], "--routers: give comma-separated routers among slo, pow2"),
    (["--routers", "slo", "--url", "http://127.0.0.1:9"], "--routers starts a muxd cluster per router"),
    (["--cluster-args", "--replicas 2"], "give --routers"),
    (["--routers", "slo", "--cluster-args", "--router pow2"], "set by muxd bench"),
])
def test_bad_flags_are_refused_before_starting(args, message):
    result = CliRunner().invoke(app, ["bench", *args, "--no-progress"], env={"COLUMNS": "200"})
    assert result.exit_code == 2, result.output
    assert message in result.output
