"""guidellm and aiperf, run as their users run them against vLLM (only the target and the tokenizer given), against
`muxd serve` with the embedded model: every request succeeds and their results are what was asked for."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.config import EMBEDDED_MODEL_DIR


def _tool(name: str) -> str:
    beside = Path(sys.executable).parent / name  # the test extra installs them into this environment
    found = str(beside) if beside.is_file() else shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed (pip install -e '.[test]')")
    return found


@pytest.fixture(scope="module")
def server(shared_serve):
    return shared_serve("--kv-cache-memory", "64MiB", "--max-model-len", "512")


def _run(cmd: list[str], cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200"}
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def test_guidellm_constant_rate(server, tmp_path):
    result = tmp_path / "guidellm.json"
    _run([_tool("guidellm"), "run", "--backend", f"kind=openai_http,target={server.url}",
          "--profile", "kind=constant,rate=16", "--constraint", "kind=max_requests,count=8",
          "--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=8",
          "--tokenizer", f"kind=huggingface_auto,model={EMBEDDED_MODEL_DIR}",
          "--output", f"kind=json,path={result}", "--disable-console-interactive"], tmp_path)
    [bench] = json.loads(result.read_text())["benchmarks"]
    metrics = bench["metrics"]
    assert metrics["request_totals"] == {"successful": 8, "errored": 0, "incomplete": 0, "total": 8}
    assert metrics["output_token_count"]["successful"]["median"] == 8
    ttft = metrics["time_to_first_token_ms"]["successful"]
    assert ttft["count"] == 8 and 0 < ttft["min"] <= ttft["max"]
    assert metrics["inter_token_latency_ms"]["successful"]["count"] == 8 * 7  # one per gap between tokens


def test_aiperf_goodput(server, tmp_path):
    out_dir = tmp_path / "aiperf"
    _run([_tool("aiperf"), "profile", "--model", "muxd-embedded", "--url", server.url, "--endpoint-type", "chat",
          "--streaming", "--tokenizer", str(EMBEDDED_MODEL_DIR), "--isl", "32", "--osl", "8", "--request-count", "8",
          "--request-rate", "16", "--random-seed", "1", "--extra-inputs", "ignore_eos:true",  # exactly --osl tokens
          "--goodput",
          "time_to_first_token:60000 inter_token_latency:60000", "--output-artifact-dir", str(out_dir),
          "--no-auto-plot"], tmp_path)
    result = json.loads((out_dir / "profile_export_aiperf.json").read_text())
    assert result["request_count"]["avg"] == 8 and not result.get("error_summary")
    assert result["good_request_count"]["avg"] == 8  # every request met the (loose) targets
    assert result["goodput"]["avg"] == pytest.approx(result["request_throughput"]["avg"])
    assert result["output_sequence_length"]["avg"] == pytest.approx(8, abs=1)
