"""Closed-loop tail control: the planner's targets set from what clients see.

Every inter-token gap and first token the engine emits is measured against its request's class targets. A
`TailController` per class and metric keeps a window of those measurements (each a fraction of its target) and holds
the contract's percentile of them at a setpoint under the target: the planning target is `headroom x target`, and
the headroom falls fast (multiplicatively, in proportion to the overshoot) when the recent tail nears or crosses the
setpoint and rises slowly (additively) while there is slack. No margin is tuned per trace or GPU: whatever the
predictor misses (host time, contention, a profile from another machine, no profile at all) shows up in the tail
and moves the headroom.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

GAP_WINDOW = 4096    # inter-token gaps kept (at 10-20 req/s about a second of them)
TTFT_WINDOW = 256    # first tokens kept


@dataclass
class TailController:
    """Holds the `percentile` of recent measurements (as fractions of their targets) at `setpoint`."""

    percentile: float = 99.0
    window: int = GAP_WINDOW
    setpoint: float = 0.9          # hold the observed tail at this fraction of the target
    headroom: float = 0.85         # start a little inside the target: the first seconds are unobserved
    min_headroom: float = 0.3
    max_headroom: float = 1.0
    relax_step: float = 0.02       # additive increase once a whole window had slack
    slack: float = 0.85            # below setpoint x slack the tail has room: relax
    _ring: np.ndarray = field(default=None, repr=False)  # type: ignore[assignment]
    _count: int = 0
    _since: int = 0
    _fresh: int = 0                # measurements since the headroom last changed
    observed: float = float("nan")  # the windowed tail at the last update, as a fraction of the target
    updates: int = 0
    tightened: int = 0

    def __post_init__(self) -> None:
        self._ring = np.zeros(self.window)
        self.period = max(1, self.window // 16)   # measurements between two looks at the tail
        self.min_samples = max(8, self.window // 8)  # a percentile of fewer is noise

    def observe(self, ratios: list[float]) -> None:
        """Measurements as fractions of their targets (a gap of 60 ms against 50 is 1.2)."""
        n, w = len(ratios), self.window
        if n >= w:
            self._ring[:] = ratios[-w:]
        else:
            at = self._count % w
            head = min(n, w - at)
            self._ring[at:at + head] = ratios[:head]
            self._ring[:n - head] = ratios[head:]
        self._count += n
        self._since += n
        self._fresh += n
        if self._since >= self.period and self._count >= self.min_samples:
            self._since = 0
            self._update()

    def _update(self) -> None:
        window = self._ring if self._count >= self.window else self._ring[:self._count]
        tail = float(np.percentile(window, self.percentile))
        self.observed, self.updates = tail, self.updates + 1
        # tighten at once, in proportion to the overshoot, then again only once half the window came after it
        # (what it still holds from before the change would otherwise tighten it again and again)
        if tail > self.setpoint and self._fresh >= min(self._count, self.window) // 2:
            self.headroom = max(self.min_headroom, self.headroom * max(0.7, self.setpoint / tail))
            self.tightened += 1
            self._fresh = 0
        elif tail < self.setpoint * self.slack and self._fresh >= self.window:  # a whole window of slack: relax
            self.headroom = min(self.max_headroom, self.headroom + self.relax_step)
            self._fresh = 0

    def pressed(self) -> bool:
        """The recent tail is at or over the setpoint."""
        return self.observed == self.observed and self.observed >= self.setpoint

    def state(self) -> dict[str, float]:
        return {"headroom": round(self.headroom, 4), "observed_tail": round(self.observed, 4)
                if self.observed == self.observed else None, "samples": self._count, "updates": self.updates,
                "tightened": self.tightened}


@dataclass
class ClassControl:
    """The two controllers of one SLO class: inter-token gaps against the TBT target, first tokens against the TTFT
    target."""

    tbt: TailController
    ttft: TailController

    def observe(self, gaps: list[float], ttfts: list[float]) -> None:
        if gaps:
            self.tbt.observe(gaps)
        if ttfts:
            self.ttft.observe(ttfts)
        # first tokens running late while the gaps have room: let decode give prefill SMs back sooner
        if gaps and self.ttft.pressed() and self.tbt.observed == self.tbt.observed and \
                self.tbt.observed < self.tbt.setpoint * self.tbt.slack:
            self.tbt.headroom = min(self.tbt.max_headroom,
                                    self.tbt.headroom + self.tbt.relax_step * len(gaps) / self.tbt.window)


def class_control(tbt_percentile: float, ttft_percentile: float) -> ClassControl:
    """TBT starts a little inside its target; TTFT deadlines start as the contract states them."""
    return ClassControl(TailController(percentile=tbt_percentile),
                        TailController(percentile=ttft_percentile, window=TTFT_WINDOW, headroom=1.0, min_headroom=0.5))
