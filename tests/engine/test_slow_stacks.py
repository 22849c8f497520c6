"""Stacks of slow launches (engine/slow_stacks.py): a launch that runs past the threshold comes back with where the
engine thread was, innermost frame first; one that ends in time comes back with none; the step log keeps them."""
from __future__ import annotations

import os
import time

import pytest

from appliance.engine.slow_stacks import SlowStacks, engine_stacks


def _busy_launch(stacks: SlowStacks) -> None:
    """Busy on the host until the watchdog has begun a third sample (the last may catch the caller after it
    returned: the watchdog reads the frames while the thread runs on), however loaded the machine (at most 10 s)."""
    end = time.perf_counter() + 10
    while _samples(stacks) < 3:
        if time.perf_counter() > end:
            break


def _samples(stacks: SlowStacks) -> int:
    size = os.fstat(stacks._fd).st_size - stacks._start
    return os.pread(stacks._fd, size, stacks._start).count(b"Timeout (") if size > 0 else 0


def test_a_slow_launch_is_sampled_where_it_spends_its_time():
    stacks = SlowStacks(after_ms=20)
    try:
        stacks.begin()
        _busy_launch(stacks)
        samples = stacks.end()
        assert 3 <= len(samples) <= 6
        assert all(any("_busy_launch" in frame for frame in s[:3]) for s in samples[:2])
        assert all("test_slow_stacks.py" in s[0] for s in samples[:2])  # innermost first, path kept short
        stacks.begin()  # a launch that ends in time: nothing, and no dump left armed
        assert stacks.end() == []
        written = os.fstat(stacks._fd).st_size
        time.sleep(0.06)
        assert os.fstat(stacks._fd).st_size == written
    finally:
        stacks.close()


def test_only_the_engine_threads_frames_are_kept():
    dump = ("Timeout (0:00:00.025000)!\n"
            "Thread 0x00000000000000aa (most recent call first):\n"
            '  File "/x/site-packages/torch/cuda/graphs.py", line 88 in replay\n'
            '  File "/x/appliance/engine/prefill_graphs.py", line 170 in run\n'
            "\n"
            "Thread 0x00000000000000bb (most recent call first):\n"
            '  File "/usr/lib/python3.12/threading.py", line 331 in wait\n')
    assert engine_stacks(dump, 0xaa) == [["torch/cuda/graphs.py:88 replay",
                                          "appliance/engine/prefill_graphs.py:170 run"]]
    assert engine_stacks(dump, 0xcc) == []


def test_the_threshold_must_be_positive():
    with pytest.raises(ValueError, match="stacks_after_ms"):
        SlowStacks(after_ms=0)
