"""Prefill on a partition beside decode: how much slower it runs than the profile's solo figure for those SMs.

Decode on the other SMs competes for memory bandwidth, the more so the longer the context the prefill attends to
(measured on an H200 while serving Mooncake: 1.10x at 4-8k tokens of span, 1.36x at 24-40k). The slowdown is
modelled as `flat + per_1k * span`, span being the batch's longest attention span (new + reused tokens of a chunk)
in thousands of tokens. `fit` estimates it by least squares from (solo, span, measured) triples; `SplitSlowdown` is
what the predictor applies, starting from the profile's calibration and refined online from the prefill launches
the executor measures. The predictor keeps two more, learned the same way from the steps measured: one for mixed
steps (a prompt chunk beside the decode rows on all SMs), how much longer they run while serving than the profile's
mixed-step fit; one for prefill layers on all SMs after a decode step (temporal steps), whose factor may also fall
below 1 (the profile measured them on a cold GPU with more launch gaps than a serving step has).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from appliance.predictor.shapes import PrefillItem

FACTOR_RANGE = (0.5, 5.0)  # a slowdown (flat part) a profile or an online fit may hold
SLOPE_RANGE = (0.0, 0.1)   # its growth per 1,000 tokens of span
MIN_OBSERVATIONS = 20      # fewer measured launches give no fit
ONLINE_WINDOW = 256        # the online fit uses the latest launches only
REFIT_EVERY = 32           # launches between two online fits


def span_k(items: Sequence[PrefillItem]) -> float:
    """The longest attention span of a prefill batch, in thousands of tokens."""
    return max((i.new + i.reused for i in items), default=0) / 1000


def fit(solo: Sequence[float], span: Sequence[float], measured: Sequence[float]) -> tuple[float, float] | None:
    """(flat, per_1k) with measured ~ solo * (flat + per_1k * span), by least squares; one flat ratio when the slope
    comes out of SLOPE_RANGE; None with fewer than MIN_OBSERVATIONS or a flat part out of FACTOR_RANGE."""
    if len(solo) < MIN_OBSERVATIONS:
        return None
    x, k, y = np.asarray(solo, dtype=float), np.asarray(span, dtype=float), np.asarray(measured, dtype=float)
    (flat, slope), *_ = np.linalg.lstsq(np.stack([x, x * k], axis=1), y, rcond=None)
    if not (SLOPE_RANGE[0] <= slope <= SLOPE_RANGE[1] and FACTOR_RANGE[0] <= flat <= FACTOR_RANGE[1]):
        flat, slope = y.sum() / x.sum(), 0.0
    if not FACTOR_RANGE[0] <= flat <= FACTOR_RANGE[1]:
        return None
    return float(flat), float(slope)


@dataclass
class SplitSlowdown:
    flat: float = 1.0
    per_1k: float = 0.0
    floor: float = 1.0  # the least factor applied (1: what runs beside the work never speeds it up)
    window: deque = field(default_factory=lambda: deque(maxlen=ONLINE_WINDOW), repr=False)
    _since_fit: int = field(default=0, repr=False)

    def factor(self, items: Sequence[PrefillItem]) -> float:
        """Never below `floor`; beside decode that is 1: decode beside a prefill does not speed it up (a launch
        measured faster than its solo figure is the fit's host floor, which launches queued back to back hide)."""
        return max(self.floor, self.flat + self.per_1k * span_k(items))

    def observe(self, solo_ms: float, items: Sequence[PrefillItem], measured_ms: float) -> None:
        """A measured launch (its solo prediction and GPU time); every REFIT_EVERY launches the latest window is
        fitted again and replaces the slowdown."""
        if solo_ms <= 0 or not FACTOR_RANGE[0] <= measured_ms / solo_ms <= FACTOR_RANGE[1]:
            return  # (a stall, e.g. a first launch compiling its kernels, says nothing about the slowdown)
        self.window.append((solo_ms, span_k(items), measured_ms))
        self._since_fit += 1
        if self._since_fit >= REFIT_EVERY:
            self._since_fit = 0
            fitted = fit(*zip(*self.window))
            if fitted is not None:
                self.flat, self.per_1k = fitted


def all_sms(flat: float = 1.0) -> SplitSlowdown:
    """The factor of prefill layers on all SMs after a decode step while serving, starting at `flat`: nothing runs
    beside them, so it may fall below 1 (down to the least factor a fit may hold)."""
    return SplitSlowdown(flat, floor=FACTOR_RANGE[0])
