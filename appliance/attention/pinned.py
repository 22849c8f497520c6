"""Pinned host staging for small per-step arrays (batch layout, attention plans) on their way to the device.

A ring of pinned buffers is reused in turn; a buffer is rewritten only after the device copies that read it have run
(an event per buffer), so copies can be asynchronous without the host overwriting data still in flight. When the
next buffer's copy has not run yet (queued behind work on a busy stream: prefill layers queued for several decode
steps), a new buffer joins the ring instead of the host waiting for that stream, up to a cap; a wait there would
hold back the launch of the next decode step and show in its clients' time between tokens.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np
import torch


class HostWaits:
    """Host time spent blocked on a device event by a full staging ring (or another buffer's guard): the step log
    reports it per launch, so that a slow launch shows whether it waited for the device or worked."""

    def __init__(self) -> None:
        self.seconds, self.count = 0.0, 0

    def wait(self, event: Any) -> None:
        start = time.perf_counter()
        event.synchronize()
        self.seconds += time.perf_counter() - start
        self.count += 1


HOST_WAITS = HostWaits()  # the process's (one engine's) waits


class Ring:
    """The turn of `items` (buffers, or None where a new one is still to be made) and each one's copy event."""

    def __init__(self, items: list[Any], max_items: int, new_event: Callable[[], Any] | None = None) -> None:
        self.items, self.max_items = items, max(max_items, len(items))
        self.events: list[Any] = [None] * len(items)
        self._new_event = new_event or torch.cuda.Event
        self.index = len(items) - 1

    def acquire(self, grow: bool = True) -> int:
        """The index of the buffer to write next: the next in turn once its copy has run; while that copy is still
        queued, a new slot (item None) in its place, or, with the ring at its cap (or `grow` false), the next after
        waiting."""
        nxt = (self.index + 1) % len(self.items)
        event = self.events[nxt]
        if event is not None and not event.query():
            if grow and len(self.items) < self.max_items:
                self.items.insert(nxt, None)
                self.events.insert(nxt, None)
            else:
                HOST_WAITS.wait(event)
        self.index = nxt
        return nxt

    def release(self) -> None:
        """The copies reading the current buffer are queued on the current stream: guard it until they ran."""
        event = self.events[self.index] or self._new_event()
        event.record()
        self.events[self.index] = event


class PinnedRing:
    def __init__(self, dtype: torch.dtype, pinned: bool, slots: int = 3, max_slots: int = 16) -> None:
        self.dtype, self.pinned = dtype, pinned
        self._np_dtype = torch.empty((), dtype=dtype).numpy().dtype
        self.ring = Ring([None] * slots, max_slots)

    def stage(self, arrays: list[np.ndarray]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Copy arrays back to back into the next buffer: (the packed tensor, a view per array), on the host.
        Call `done()` once the device copies reading them are enqueued."""
        sizes = [len(a) for a in arrays]
        total = sum(sizes)
        if not self.pinned:
            packed = torch.from_numpy(np.concatenate(arrays).astype(self._np_dtype, copy=False)
                                      if arrays else np.zeros(0, self._np_dtype))
            return packed, list(packed.split(sizes))
        slot = self.ring.acquire()
        buf = self.ring.items[slot]
        if buf is None or buf.numel() < total:
            buf = self.ring.items[slot] = torch.empty(max(2 * total, 4096), dtype=self.dtype, pin_memory=True)
        host = buf.numpy()
        offset = 0
        for a, n in zip(arrays, sizes):
            host[offset:offset + n] = a
            offset += n
        packed = buf[:total]
        return packed, list(packed.split(sizes))

    def done(self) -> None:
        """The copies from the buffer last staged are enqueued on the current stream: guard it until they ran."""
        if self.pinned:
            self.ring.release()
