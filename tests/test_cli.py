"""The muxd command line: help texts, version, generate, and clear errors for bad flags."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from appliance import __version__
from appliance.cli import app

runner = CliRunner()


def test_version_and_module_entry_point():
    assert runner.invoke(app, ["version"]).output.strip() == f"muxd {__version__}"
    out = subprocess.run([sys.executable, "-m", "appliance", "version"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"muxd {__version__}"


@pytest.mark.parametrize("command, words", [
    ("serve", ["--model", "--host", "--port", "--dtype", "--load-format", "--max-num-seqs", "--kv-cache-memory"]),
    ("generate", ["prompt", "--max-tokens", "--temperature", "--chat"]),
    ("version", ["version"]),
])
def test_help_lists_the_flags(command, words):
    result = runner.invoke(app, [command, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for word in words:
        assert word in result.output


def test_generate_streams_text(text_checkpoint):
    result = runner.invoke(app, ["generate", "import os", "--model", str(text_checkpoint), "--max-tokens", "12"])
    assert result.exit_code == 0, result.output
    assert result.output.strip()


def test_generate_chat_mode(text_checkpoint):
    result = runner.invoke(app, ["generate", "hi", "--chat", "--model", str(text_checkpoint), "--max-tokens", "4",
                                 "--temperature", "0.8", "--seed", "3"])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("args, message", [
    (["--model", "/nonexistent/model"], "not found"),
    (["--dtype", "int3"], "int3"),
    (["--load-format", "pickle"], "--load-format"),
    (["--kv-cache-memory", "lots"], "--kv-cache-memory"),
    (["--planner", "magic"], "--planner"),
    (["--port", "70000"], "--port"),
    (["--model", str(Path(__file__).resolve().parents[1] / "configs" / "models" / "llama-3.1-8b")],
     "--load-format dummy"),
])
def test_serve_rejects_bad_flags_before_starting(text_checkpoint, args, message):
    if "--model" not in args:
        args = ["--model", str(text_checkpoint), *args]
    result = runner.invoke(app, ["serve", *args])
    assert result.exit_code == 2
    assert message in result.output
