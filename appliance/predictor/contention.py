"""The contention guard: how much slower a decode step runs while a prefill occupies the rest of the GPU.

Samples are binned into cells (decode partition, prefill new and reused tokens, decode batch size and reused
tokens); a cell keeps the largest slowdown ever seen there, and the dispatcher plans with it as the worst case.
Measured steps refine it online (`refine`): a cell takes the 95th percentile of its last 64 observed slowdowns once
it has 8, never less than the profile measured there, so one stray slow step (a host hiccup) does not tax every later
step, while a cell the profile underestimated rises within a few steps.
"""
from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

from appliance.predictor.shapes import DecodeLoad, PrefillItem

# upper edges of the bins; a value above the last edge falls in the last, open bin
BIN_EDGES: dict[str, tuple[int, ...]] = {
    "prefill_new": (512, 2048, 8192),
    "prefill_reused": (4096, 32768),
    "batch": (8, 32, 128),
    "decode_reused": (32768, 262144),
}

ONLINE_WINDOW, ONLINE_MIN, ONLINE_QUANTILE = 64, 8, 0.95

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
    _profiled: dict[Cell, float] = field(default_factory=dict, repr=False)
    _online: dict[Cell, deque] = field(default_factory=dict, repr=False)

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

    @property
    def observations(self) -> dict[Cell, list[float]]:
        """The slowdowns observed online per cell (the latest ONLINE_WINDOW of each)."""
        return {cell: list(window) for cell, window in self._online.items()}

    def refine(self, decode_sms: int, items: Sequence[PrefillItem], load: DecodeLoad, solo_ms: float,
               measured_ms: float) -> float:
        """Online refinement from a decode step measured while serving; returns the slowdown the cell plans with."""
        cell = cell_of(decode_sms, items, load)
        if cell not in self._online:
            self._profiled[cell] = self.cells.get(cell, 1.0)
            self._online[cell] = deque(maxlen=ONLINE_WINDOW)
        window = self._online[cell]
        window.append(max(1.0, measured_ms / solo_ms) if solo_ms > 0 else 1.0)
        if len(window) >= ONLINE_MIN:
            ranked = sorted(window)
            high = ranked[min(len(ranked) - 1, int(ONLINE_QUANTILE * len(ranked)))]
            self.cells[cell] = max(self._profiled[cell], high)
        return self.slowdown(decode_sms, items, load)
