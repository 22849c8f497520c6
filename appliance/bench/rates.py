"""Capacity from explicit request rates (`muxd bench sweep --rates`): the flag parsed (one list for every policy,
or one per policy), each rate measured once, and the capacity read off the points: the highest rate that passed,
and, where a failing rate above it brackets the crossing, the rate at which the condition it missed crosses its
target by linear interpolation between the two.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from appliance.bench.sweep import SweepPoint, SweepResult
from appliance.errors import ConfigError
from appliance.slo.contract import Contract

# what a sweep point is judged on: summary key -> True when higher is better
DIRECTIONS = {"slo_attainment": True, "contract_ttft_ok": True, "contract_tbt_ms": False}


@dataclass(frozen=True)
class RatePlan:
    """The rates of `--rates`: `default` for every policy not named, `per_policy` for those named."""

    default: tuple[float, ...] | None
    per_policy: dict[str, tuple[float, ...]]

    def for_policy(self, policy: str | None) -> tuple[float, ...]:
        rates = self.per_policy.get(policy or "", self.default)
        if rates is None:
            raise ConfigError(f"--rates gives no rates for policy {policy!r}: add {policy}=R1,R2,... or a list "
                              "without a name for every policy")
        return rates

    def check(self, policies: Sequence[str]) -> None:
        """Every named policy is swept, and every swept policy has rates."""
        unknown = sorted(set(self.per_policy) - set(policies))
        if unknown:
            raise ConfigError(f"--rates names {', '.join(unknown)}, which --policies does not sweep "
                              f"({', '.join(policies) or 'no --policies given'})")
        for policy in policies or [None]:
            self.for_policy(policy)


def parse_rates(text: str) -> RatePlan:
    """'1,2,4' (every policy) or 'mux=2,3,4 chunked=0.5,1' (groups separated by spaces or ';', spaces around ',' and
    '=' ignored; a group without a name applies to the policies not named). Rates are finite and > 0, each at most
    once per group; sorted."""
    groups = [g for g in re.split(r"[;\s]+", re.sub(r"\s*([,=])\s*", r"\1", text.strip())) if g]
    if not groups:
        raise ConfigError("--rates: expected request rates like 1,2,4 (or mux=2,4 chunked=0.5,1), got nothing")
    default, per_policy = None, {}
    for group in groups:
        name, sep, values = group.rpartition("=")
        if sep and not name:
            raise ConfigError(f"--rates: {group!r} has '=' but no policy name before it")
        rates = _rate_list(values, group)
        if not sep:
            if default is not None:
                raise ConfigError(f"--rates: more than one list without a policy name ({text!r})")
            default = rates
        elif name in per_policy:
            raise ConfigError(f"--rates: policy {name!r} is given twice")
        else:
            per_policy[name] = rates
    return RatePlan(default, per_policy)


def _rate_list(values: str, group: str) -> tuple[float, ...]:
    items = [v.strip() for v in values.split(",")]
    if not items or any(not v for v in items):
        raise ConfigError(f"--rates: {group!r} has an empty entry; expected comma-separated rates like 1,2,4")
    rates = []
    for v in items:
        try:
            rate = float(v)
        except ValueError:
            raise ConfigError(f"--rates: {v!r} in {group!r} is not a number (req/s)") from None
        if not rate > 0 or math.isinf(rate):
            raise ConfigError(f"--rates: every rate must be a finite number > 0 req/s, got {v!r} in {group!r}")
        if rate in rates:
            raise ConfigError(f"--rates: {v} is given twice in {group!r}")
        rates.append(rate)
    return tuple(sorted(rates))


@dataclass(frozen=True)
class Criterion:
    key: str                 # a summary key (DIRECTIONS)
    target: float

    def holds(self, value: float) -> bool:
        return value >= self.target if DIRECTIONS[self.key] else value <= self.target


def criteria(attainment: float, slo: Any) -> list[Criterion]:
    """What a point must keep: the attainment target, and with a YAML contract its own attainment and its TTFT and
    TBT percentile targets (the stricter attainment wins)."""

    if not isinstance(slo, Contract):
        return [Criterion("slo_attainment", attainment)]
    cls = slo.slo_for(None)
    return [Criterion("slo_attainment", max(attainment, slo.attainment)),
            Criterion("contract_ttft_ok", cls.ttft_percentile / 100), Criterion("contract_tbt_ms", cls.tbt_ms)]


@dataclass(frozen=True)
class Estimate:
    """The capacity read off measured points. `highest_pass`: the highest rate that passed (None: none did);
    `interpolated`: where the missed condition crosses its target between it and the lowest failing rate above
    (`between`, `on` names the condition); None when no failing rate lies above or no known condition explains it.
    `failed_below`: rates under the highest pass that failed (points near a knee are noisy)."""

    highest_pass: float | None
    interpolated: float | None = None
    between: tuple[float, float] | None = None
    on: str | None = None
    failed_below: tuple[float, ...] = ()

    @property
    def bracketed(self) -> bool:
        return self.between is not None

    @property
    def best(self) -> float | None:
        return self.interpolated if self.interpolated is not None else self.highest_pass

    @property
    def how(self) -> str:
        if self.highest_pass is None:
            return "no rate passed"
        if self.interpolated is not None:
            lo, hi = self.between
            how = f"interpolated on {self.on} between {lo:.3g} and {hi:.3g} req/s"
        elif self.between is None:
            how = "highest passing rate; a lower bound (no higher rate failed)"
        else:
            how = "highest passing rate"
        return how + (f"; a lower rate failed ({self.failed_note})" if self.failed_below else "")

    @property
    def failed_note(self) -> str:
        return ", ".join(f"{r:.3g}" for r in self.failed_below) + " req/s"


def estimate(points: Iterable[SweepPoint], conditions: Sequence[Criterion]) -> Estimate:
    """Capacity from points of one policy (any order): the highest passing rate and the interpolated crossing."""
    points = list(points)
    passing = [p for p in points if p.passed]
    if not passing:
        return Estimate(None)
    lo = max(passing, key=lambda p: p.rate)
    below = tuple(sorted(p.rate for p in points if not p.passed and p.rate < lo.rate))
    above = [p for p in points if not p.passed and p.rate > lo.rate]
    if not above:
        return Estimate(lo.rate, failed_below=below)
    hi = min(above, key=lambda p: p.rate)
    crossings = []
    for c in conditions:
        a, b = _value(lo.summary, c.key), _value(hi.summary, c.key)
        if a is None or b is None or not c.holds(a) or c.holds(b) or a == b:
            continue
        crossings.append((lo.rate + (a - c.target) / (a - b) * (hi.rate - lo.rate), c.key))
    if not crossings:
        return Estimate(lo.rate, between=(lo.rate, hi.rate), failed_below=below)
    rate, key = min(crossings)
    return Estimate(lo.rate, rate, (lo.rate, hi.rate), key, below)


def _value(summary: dict[str, Any], key: str) -> float | None:
    value = summary.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        return None
    return float(value)


def measure_rates(measure: Callable[[float], dict[str, Any]], rates: Sequence[float], target: float, label: str = "",
                  passes: Callable[[dict[str, Any]], bool] | None = None,
                  conditions: Sequence[Criterion] = ()) -> SweepResult:
    """measure(rate) at each rate in order; capacity = the highest passing rate, `estimate` adds the interpolation."""
    if not 0 < target <= 1:
        raise ConfigError(f"--attainment must be in (0, 1], got {target}")
    result = SweepResult(label, target, mode="rates")
    for rate in rates:
        summary = measure(rate)
        attainment = summary.get("slo_attainment")
        if attainment is None:
            raise ConfigError("a capacity sweep needs an SLO: pass --goodput (or --slo)")
        passed = attainment >= target and (passes is None or passes(summary))
        result.points.append(SweepPoint(rate, attainment, passed, summary))
    result.estimate = estimate(result.points, conditions or [Criterion("slo_attainment", target)])
    result.capacity, result.bracketed = result.estimate.highest_pass, result.estimate.bracketed
    return result
