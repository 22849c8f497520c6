"""Capacity search: the highest request rate whose SLO attainment meets the target, found by bracketing (doubling or
halving the rate) then bisection, each point a full replay (explicit rates instead: `rates.py`); every point goes to
`summary.csv` (as `vllm bench sweep` writes it), each point's result JSON to `points/` (with per-request arrays under
--save-detailed) and the result to `sweep.json`.
"""
from __future__ import annotations

import csv
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from appliance.errors import ConfigError


def slug(label: str) -> str:
    """A label as a file-name part."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", label).strip("_") or "target"

if TYPE_CHECKING:
    from appliance.bench.rates import Criterion, Estimate

SUMMARY_COLUMNS = ("request_rate", "passed", "slo_attainment", "request_goodput", "request_throughput",
                   "output_throughput", "completed", "failed", "duration")


@dataclass
class SweepPoint:
    rate: float
    attainment: float
    passed: bool
    summary: dict[str, Any]


@dataclass
class SweepResult:
    """Points in the order they ran; capacity = the highest passing rate (None when even the lowest failed)."""

    label: str
    target: float
    points: list[SweepPoint] = field(default_factory=list)
    capacity: float | None = None
    bracketed: bool = False  # a failing rate above the capacity was seen (else capacity is only a lower bound)
    mode: str = "bisection"  # or "rates": the points are the rates asked for
    estimate: Estimate | None = None  # rates: the interpolated capacity too


def find_capacity(measure: Callable[[float], dict[str, Any]], target: float, start_rate: float,
                  tolerance: float = 0.05, max_points: int = 12, min_rate: float = 0.01,
                  max_rate: float = math.inf, label: str = "",
                  passes: Callable[[dict[str, Any]], bool] | None = None) -> SweepResult:
    """measure(rate) runs one replay at `rate` requests/s and returns its summary (with `slo_attainment`).

    Bracketing: double the rate while it passes, halve it while it fails, until one passing and one failing rate
    are known (or min_rate/max_rate is reached); then bisect until (fail - pass) / pass <= tolerance. Attainment is
    assumed to fall as the rate rises; each point is one measurement, so noise near the capacity can move it by
    about the tolerance. `passes(summary)`, when given, adds a condition a rate must also meet (e.g. an SLO
    contract's percentile targets).
    """
    if not 0 < target <= 1:
        raise ConfigError(f"--attainment must be in (0, 1], got {target}")
    if not start_rate > 0 or math.isinf(start_rate):
        raise ConfigError(f"--start-rate must be a finite number > 0, got {start_rate}")
    if not 0 < tolerance < 1:
        raise ConfigError(f"--tolerance must be in (0, 1), got {tolerance}")
    if max_points < 2:
        raise ConfigError(f"--max-points must be >= 2, got {max_points}")
    result = SweepResult(label, target)

    def run(rate: float) -> bool:
        summary = measure(rate)
        attainment = summary.get("slo_attainment")
        if attainment is None:
            raise ConfigError("a capacity sweep needs an SLO: pass --goodput (or --slo)")
        point = SweepPoint(rate, attainment, attainment >= target and (passes is None or passes(summary)), summary)
        result.points.append(point)
        return point.passed

    lo, hi = None, None
    rate = min(max(start_rate, min_rate), max_rate)
    while len(result.points) < max_points:
        if run(rate):
            lo = rate
            if hi is not None or rate >= max_rate:
                break
            rate = min(rate * 2, max_rate)
        else:
            hi = rate
            if lo is not None or rate <= min_rate:
                break
            rate = max(rate / 2, min_rate)
    while lo is not None and hi is not None and (hi - lo) / lo > tolerance and len(result.points) < max_points:
        mid = (lo + hi) / 2
        if run(mid):
            lo = mid
        else:
            hi = mid
    result.capacity, result.bracketed = lo, hi is not None
    return result


def write_summary(results: list[SweepResult], out_dir: Path, conditions: Sequence[Criterion] = (),
                  trace: str | None = None) -> tuple[Path, Path]:
    """summary.csv (one row per point, every policy; `target_<key>` columns say what a point had to keep, so the
    file can be judged again on its own), points/<policy>-<rate>.json (each point's whole result, as `muxd bench
    serve` writes it) and sweep.json (capacities and points)."""

    (out_dir / "points").mkdir(parents=True, exist_ok=True)
    rows = []
    targets = {f"target_{c.key}": c.target for c in conditions}
    for res in results:
        for p in res.points:
            (out_dir / "points" / f"{slug(res.label)}-{p.rate:g}.json").write_text(json.dumps(p.summary, indent=2))
            row: dict[str, Any] = {"policy": res.label, "request_rate": p.rate, "passed": p.passed, **targets}
            row.update({k: v for k, v in p.summary.items() if isinstance(v, (int, float)) and k not in row})
            if trace is not None:
                row["trace"] = trace
            rows.append(row)
    extra = sorted({k for r in rows for k in r} - set(SUMMARY_COLUMNS) - {"policy"})
    columns = ["policy", *SUMMARY_COLUMNS, *extra]
    csv_path = out_dir / "summary.csv"
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    json_path = out_dir / "sweep.json"
    json_path.write_text(json.dumps([{
        "policy": r.label, "mode": r.mode, "target_attainment": r.target, "capacity": r.capacity,
        "bracketed": r.bracketed, **_estimate_fields(r.estimate),
        "points": [{"request_rate": p.rate, "slo_attainment": p.attainment, "passed": p.passed} for p in r.points],
    } for r in results], indent=2))
    return csv_path, json_path


def _estimate_fields(estimate: Estimate | None) -> dict[str, Any]:
    if estimate is None:
        return {}
    return {"interpolated_capacity": estimate.interpolated, "interpolated_on": estimate.on,
            "interpolated_between": list(estimate.between) if estimate.between else None}
