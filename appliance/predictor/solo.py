"""The solo-run model of MuxWise, fitted by least squares per partition (SM count):
prefill = a*sum(n^2) + b*sum(n*r) + c*sum(n) + d, decode = e*sum(r) + f*bs + g (n new, r reused tokens).

The fit minimises relative error (latencies span three orders of magnitude) and keeps coefficients non-negative.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from appliance.errors import ConfigError
from appliance.predictor.workload import DecodeLoad, PrefillItem, Sample, prefill_features

PREFILL_TERMS = ("sum_n2", "sum_nr", "sum_n", "const")
DECODE_TERMS = ("sum_r", "batch", "const")


@dataclass(frozen=True)
class SoloModel:
    """Coefficients per SM count. An SM count between profiled ones uses the next smaller profiled partition
    (never optimistic); below the smallest, that one's latency scaled by the SM ratio."""

    prefill: dict[int, tuple[float, ...]]
    decode: dict[int, tuple[float, ...]]
    _keys: dict[str, list[int]] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.prefill or not self.decode:
            raise ConfigError("a solo model needs coefficients for prefill and for decode on at least one partition")
        self._keys["prefill"] = sorted(self.prefill)
        self._keys["decode"] = sorted(self.decode)

    def _coefficients(self, kind: str, sms: int) -> tuple[tuple[float, ...], float]:
        keys = self._keys[kind]
        table = self.prefill if kind == "prefill" else self.decode
        i = bisect.bisect_right(keys, sms) - 1
        if i < 0:
            return table[keys[0]], keys[0] / max(sms, 1)
        return table[keys[i]], 1.0

    def prefill_ms(self, items: Sequence[PrefillItem], sms: int) -> float:
        if not items:
            return 0.0
        (a, b, c, d), scale = self._coefficients("prefill", sms)
        n2, nr, n = prefill_features(items)
        return scale * (a * n2 + b * nr + c * n + d)

    def decode_ms(self, load: DecodeLoad, sms: int) -> float:
        if load.empty:
            return 0.0
        (e, f, g), scale = self._coefficients("decode", sms)
        return scale * (e * load.reused_tokens + f * load.batch_size + g)

    def mixed_ms(self, items: Sequence[PrefillItem], load: DecodeLoad, sms: int) -> float:
        """Decode rows ride in the prefill's token batch: they cost the per-token term c, plus decode attention
        (e per reused token); the fixed cost (the weights' read) is paid once."""
        if not items:
            return self.decode_ms(load, sms)
        (a, b, c, d), scale = self._coefficients("prefill", sms)
        (e, _, g), dscale = self._coefficients("decode", sms)
        n2, nr, n = prefill_features(items)
        return scale * (a * n2 + b * nr + c * (n + load.batch_size) + max(d, g)) + dscale * e * load.reused_tokens

    @property
    def partitions(self) -> list[int]:
        return sorted(set(self.prefill) | set(self.decode))


@dataclass(frozen=True)
class FitError:
    """Relative errors of a fitted model on samples, per phase: max and mean of |pred - meas| / meas."""

    prefill_max: float
    prefill_mean: float
    decode_max: float
    decode_mean: float


def features(sample: Sample) -> list[float]:
    if sample.kind == "prefill":
        return [*prefill_features(sample.prefill), 1.0]
    return [float(sample.decode.reused_tokens), float(sample.decode.batch_size), 1.0]


def fit_solo(samples: Sequence[Sample]) -> SoloModel:
    """Least-squares fit per (phase, SM count) of solo samples; each partition needs at least as many distinct
    samples as terms."""
    tables: dict[str, dict[int, tuple[float, ...]]] = {"prefill": {}, "decode": {}}
    groups: dict[tuple[str, int], list[Sample]] = {}
    for s in samples:
        if s.kind in tables:
            groups.setdefault((s.kind, s.sms), []).append(s)
    for (kind, sms), group in sorted(groups.items()):
        terms = PREFILL_TERMS if kind == "prefill" else DECODE_TERMS
        if len(group) < len(terms):
            raise ConfigError(f"{kind} on {sms} SMs has {len(group)} samples; the fit of {', '.join(terms)} needs "
                              f"at least {len(terms)}")
        x = np.array([features(s) for s in group])
        y = np.array([s.ms for s in group])
        tables[kind][sms] = tuple(float(v) for v in _nonnegative_relative_lstsq(x, y))
    return SoloModel(tables["prefill"], tables["decode"])


def fit_error(model: SoloModel, samples: Sequence[Sample]) -> FitError:
    """How well `model` predicts solo samples (use held-out ones for an honest figure)."""
    errs: dict[str, list[float]] = {"prefill": [], "decode": []}
    for s in samples:
        if s.kind == "prefill":
            errs["prefill"].append(abs(model.prefill_ms(s.prefill, s.sms) - s.ms) / s.ms)
        elif s.kind == "decode":
            errs["decode"].append(abs(model.decode_ms(s.decode, s.sms) - s.ms) / s.ms)
    p, d = errs["prefill"] or [0.0], errs["decode"] or [0.0]
    return FitError(max(p), float(np.mean(p)), max(d), float(np.mean(d)))


def _nonnegative_relative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """argmin_beta sum(((x beta - y) / y)^2) subject to beta >= 0: drop the most negative term and refit until none
    is negative (a small active-set loop; the models have at most four terms)."""
    w = 1.0 / y
    active = list(range(x.shape[1]))
    beta = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active] * w[:, None], np.ones_like(y), rcond=None)
        if (sol >= 0).all():
            beta[:] = 0.0
            beta[active] = sol
            return beta
        active.pop(int(np.argmin(sol)))
    return beta
