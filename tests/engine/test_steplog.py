"""The step log (`appliance/engine/steplog.py`) and the diagnosis script built on it, on the CPU engine: every step
gets its planning and launch time and the host time since the previous launch; `muxd bench diagnose` replays a
trace slice and prints where the time went."""
from __future__ import annotations

import json
import os
import pstats
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

import appliance.engine.steplog as steplog
from appliance.cli.main import app
from appliance.config import Config
from appliance.engine.factory import build_engine
from appliance.engine.request import SamplingParams
from appliance.engine.steplog import StepLog

ROOT = Path(__file__).resolve().parents[2]


def test_every_step_is_logged_with_the_host_time_since_the_last_launch(llama_checkpoint):
    path, _ = llama_checkpoint
    engine = build_engine(Config.flat(model=path, num_gpu_blocks_override=64, policy="mux"))
    log = StepLog(engine).attach()
    for n in (12, 30, 7):
        engine.add_request(list(range(3, 3 + n)), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    log.detach()
    steps = log.steps
    assert len(steps) >= 4 and all(s["plan_ms"] >= 0 and s["launch_ms"] > 0 for s in steps)
    assert all(0 <= s["host_wait_ms"] <= s["host_launch_ms"] for s in steps)  # on a CPU nothing waits on an event
    assert all(s["host_cpu_ms"] >= 0 for s in steps) and sum(s["host_cpu_ms"] for s in steps) > 0
    assert not any("device_allocs" in s for s in steps)  # nor allocates device memory
    assert steps[0]["gap_ms"] is None and all(s["gap_ms"] >= 0 for s in steps[1:])
    assert sum(s["decode"] for s in steps) == 3 * 3  # each request's tokens after its first come from decode steps
    count = len(steps)
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=2, temperature=0.0))
    while engine.has_unfinished():
        engine.step()
    assert len(log.steps) == count  # detached: the engine runs unlogged


def test_the_diagnosis_script_replays_a_trace_slice_and_reports(llama_checkpoint, tmp_path):
    path, _ = llama_checkpoint
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "appliance", "bench", "diagnose", "--model", str(path), "--device", "cpu",
         "--trace", str(ROOT / "tests" / "data" / "azure_code_2023_head200.csv"), "-n", "6", "--rate", "20",
         "--policy", "mux", "--mixed-chunks", "--slo", str(ROOT / "configs" / "slo" / "chat-queue.yaml"),
         "--max-model-len", "256", "--host-profile", "--out", str(tmp_path)], capture_output=True, text=True,
        env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert "mux: 6 requests at 20.0 req/s" in out and "plan_ms" in out and "'mixed': {'flat'" in out
    assert "event loop (replay and streams)" in out and "us a streamed token" in out
    assert (tmp_path / "steps-mux.json").is_file() and (tmp_path / "requests-mux.json").is_file()
    # the engine thread's profile is printed, and its stats file holds the executor's step launches (mixed or
    # layer-by-layer prefill depends on timing, so which launch path shows is not asserted)
    assert "engine thread's host profile" in out
    profiled = pstats.Stats(str(tmp_path / "host-profile-mux.pstats")).stats
    assert any(file.endswith("executor.py") and name == "run" for file, _, name in profiled)


def test_the_planner_charges_the_host_as_the_engines_loop_runs(llama_checkpoint):
    """The overlapped loop hides the host behind the device; with --no-async-scheduling every gap carries it."""
    path, _ = llama_checkpoint
    overlapped = build_engine(Config.flat(model=path, num_gpu_blocks_override=64, policy="mux"))
    assert overlapped.scheduler.planner.predictor.host.overlapped
    sync = build_engine(Config.flat(model=path, num_gpu_blocks_override=64, policy="mux", async_scheduling=False))
    assert not sync.scheduler.planner.predictor.host.overlapped


def test_diagnose_replays_a_synthetic_workload(llama_checkpoint, tmp_path):
    """In process (the test above runs the command through `python -m appliance`): a synthetic workload's requests
    (two, of outputs of some hundreds of tokens) on a server of --serve-args' two seats, and the refusals."""
    path, _ = llama_checkpoint
    base = ["bench", "diagnose", "--model", str(path), "--device", "cpu", "--workload", "chat-short", "--out",
            str(tmp_path)]
    done = CliRunner().invoke(app, [*base, "-n", "2", "--rate", "50", "--policy", "serial", "--max-model-len", "4096",
                                    "--serve-args", "--max-num-seqs 2"])
    assert done.exit_code == 0, done.output[-2000:]
    assert "serial: 2 requests at 50.0 req/s" in done.stdout
    bad = CliRunner().invoke(app, [*base, "--serve-args", "--no-such-flag 1"])
    assert bad.exit_code == 2 and "--no-such-flag" in bad.stderr
    both = CliRunner().invoke(app, [*base, "--trace", "x.csv"])
    assert both.exit_code == 2 and "not both" in both.stderr
    sliced = CliRunner().invoke(app, [*base, "--skip", "5"])  # a trace's slice: no meaning for a synthetic draw
    assert sliced.exit_code == 2 and "--seed" in sliced.stderr
    first = json.loads((tmp_path / "requests-serial.json").read_text())
    other = CliRunner().invoke(app, [*base, "-n", "2", "--rate", "50", "--policy", "serial", "--max-model-len", "4096",
                                     "--serve-args", "--max-num-seqs 2", "--seed", "3"])
    assert other.exit_code == 0, other.output[-2000:]
    drawn = json.loads((tmp_path / "requests-serial.json").read_text())
    assert [r["prompt_tokens"] for r in drawn] != [r["prompt_tokens"] for r in first]


def test_the_host_gap_leaves_out_the_wait_for_the_devices_tokens(llama_checkpoint, monkeypatch):
    """Reading a step's tokens waits for the device (in either loop): that is not host time, and the host model
    fitted from these gaps (predictor/host.py) must not see it. A clock that moves only while tokens are read."""
    path, _ = llama_checkpoint
    clock = [0.0]
    monkeypatch.setattr(steplog.time, "perf_counter", lambda: clock[0])
    for overlap in (True, False):
        engine = build_engine(Config.flat(model=path, num_gpu_blocks_override=64, policy="mux",
                                          async_scheduling=overlap))
        read = engine.executor.collect

        def slow_read(step, read=read):
            clock[0] += 0.5  # the device's half second
            return read(step)

        engine.executor.collect = slow_read
        log = StepLog(engine).attach()
        for n in (12, 30):
            engine.add_request(list(range(3, 3 + n)), SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
        log.detach()
        gaps = [s["gap_ms"] for s in log.steps if s["gap_ms"] is not None]
        assert gaps and all(g == 0.0 for g in gaps), (overlap, gaps)


def test_a_prefill_launch_is_logged_with_the_decode_that_ran_beside_it():
    """Each prefill launch's row says which decode steps were planned while it ran (its launch to the host seeing it
    done): the load that competes with it for memory bandwidth, for fitting the split's slowdown against."""
    from types import SimpleNamespace

    from appliance.engine.launched import PrefillObservation
    from appliance.engine.plan import PrefillWork

    work = PrefillWork("r", 0, 256, 0, 32)
    obs = PrefillObservation(116, (work,), 12.5, True, launched_at=10.0, seen_at=10.05)
    executor = SimpleNamespace(prefills_seen=0, prefills_since=lambda mark: ([obs], mark + 1))
    log = StepLog(SimpleNamespace(executor=executor, scheduler=None))
    log.steps = [{"t": 9.99, "decode": 50, "ctx": 5000},   # before the launch
                 {"t": 10.01, "decode": 8, "ctx": 800},
                 {"t": 10.02, "decode": 0},                # a prefill-only step: no decode beside it
                 {"t": 10.03, "decode": 12, "ctx": 1600},
                 {"t": 10.06, "decode": 70, "ctx": 9000}]  # after the host saw it done
    log._collect_prefills()
    (row,) = log.prefills
    assert row["decode_beside"] == {"steps": 2, "batch": 10.0, "ctx": 1200.0}
    assert row["ms"] == 12.5 and row["items"] == [[256, 0]] and row["beside"]


def test_decode_steps_are_broken_down_by_batch_size():
    """`muxd bench diagnose`'s table of decode steps timed on the device: wall, device and the launch's host time
    per batch-size bin (big batches whose wall runs over their device time are host-bound)."""
    from appliance.profile.diagnose import decode_by_batch

    steps = [{"decode": b, "launch_ms": w, "device_ms": d, "host_launch_ms": h}
             for b, w, d, h in [(1, 5.0, 5.0, 0.8), (3, 6.0, 5.0, 1.0), (40, 11.0, 9.0, 2.0), (60, 13.0, 9.0, 2.2),
                                (150, 20.0, 19.0, 3.0)]]
    table = decode_by_batch(steps)
    assert list(table) == [(1, 7), (32, 127), (128, 150)]
    assert table[(1, 7)] == (2, 5.5, 5.0, 0.9)
    assert table[(32, 127)] == (2, 12.0, 9.0, 2.1)
    assert table[(128, 150)] == (1, 20.0, 19.0, 3.0)


def test_decode_steps_are_broken_down_by_the_step_after_them():
    """Before a step that launches prefill, a decode step's tokens wait for that launch (the overlapped loop reads
    them once it returns): the breakdown keeps those apart from decode steps followed by decode steps, and counts a
    temporal step's own prefill layers with its device time."""
    from appliance.profile.diagnose import decode_by_next

    def step(decode, wall, device, host, prefill=0, mixed=False, after=None):
        return {"decode": decode, "launch_ms": wall, "device_ms": device, "host_launch_ms": host,
                "prefill_tokens": prefill, "mixed": mixed, "after_ms": after}

    steps = [step(30, 8.0, 8.0, 2.0), step(30, 8.0, 8.0, 2.0), step(30, 30.0, 8.0, 2.0),
             step(30, 25.0, 8.0, 20.0, prefill=900, after=16.0), step(30, 8.0, 8.0, 2.0),
             step(30, 40.0, 35.0, 30.0, prefill=1000, mixed=True)]
    table = decode_by_next(steps)
    assert list(table) == ["a decode step", "a prefill launch"]
    n, wall, device, host = table["a decode step"]   # (the mixed step is no decode step)
    assert n == 3 and wall == pytest.approx(41.0 / 3) and device == pytest.approx(40.0 / 3) and host == 2.0
    assert table["a prefill launch"] == (2, 19.0, 8.0, 25.0)  # read once the next launch returned


def test_decode_steps_are_broken_down_by_the_step_before_them():
    """After a mixed or temporal step a decode step's wall holds the rest of that step's device time (the overlapped
    loop launched it while the longer step ran): the breakdown keeps those apart from decode steps after decode
    steps, whose wall against device time is the host's share."""
    from appliance.profile.diagnose import decode_by_previous

    def step(wall, device, prefill=0, mixed=False, after=None):
        return {"decode": 30, "launch_ms": wall, "device_ms": device, "prefill_tokens": prefill, "mixed": mixed,
                "after_ms": after}

    steps = [step(8.0, 8.0), step(8.2, 8.0), step(30.0, 35.0, prefill=900, mixed=True), step(13.0, 8.0),
             step(8.4, 8.0), step(24.0, 8.0, prefill=800, after=17.0), step(10.0, 8.0)]
    table = decode_by_previous(steps)
    assert list(table) == ["a decode step", "a prefill step"]
    n, wall, device = table["a decode step"]  # the first step has no step before it; the mixed one is no decode step
    assert n == 3 and wall == pytest.approx((8.2 + 8.4 + 24.0) / 3) and device == pytest.approx((8.0 + 8.0 + 25.0) / 3)
    assert table["a prefill step"] == (2, 11.5, 8.0)


def test_a_slow_launch_is_logged_with_where_the_engine_thread_was(llama_checkpoint):
    path, _ = llama_checkpoint
    engine = build_engine(Config.flat(model=path, num_gpu_blocks_override=64, policy="mux"))
    start = engine.executor.start

    def slow_start(*args, **kw):  # the first launch is held up on the host
        if not slow_start.done:
            slow_start.done = True
            end = time.perf_counter() + 10  # until sampled twice (at most 10 s on a loaded machine)
            while len(log._stacks._samples) < 2 and time.perf_counter() < end:
                pass
        return start(*args, **kw)

    slow_start.done = False
    engine.executor.start = slow_start
    log = StepLog(engine, stacks_after_ms=30).attach()
    engine.add_request(list(range(3, 20)), SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    log.detach()
    first, rest = log.steps[0], log.steps[1:]
    assert first["stacks"] and "slow_start" in first["stacks"][0][0]  # where the host was held up, innermost first
    assert all(any("timed_start" in frame for frame in s) for s in first["stacks"])  # all within that launch
    assert first["host_launch_ms"] >= 30 and first["host_cpu_ms"] > 0
    assert not any("stacks" in s for s in rest if s["host_launch_ms"] < 30)
