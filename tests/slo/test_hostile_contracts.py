"""Hostile SLO contracts (alias bombs, recursion, deep nesting, huge files, bytes that are not UTF-8) are refused
with one line naming the file and line, in bounded memory, by `muxd slo check` (exit 2) and by `muxd serve --slo`."""
from __future__ import annotations

import sys
import tracemalloc
from pathlib import Path

import pytest
from typer.testing import CliRunner

from appliance.cli.main import app
from appliance.errors import ContractError
from appliance.slo.contract import load_contract

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from hostile_contracts import HOSTILE, check, write  # noqa: E402


@pytest.fixture(params=sorted(HOSTILE))
def hostile(request, tmp_path):
    return write(request.param, tmp_path), HOSTILE[request.param][1]


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


def test_slo_check_answers_in_one_line_with_exit_2(hostile):
    """The real command in a process of its own: one line on stderr, exit 2, under 200 MB resident at its peak
    (`muxd slo` loads neither torch nor the server)."""
    path, words = hostile
    result = check(path)
    assert result["exit_code"] == 2, result
    lines = result["stderr_lines"]
    assert len(lines) == 1 and lines[0].startswith(f"error: {path}") and words in lines[0], result
    assert result["stdout"] == ""
    assert result["peak_rss_mib"] < 200, result


def test_serve_refuses_a_hostile_contract_before_loading(hostile, text_checkpoint):
    path, words = hostile
    result = CliRunner().invoke(app, ["serve", "--model", str(text_checkpoint), "--slo", str(path)],
                                env={"COLUMNS": "300"})
    assert result.exit_code == 2 and words in result.output and "Traceback" not in result.output, result.output
