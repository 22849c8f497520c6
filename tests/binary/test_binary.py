"""The single-file binary: packaging/build.sh builds dist/muxd, which runs `muxd version` and `muxd generate` with the
embedded model it carries, and generates what the installed package generates. Slow (minutes): `make test-binary`."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from appliance import __version__

ROOT = Path(__file__).resolve().parents[2]
BINARY = ROOT / "dist" / "muxd"
PROMPT = "def fib(n):"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]


@pytest.fixture(scope="module")
def binary() -> Path:
    pytest.importorskip("PyInstaller", reason="install the binary extra: pip install -e '.[binary]'")
    env = {**os.environ, "PYTHON": sys.executable}
    build = subprocess.run(["bash", "packaging/build.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=3000)
    assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-4000:]
    assert BINARY.is_file() and os.access(BINARY, os.X_OK)
    assert BINARY.stat().st_size < 4 << 30  # the one-file archive limit
    return BINARY


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    # from an unrelated directory and without the source tree on the path: only what the binary carries counts
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_binary_prints_its_version(binary, tmp_path):
    out = run([str(binary), "version"], tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"muxd {__version__}"


def test_binary_generates_with_its_embedded_model_as_the_package_does(binary, tmp_path):
    args = ["generate", PROMPT, "--max-tokens", "24"]
    frozen = run([str(binary), *args], tmp_path)
    assert frozen.returncode == 0, frozen.stderr
    installed = run([sys.executable, "-m", "appliance", *args], tmp_path)
    assert installed.returncode == 0, installed.stderr
    assert frozen.stdout.strip() and frozen.stdout == installed.stdout  # greedy: the same text


def test_binary_refuses_a_missing_model_cleanly(binary, tmp_path):
    out = run([str(binary), "generate", "hi", "--model", str(tmp_path / "missing")], tmp_path)
    assert out.returncode == 2 and "not found" in out.stderr and "Traceback" not in out.stderr
