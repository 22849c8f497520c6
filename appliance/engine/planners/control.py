"""Closed-loop tail control: the planner's targets set from what clients see.

Every inter-token gap and first token the engine emits is measured against its request's class target. A
`TailController` per class and metric holds the contract's percentile of those measurements at a setpoint under the
target by moving a headroom, the factor the planner multiplies the target by: it tracks the quantile the way a
Robbins-Monro estimator does, one small step per measurement. A measurement over the setpoint lowers the headroom by
`rate x (1 - q)`, one under it raises the headroom by `rate x q` (q = 1 - percentile / 100), so the headroom settles
where a fraction q of the measurements exceed the setpoint. It falls fast when the tail crosses (a slow decode step
of 100 rows is 100 such measurements) and rises slowly with slack; gaps the planner cannot shorten (a stall now and
then) pull it down only as far as they exceed the allowed fraction. The headroom may pass 1: a predictor that
overestimates the GPU plans to a higher figure that lands inside the target. Nothing is tuned per trace or GPU:
whatever the predictor misses (host time, contention, a profile from another machine, no profile at all) shows up in
the tail and moves the headroom.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

SHOWN = 2048  # recent measurements kept for the observed tail that /metrics and result JSONs show


@dataclass
class TailController:
    """Holds the `percentile` of measurements (as fractions of their targets) at `setpoint`."""

    percentile: float = 99.0
    setpoint: float = 0.9      # hold the tail at this fraction of the target
    rate: float = 5e-4         # log-headroom step per measurement (times 1 - q down, q up)
    headroom: float = 0.85     # start a little inside the target: the first seconds are unobserved
    min_headroom: float = 0.3
    max_headroom: float = 2.0
    samples: int = 0
    exceeded: int = 0
    _recent: np.ndarray = field(default_factory=lambda: np.zeros(SHOWN), repr=False)

    @property
    def q(self) -> float:
        return 1.0 - self.percentile / 100.0

    def observe(self, ratios: list[float]) -> None:
        """Measurements as fractions of their targets (a gap of 60 ms against 50 is 1.2)."""
        values = np.asarray(ratios, dtype=float)
        n = len(values)
        if not n:
            return
        over = int((values > self.setpoint).sum())
        step = self.rate * (self.q * (n - over) - (1.0 - self.q) * over)
        self.headroom = min(self.max_headroom, max(self.min_headroom, self.headroom * math.exp(step)))
        tail = values[-SHOWN:]
        self._recent[(self.samples + np.arange(len(tail))) % SHOWN] = tail
        self.samples += n
        self.exceeded += over

    @property
    def observed(self) -> float:
        """The percentile of the recent measurements (NaN before any)."""
        if not self.samples:
            return float("nan")
        return float(np.percentile(self._recent[:min(self.samples, SHOWN)], self.percentile))

    def state(self) -> dict[str, float | int | None]:
        observed = self.observed
        return {"headroom": round(self.headroom, 4),
                "observed_tail": None if observed != observed else round(observed, 4),
                "samples": self.samples, "over_setpoint": self.exceeded}


@dataclass
class ClassControl:
    """The two controllers of one SLO class: inter-token gaps against the TBT target, first tokens against the TTFT
    target (whose headroom moves the deadlines the planner orders prompts by)."""

    tbt: TailController
    ttft: TailController

    def observe(self, gaps: list[float], ttfts: list[float]) -> None:
        if ttfts:
            self.ttft.observe(ttfts)
        if gaps:  # held at its setpoint whatever first tokens do: giving prefill ground when they run late would
            # hold a lower percentile than the contract's, and past capacity TBT would miss as well as TTFT
            self.tbt.observe(gaps)


def class_control(tbt_percentile: float, ttft_percentile: float) -> ClassControl:
    """TBT planned a little inside its target at first; TTFT deadlines as the contract states them, moved earlier
    (never later) when first tokens run late."""
    return ClassControl(TailController(percentile=tbt_percentile),
                        TailController(percentile=ttft_percentile, rate=0.05, headroom=1.0, min_headroom=0.5,
                                       max_headroom=1.0))
