"""Hostile SLO contracts (alias bombs, recursion, deep nesting, huge files, bytes that are not UTF-8) are refused
with one line naming the file and line, in bounded memory, by `muxd slo check` (exit 2) and by `muxd serve --slo`."""
from __future__ import annotations

import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest
from typer.testing import CliRunner

from appliance.cli.main import app
from appliance.errors import ContractError
from appliance.slo.contract import load_contract

ROOT = Path(__file__).resolve().parents[2]
LOL = "lol"
ALIAS_BOMB = "a: &a [" + ",".join([f'"{LOL}"'] * 9) + "]\n" + "".join(
    f"{c}: &{c} [" + ",".join([f"*{p}"] * 9) + "]\n" for p, c in zip("abcdefgh", "bcdefghi"))
MERGE_BOMB = "a: &a {x: 1, y: 2}\n" + "".join(
    f"{c}: &{c} {{<<: [" + ", ".join([f"*{p}"] * 4) + f"], k{c}: 1}}\n" for p, c in zip("abcdefghijklmnop",
                                                                                         "bcdefghijklmnopq"))
HOSTILE = {
    "alias-bomb": (ALIAS_BOMB.encode(), "aliases expand to more than"),
    "merge-bomb": (MERGE_BOMB.encode(), "aliases expand to more than"),
    "recursive-alias": (b"name: &a [*a]\n", "contains it"),
    "recursive-mapping": (b"targets: &t {ttft: *t}\n", "contains it"),
    "deep-flow": (b"name: " + b"[" * 50_000 + b"\n", "nested deeper than"),
    "deep-block": ("".join("  " * i + f"k{i}:\n" for i in range(200)).encode(), "nested deeper than"),
    "deep-alias": (("a: &a " + "[" * 60 + "1" + "]" * 60 + "\n" + "b: &b " + "[" * 60 + "*a" + "]" * 60 + "\n"
                    ).encode(), "nested deeper than"),
    "not-utf8": (b"name: caf\xe9\n", "is not UTF-8"),
    "control-char": (b"name: a\x07b\n", "not allowed in YAML"),
    "huge": (b"name: x\n", "larger than 64 KiB"),  # grown to 100 MB (sparse) by the fixture
}


@pytest.fixture(params=sorted(HOSTILE))
def hostile(request, tmp_path):
    data, words = HOSTILE[request.param]
    path = tmp_path / f"{request.param}.yaml"
    path.write_bytes(data)
    if request.param == "huge":
        os.truncate(path, 100 << 20)
    return path, words


def test_refused_with_one_problem_in_bounded_memory(hostile):
    path, words = hostile
    tracemalloc.start()
    try:
        with pytest.raises(ContractError) as info:
            load_contract(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert info.value.unreadable and len(info.value.problems) == 1
    assert words in str(info.value) and str(path) in str(info.value)
    assert peak < 16 << 20, f"peak {peak / 2**20:.1f} MiB while refusing {path.name}"


# `muxd slo check PATH`, reporting its peak resident memory (VmHWM: this program's own, not what the forking parent
# held) on the last line of stderr
MEASURED = ("import atexit, re, sys; from pathlib import Path; "
            "atexit.register(lambda: sys.stderr.write('\\nVmHWM ' + re.search(r'VmHWM:\\s+(\\d+)', "
            "Path('/proc/self/status').read_text()).group(1) + '\\n')); "
            "sys.argv = ['muxd', 'slo', 'check', sys.argv[1]]; from appliance.cli.main import main; main()")


def test_slo_check_answers_in_one_line_with_exit_2(hostile):
    """The real command in a process of its own: one line on stderr, exit 2, under 200 MB resident at its peak
    (`muxd slo` loads neither torch nor the server)."""
    path, words = hostile
    result = subprocess.run([sys.executable, "-c", MEASURED, str(path)], cwd=ROOT, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "300"}, timeout=120)
    *lines, peak = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stdout + result.stderr
    assert len(lines) == 1 and lines[0].startswith(f"error: {path}") and words in lines[0], result.stderr
    assert result.stdout == ""
    assert int(peak.split()[1]) * 1024 < 200 << 20, f"peak resident memory {peak}"


def test_serve_refuses_a_hostile_contract_before_loading(hostile, text_checkpoint):
    path, words = hostile
    result = CliRunner().invoke(app, ["serve", "--model", str(text_checkpoint), "--slo", str(path)],
                                env={"COLUMNS": "300"})
    assert result.exit_code == 2 and words in result.output and "Traceback" not in result.output, result.output
