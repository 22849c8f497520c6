"""`muxd bench` as a user of vLLM's `bench serve` types it: vLLM's flag names and forms where the concept is the
same, vLLM's result keys, and bad input refused with a message naming what is wrong (never a traceback or a hang).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from fake_server import FakeServer
from typer.testing import CliRunner

from appliance.cli.main import app

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


def test_num_prompts_limits_a_trace(fake, tmp_path):
    args = ["--url", fake.url, "--tokenizer", "embedded", "--dataset-path", AZURE, "--request-rate", "inf"]
    result = invoke(*args, "--num-prompts", "3", "--result-dir", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "result.json").read_text())["num_prompts"] == 3
    result = invoke(*args, "--num-prompts", "3", "--max-requests", "4")
    assert result.exit_code == 2 and "--num-prompts" in result.output and "--max-requests" in result.output
