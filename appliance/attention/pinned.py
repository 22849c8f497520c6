"""Pinned host staging for small per-step arrays (batch layout, attention plans) on their way to the device.

A ring of pinned buffers is reused in turn; a buffer is rewritten only after the device copies that read it have run
(an event per buffer), so copies can be asynchronous without the host overwriting data still in flight.
"""
from __future__ import annotations

import numpy as np
import torch


class PinnedRing:
    def __init__(self, dtype: torch.dtype, pinned: bool, slots: int = 3) -> None:
        self.dtype, self.pinned = dtype, pinned
        self._np_dtype = torch.empty((), dtype=dtype).numpy().dtype
        self._bufs: list[torch.Tensor | None] = [None] * slots
        self._events: list[torch.cuda.Event | None] = [None] * slots
        self._slot = 0

    def stage(self, arrays: list[np.ndarray]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Copy arrays back to back into the next buffer: (the packed tensor, a view per array), on the host.
        Call `done()` once the device copies reading them are enqueued."""
        sizes = [len(a) for a in arrays]
        total = sum(sizes)
        if not self.pinned:
            packed = torch.from_numpy(np.concatenate(arrays).astype(self._np_dtype, copy=False)
                                      if arrays else np.zeros(0, self._np_dtype))
            return packed, list(packed.split(sizes))
        self._slot = (self._slot + 1) % len(self._bufs)
        event = self._events[self._slot]
        if event is not None:
            event.synchronize()
        buf = self._bufs[self._slot]
        if buf is None or buf.numel() < total:
            buf = self._bufs[self._slot] = torch.empty(max(2 * total, 4096), dtype=self.dtype, pin_memory=True)
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
            event = self._events[self._slot] or torch.cuda.Event()
            event.record()
            self._events[self._slot] = event
