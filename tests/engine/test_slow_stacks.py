"""Stacks of slow launches (engine/slow_stacks.py): a launch that runs past the threshold comes back with where the
engine thread was, innermost frame first; one that ends in time comes back with none; the step log keeps them."""
from __future__ import annotations

import sys
import time

import pytest

from appliance.engine.slow_stacks import SlowStacks, frames


def _busy_launch(stacks: SlowStacks, samples: int) -> None:
    """Busy on the host until the sampler has taken `samples` samples (however loaded the machine, at most 10 s)."""
    end = time.perf_counter() + 10
    while len(stacks._samples) < samples and time.perf_counter() < end:
        pass


def test_a_slow_launch_is_sampled_where_it_spends_its_time():
    stacks = SlowStacks(after_ms=20)
    try:
        stacks.begin()
        _busy_launch(stacks, 3)
        samples = stacks.end()
        assert 3 <= len(samples) <= 6
        assert all(s[0].startswith("engine/test_slow_stacks.py:") and s[0].endswith("_busy_launch") for s in samples)
        stacks.begin()  # a launch that ends in time: nothing
        assert stacks.end() == []
        time.sleep(0.08)  # and nothing is sampled between launches
        assert stacks._samples == []
    finally:
        stacks.close()
    assert not stacks._sampler.is_alive()


def test_a_stack_keeps_its_innermost_frames_then_muxds_own():
    def deep(n: int):
        return deep(n - 1) if n else frames(sys._getframe())

    stack = deep(20)
    assert len(stack) == 6 and all(f.endswith(" deep") for f in stack)  # no muxd frame further out: leaves only
    assert stack[0].startswith("engine/test_slow_stacks.py:")


def test_the_threshold_must_be_positive():
    with pytest.raises(ValueError, match="stacks_after_ms"):
        SlowStacks(after_ms=0)
