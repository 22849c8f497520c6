"""`muxd bench` as a user of vLLM's `bench serve` types it: vLLM's flag names and forms where the concept is the
same, vLLM's result keys, and bad input refused with a message naming what is wrong (never a traceback or a hang).
"""
from __future__ import annotations

import http.server
import json
import threading
import time
from pathlib import Path

import pytest
from fake_server import FakeServer
from typer.testing import CliRunner

from appliance.bench import run
from appliance.cli.main import app
from appliance.errors import ConfigError
from appliance.workload.traces import RequestSpec

DATA = Path(__file__).resolve().parents[1] / "data"
AZURE = str(DATA / "azure_code_2023_head200.csv")


def invoke(*args: str):
    return CliRunner().invoke(app, ["bench", *args, "--no-progress"], env={"COLUMNS": "200"})


@pytest.fixture(scope="module")
def fake():
    with FakeServer(0.01) as server:
        yield server


def test_a_trace_format_without_a_file_is_refused():
    result = invoke("--dataset-name", "sharegpt", "--url", "http://127.0.0.1:9", "--tokenizer", "embedded")
    assert result.exit_code == 2, result.output
    assert "--dataset-name sharegpt reads a trace file: give --dataset-path" in result.output


def test_the_synthetic_defaults_are_vllms(monkeypatch):
    """Without lengths or a count, the synthetic workload is vLLM `bench serve`'s random dataset: 1,000 prompts of
    1,024 tokens, 128 output tokens each."""
    from appliance.cli import bench as bench_cli

    seen = {}

    def capture(opts):
        seen["workload"] = real(opts)
        raise ConfigError("captured")

    real = bench_cli._workload
    monkeypatch.setattr(bench_cli, "_workload", capture)
    result = invoke("--url", "http://127.0.0.1:9", "--tokenizer", "embedded", "--dataset-name", "random")
    assert "captured" in result.output, result.output
    _, specs = seen["workload"]
    assert len(specs) == 1000
    assert {s.prompt_len for s in specs} == {1024} and {s.output_len for s in specs} == {128}


def test_num_prompts_limits_a_trace(fake, tmp_path):
    args = ["--url", fake.url, "--tokenizer", "embedded", "--dataset-path", AZURE, "--request-rate", "inf"]
    result = invoke(*args, "--num-prompts", "3", "--result-dir", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "result.json").read_text())["num_prompts"] == 3
    result = invoke(*args, "--num-prompts", "3", "--max-requests", "4")
    assert result.exit_code == 2 and "--num-prompts" in result.output and "--max-requests" in result.output


def test_vllm_sampling_backend_and_sharegpt_flags(fake, tmp_path):
    """--backend, --top-p/--top-k/--min-p, --trust-remote-code and --sharegpt-output-len as vLLM's bench takes them."""
    convs = [{"id": str(i), "conversations": [{"from": "human", "value": f"question {i} " * 5},
                                              {"from": "gpt", "value": "answer " * (20 + i)}]} for i in range(4)]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(convs))
    result = invoke("--url", fake.url, "--tokenizer", "embedded", "--dataset-name", "sharegpt", "--dataset-path",
                    str(path), "--sharegpt-output-len", "3", "--backend", "vllm", "--top-p", "0.9", "--top-k", "5",
                    "--min-p", "0.05", "--trust-remote-code", "--request-rate", "inf", "--result-dir", str(tmp_path))
    assert result.exit_code == 0, result.output
    saved = json.loads((tmp_path / "result.json").read_text())
    assert saved["total_output_tokens"] == 4 * 3 and saved["backend"] == "openai"
    for args, message in (
            (["--backend", "tgi"], "--backend 'tgi' is not served by muxd bench"),
            (["--backend", "openai-chat", "--endpoint", "/v1/completions"], "names the other one"),
            (["--sharegpt-output-len", "3"], "this workload is synthetic"),
            (["--dataset-path", AZURE, "--sharegpt-output-len", "3"], "this workload is azure"),
            (["--dataset-path", str(path), "--sharegpt-output-len", "0"], "must be >= 1")):
        refused = invoke("--url", "http://127.0.0.1:9", "--tokenizer", "embedded", *args)
        assert refused.exit_code == 2 and message in refused.output, refused.output


def test_label_metadata_and_appended_results(fake, tmp_path):
    """vLLM's --label, --metadata K=V K2=V2 (several after one flag) and --append-result (one JSON a line)."""
    args = ["--url", fake.url, "--tokenizer", "embedded", "--num-prompts", "2", "--input-len", "8", "--output-len",
            "2", "--request-rate", "inf", "--label", "nightly", "--metadata", "version=0.3", "tp=1",
            "--save-result", "--result-dir", str(tmp_path), "--result-filename", "runs.json", "--append-result"]
    for _ in range(2):
        result = invoke(*args)
        assert result.exit_code == 0, result.output
    lines = (tmp_path / "runs.json").read_text().splitlines()
    assert len(lines) == 2
    for line in lines:
        saved = json.loads(line)
        assert (saved["label"], saved["version"], saved["tp"], saved["completed"]) == ("nightly", "0.3", "1", 2)
    warmed = invoke(*args[:-1], "--num-warmups", "3")  # (without --append-result: the file is replaced)
    assert warmed.exit_code == 0, warmed.output
    assert json.loads((tmp_path / "runs.json").read_text())["completed"] == 2  # warm-ups are not counted
    for bad, message in ((["--metadata", "=x"], "--metadata takes KEY=VALUE pairs"),
                         (["--num-warmups", "-1"], "--num-warmups must be >= 0"),
                         (["--append-result"], "--append-result adds to a result file")):
        refused = invoke("--url", "http://127.0.0.1:9", "--tokenizer", "embedded", *bad)
        assert refused.exit_code == 2 and message in refused.output, refused.output


class _Silent(http.server.BaseHTTPRequestHandler):
    """Lists a model, then never answers a completion (a wedged server, or another service on the port)."""

    def do_GET(self):
        body = json.dumps({"data": [{"id": "m", "max_model_len": 2048}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        time.sleep(30)

    def log_message(self, *args):
        pass


def test_a_server_that_never_answers_fails_the_test_request(monkeypatch):
    monkeypatch.setattr(run, "CHECK_TIMEOUT_S", 1.0)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Silent)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        result = invoke("--url", f"http://127.0.0.1:{server.server_address[1]}", "--tokenizer", "embedded",
                        "--num-prompts", "2", "--input-len", "8", "--output-len", "2")
    finally:
        server.shutdown()
    assert result.exit_code == 2, result.output
    assert "the test request failed (no answer within 1 s" in result.output


@pytest.mark.parametrize("args, message", [
    (["--request-timeout", "0"], "--request-timeout must be > 0 seconds, got 0"),
    (["--request-timeout", "-1"], "--request-timeout must be > 0 seconds, got -1"),
    (["--skip", "-1"], "--skip must be >= 0, got -1"),
])
def test_out_of_range_numbers_are_refused(args, message):
    result = invoke("--url", "http://127.0.0.1:9", "--tokenizer", "embedded", *args)
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_result_paths(fake, tmp_path):
    taken = tmp_path / "taken"
    taken.write_text("")
    result = invoke("--url", "http://127.0.0.1:9", "--tokenizer", "embedded", "--result-dir", str(taken))
    assert result.exit_code == 2 and f"--result-dir {taken} is a file" in result.output, result.output
    result = invoke("--url", fake.url, "--tokenizer", "embedded", "--num-prompts", "2", "--input-len", "8",
                    "--output-len", "2", "--result-dir", str(tmp_path), "--result-filename", "runs/a.json")
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "runs" / "a.json").read_text())["completed"] == 2


def test_goodput_takes_several_pairs_after_one_flag(fake, tmp_path):
    """vLLM's form, `--goodput ttft:MS tpot:MS`, for a replay and for a sweep."""
    args = ["--url", fake.url, "--tokenizer", "embedded", "--num-prompts", "2", "--input-len", "8", "--output-len", "2"]
    result = invoke(*args, "--goodput", "ttft:60000", "tpot:60000", "--result-dir", str(tmp_path / "one"))
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "one" / "result.json").read_text())["slo"] == "ttft:60000 tpot:60000"
    result = invoke("sweep", *args, "--goodput", "ttft:60000", "e2el:60000", "--rates", "50",
                    "--result-dir", str(tmp_path / "sweep"))
    assert result.exit_code == 0, result.output
    point = json.loads(next((tmp_path / "sweep" / "points").glob("*.json")).read_text())
    assert point["slo"] == "ttft:60000 e2el:60000"


def test_endpoint_takes_vllm_paths(fake, tmp_path):
    result = invoke("--url", fake.url, "--tokenizer", "embedded", "--num-prompts", "2", "--input-len", "8",
                    "--output-len", "2", "--endpoint", "/v1/completions", "--result-dir", str(tmp_path))
    assert result.exit_code == 0, result.output
    r = json.loads((tmp_path / "result.json").read_text())
    assert r["endpoint_type"] == r["backend"] == "openai"  # vLLM writes both
    result = invoke("--url", fake.url, "--tokenizer", "embedded", "--endpoint", "/v1/embeddings")
    assert result.exit_code == 2 and "/v1/chat/completions" in result.output, result.output


def test_model_as_vllm_takes_a_name_muxd_can_find_a_tokenizer_for(monkeypatch, tmp_path):
    """vLLM's --model is the model asked for and the tokenizer's source: muxd's embedded model by its served name is
    taken (the replay then finds no server here); an id neither local nor cached is named, with the cache."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    result = invoke("--url", "http://127.0.0.1:9", "--model", "muxd-embedded", "--num-prompts", "2")
    assert result.exit_code == 2 and "cannot reach http://127.0.0.1:9" in result.output, result.output
    result = invoke("--url", "http://127.0.0.1:9", "--model", "acme/absent", "--num-prompts", "2")
    assert result.exit_code == 2, result.output
    assert "--model acme/absent: no such model directory" in result.output and str(tmp_path) in result.output


def test_vllm_flags_whose_behaviour_is_fixed_here_are_accepted(fake, tmp_path):
    """--ignore-eos (outputs are always forced to their length) and --disable-tqdm (--no-progress)."""
    result = invoke("--url", fake.url, "--tokenizer", "embedded", "--num-prompts", "2", "--input-len", "8",
                    "--output-len", "3", "--ignore-eos", "--disable-tqdm", "--result-dir", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "result.json").read_text())["total_output_tokens"] == 6


class _CountingTarget:
    """Answers the first `ok` requests with one token, refuses the next one and raises on the rest."""

    def __init__(self, ok: int) -> None:
        self.sent, self.ok = [], ok

    async def send(self, prompt, spec, timeline):
        self.sent.append((prompt, spec.output_len))
        if len(self.sent) > self.ok + 1:
            raise RuntimeError("connection reset")
        if len(self.sent) > self.ok:
            timeline.error = "refused"
        else:
            timeline.token_times.append(0.0)


def test_warm_ups_send_the_first_requests_at_once_and_fail_clearly():
    specs = [RequestSpec(0.0, 4, n) for n in (3, 5)]
    session = run.Session(run.BenchOptions(num_warmups=3))
    try:
        session.target = _CountingTarget(ok=3)
        session.loop.run_until_complete(session._warm_up(specs, ["a", "b"]))
        assert session.target.sent == [("a", 3), ("b", 5), ("a", 3)]
        session.target = _CountingTarget(ok=1)
        with pytest.raises(ConfigError, match=r"2 of 3 warm-up requests failed \(refused\)"):
            session.loop.run_until_complete(session._warm_up(specs, ["a", "b"]))
        session.target = _CountingTarget(ok=-1)  # every send raises
        with pytest.raises(ConfigError, match=r"3 of 3 warm-up requests failed \(RuntimeError: connection reset\)"):
            session.loop.run_until_complete(session._warm_up(specs, ["a", "b"]))
    finally:
        session.loop.close()
