"""The staging ring (attention/pinned.py): a buffer is rewritten only after the copy that read it ran, and while that
copy waits behind queued work, the ring takes a new buffer rather than make the host wait, up to its cap."""
from __future__ import annotations

from appliance.attention.pinned import HOST_WAITS, Ring


class Copy:
    """A device copy's event: `ran` once the stream reached it; `synchronize` is the host waiting for that."""

    def __init__(self) -> None:
        self.ran, self.waited = False, 0

    def record(self) -> None:
        self.ran = False

    def query(self) -> bool:
        return self.ran

    def synchronize(self) -> None:
        self.waited += 1
        self.ran = True


def stage(ring: Ring) -> int:
    slot = ring.acquire()
    if ring.items[slot] is None:
        ring.items[slot] = object()  # the new buffer
    ring.release()
    return slot


def test_a_copy_that_ran_frees_its_buffer_and_one_still_queued_gets_a_new_one():
    events: list[Copy] = []
    ring = Ring([object(), object()], max_items=4, new_event=lambda: events.append(Copy()) or events[-1])
    first, second = stage(ring), stage(ring)
    assert (first, second) == (0, 1)
    events[0].ran = True  # the device read the first buffer: it is written again, nothing new
    assert stage(ring) == 0 and len(ring.items) == 2
    # the second buffer's copy is still queued (a deep prefill stream): a new buffer, no wait
    second_buffer = ring.items[1]
    assert stage(ring) == 1 and len(ring.items) == 3 and ring.items[2] is second_buffer
    assert all(e.waited == 0 for e in events)
    # every buffer's copy still queued: the ring grows to its cap, then the host waits for the oldest
    for _ in range(3):
        stage(ring)
    assert len(ring.items) == 4 and sum(e.waited for e in events) >= 1
    seen = set()
    for _ in range(8):  # in turn: each buffer is rewritten only once its copy ran
        for e in events:
            e.ran = True
        seen.add(stage(ring))
    assert seen == {0, 1, 2, 3} and len(ring.items) == 4


def test_without_growth_the_host_waits_for_the_copy():
    events: list[Copy] = []
    ring = Ring([object(), object()], max_items=8, new_event=lambda: events.append(Copy()) or events[-1])
    stage(ring), stage(ring)
    waits = HOST_WAITS.count
    slot = ring.acquire(grow=False)  # a buffer this ring does not own the writes to: its guard is the wait
    assert slot == 0 and events[0].waited == 1 and len(ring.items) == 2
    assert HOST_WAITS.count == waits + 1  # counted as host time blocked on the device (the step log reports it)
