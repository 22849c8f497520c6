"""`muxd bench engine --kernels`: the decode step's kernels by name from the profiler's events (the GPU run itself
is in tests/gpu/run_all.sh); the aggregation, the table and the flag's errors, on the CPU."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

from appliance.bench.engine_bench import EngineBenchResult, Kernels, device_events, kernel_rows, render
from appliance.cli.main import app


def test_kernels_are_summed_by_name_per_step_heaviest_first():
    events = [("gemm", 0.3), ("norm", 0.01), ("gemm", 0.3), ("attn", 0.05), ("norm", 0.01), ("rope", 0.02)] * 4
    rows = kernel_rows(events, steps=4, top=2)
    assert [r.name for r in rows] == ["gemm", "attn", "(2 other kernels)"]
    assert (rows[0].launches, rows[0].ms) == (2, pytest.approx(0.6))
    assert (rows[2].launches, rows[2].ms) == (3, pytest.approx(0.04))  # norm twice and rope once a step


def test_device_events_are_the_profilers_device_side_ones():
    def event(name, device, us):
        return SimpleNamespace(name=name, device_type=device,
                               time_range=SimpleNamespace(elapsed_us=lambda: us))

    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    events = [event("cudaGraphLaunch", cpu, 40.0), event("gemm", cuda, 300.0), event("Memcpy HtoD", cuda, 2.0)]
    assert device_events(events) == [("gemm", 0.3), ("Memcpy HtoD", 0.002)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:  # the real event type
        torch.ones(8) @ torch.ones(8)
    assert prof.events() and device_events(prof.events()) == []


def test_the_table_shows_the_gaps_between_kernels():
    result = EngineBenchResult({"device": "GPU", "copy_TBps": 3.0, "gemm_TFLOPps": 700.0}, "m", {})
    result.kernels.append(Kernels("decode b=1 ctx=1024", 6.5, kernel_rows([("gemm", 5.0), ("attn", 0.5)], 1)))
    table = render(result)
    assert "kernels of decode b=1 ctx=1024: 2 a step, 5.50 ms of them in a 6.50 ms replay (between them: 1.00 ms)" \
        in table
    assert "| `gemm` | 1 | 5.000 | 76.9 % |" in table
    assert result.to_json()["kernels"][0]["kernel_ms"] == pytest.approx(5.5)


@pytest.mark.parametrize("value, message", [("64", "BATCH@CONTEXT"), ("0@1024", "positive"), ("a@b", "BATCH@CONTEXT")])
def test_a_bad_kernels_flag_is_named_before_anything_starts(value, message):
    result = CliRunner().invoke(app, ["bench", "engine", "--kernels", value])
    assert result.exit_code == 2 and message in result.output
