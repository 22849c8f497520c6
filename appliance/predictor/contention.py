"""The contention guard: how much slower a decode step runs while a prefill occupies the rest of the GPU.

Samples are binned into cells (decode partition, prefill new and reused tokens, decode batch size and reused
tokens); a cell keeps the largest slowdown ever seen there, and the dispatcher plans with it as the worst case.
Measured steps refine it online: a slower observation raises its cell at once.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Sequence

from appliance.predictor.workload import DecodeLoad, PrefillItem

# upper edges of the bins; a value above the last edge falls in the last, open bin
BIN_EDGES: dict[str, tuple[int, ...]] = {
    "prefill_new": (512, 2048, 8192),
    "prefill_reused": (4096, 32768),
    "batch": (8, 32, 128),
    "decode_reused": (32768, 262144),
}

Cell = tuple[int, int, int, int, int]  # (decode SMs, prefill new bin, prefill reused bin, batch bin, decode reused bin)


def _bin(name: str, value: int) -> int:
    return bisect.bisect_left(BIN_EDGES[name], value)


def cell_of(decode_sms: int, items: Sequence[PrefillItem], load: DecodeLoad) -> Cell:
    return (decode_sms, _bin("prefill_new", sum(i.new for i in items)),
            _bin("prefill_reused", sum(i.reused for i in items)), _bin("batch", load.batch_size),
            _bin("decode_reused", load.reused_tokens))


@dataclass
class ContentionGuard:
    """Worst decode slowdown per cell. A cell never measured takes the worst one measured on the same decode
    partition, or `default` (the device's worst case) when the partition has none."""

    cells: dict[Cell, float] = field(default_factory=dict)
    default: float = 1.3

    def slowdown(self, decode_sms: int, items: Sequence[PrefillItem], load: DecodeLoad) -> float:
        if not items:
            return 1.0
        cell = cell_of(decode_sms, items, load)
        if cell in self.cells:
            return self.cells[cell]
        same = [v for c, v in self.cells.items() if c[0] == decode_sms]
        return max(same) if same else self.default

    def observe(self, decode_sms: int, items: Sequence[PrefillItem], load: DecodeLoad, solo_ms: float,
                measured_ms: float) -> float:
        """Record a measured decode step that ran beside `items`; returns the cell's slowdown afterwards."""
        cell = cell_of(decode_sms, items, load)
        ratio = max(1.0, measured_ms / solo_ms) if solo_ms > 0 else 1.0
        if ratio > self.cells.get(cell, 0.0):
            self.cells[cell] = ratio
        return self.cells[cell]
