"""A measured capacity sweep beside a simulated one (`muxd bench compare`): both `summary.csv` files read back, each
policy's capacity taken from its points (`rates.estimate`), the simulation's error against the measurement, the
capacity ratios of mux to the other policies, p99 TTFT/TBT at a rate common to every policy; written as Markdown.
"""
from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance.bench.rates import DIRECTIONS, Criterion, Estimate, estimate
from appliance.bench.sweep import SweepPoint
from appliance.errors import ConfigError

REQUIRED = ("policy", "request_rate", "passed", "slo_attainment")


@dataclass
class Curve:
    """One policy's points (by rate) and the capacity read off them."""

    policy: str
    points: list[SweepPoint]
    estimate: Estimate

    def at(self, rate: float) -> SweepPoint | None:
        return next((p for p in self.points if math.isclose(p.rate, rate, rel_tol=1e-6)), None)


@dataclass
class SweepFile:
    """One sweep read back from its summary.csv."""

    path: Path
    trace: str | None
    target: float                 # the attainment a point had to reach
    curves: dict[str, Curve]      # policy -> curve, in the file's order
    tbt_target: float | None = None  # the contract's TBT target (ms), when the sweep had one


def summary_path(path: Path) -> Path:
    return path / "summary.csv" if path.is_dir() else path


def read_summary(path: Path, attainment: float | None = None) -> SweepFile:
    """A sweep's summary.csv (or the directory holding it). The targets come from its `target_<key>` columns;
    `attainment` stands in where the file does not record one."""
    path = summary_path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such file (give a sweep's result directory or its summary.csv)")
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise ConfigError(f"{path}: no points in this summary.csv")
    missing = [c for c in REQUIRED if c not in rows[0]]
    if missing:
        raise ConfigError(f"{path}: missing column(s) {', '.join(missing)}; is this a muxd bench sweep summary.csv?")
    conditions = [Criterion(key, float(rows[0][f"target_{key}"])) for key in DIRECTIONS
                  if rows[0].get(f"target_{key}")]
    if not any(c.key == "slo_attainment" for c in conditions):
        if attainment is None:
            raise ConfigError(f"{path} does not record its attainment target: pass --attainment")
        conditions.insert(0, Criterion("slo_attainment", attainment))
    target = next(c.target for c in conditions if c.key == "slo_attainment")
    by_policy: dict[str, list[SweepPoint]] = {}
    for line, row in enumerate(rows, start=2):
        summary = {k: _number(v) for k, v in row.items() if k not in ("policy", "passed", "trace")}
        rate, att = summary.get("request_rate"), summary.get("slo_attainment")
        if rate is None or att is None or row["passed"] not in ("True", "False"):
            raise ConfigError(f"{path}:{line}: request_rate and slo_attainment must be numbers and passed "
                              f"True or False, got {row['request_rate']!r}, {row['slo_attainment']!r}, "
                              f"{row['passed']!r}")
        by_policy.setdefault(row["policy"], []).append(SweepPoint(rate, att, row["passed"] == "True", summary))
    curves = {policy: Curve(policy, sorted(points, key=lambda p: p.rate), estimate(points, conditions))
              for policy, points in by_policy.items()}
    tbt = next((c.target for c in conditions if c.key == "contract_tbt_ms"), None)
    return SweepFile(path, rows[0].get("trace") or None, target, curves, tbt)


def _number(text: str | None) -> float | None:
    try:
        return float(text) if text not in (None, "") else None
    except ValueError:
        return None


def error_pct(measured: Estimate | None, simulated: Estimate | None) -> float | None:
    """(simulated - measured) / measured, in %, on the best capacity of each (interpolated where there is one)."""
    if measured is None or simulated is None or not measured.best or simulated.best is None:
        return None
    return 100 * (simulated.best - measured.best) / measured.best


def ratios(sweep: SweepFile, base: str) -> dict[str, float | None]:
    """Capacity of `base` over that of every other policy."""
    top = sweep.curves.get(base)
    out = {}
    for policy, curve in sweep.curves.items():
        if policy != base:
            ok = top is not None and top.estimate.best is not None and curve.estimate.best
            out[policy] = top.estimate.best / curve.estimate.best if ok else None
    return out


def common_rate(sweep: SweepFile, at_rate: float | None = None) -> tuple[float | None, str]:
    """The rate at which to set latencies side by side, and why that one."""
    if at_rate is not None:
        return at_rate, "the rate asked for (--at-rate)"
    curves = list(sweep.curves.values())
    common = [p.rate for p in curves[0].points if all(c.at(p.rate) for c in curves)]
    if not common:
        return None, "no rate was measured for every policy; pass --at-rate"
    kept = [r for r in common if any(c.at(r).passed for c in curves)]
    if kept:
        return max(kept), "the highest rate measured for every policy at which at least one kept the SLO"
    return min(common), "no policy kept the SLO at a rate measured for all; the lowest such rate"


def _cap(e: Estimate | None) -> str:
    if e is None:
        return "-"
    if e.best is None:
        return "none"
    return f"{e.best:.3g}" + ("" if e.bracketed else "+")


def _how(e: Estimate | None) -> str:
    return "not swept" if e is None else e.how


def _val(point: SweepPoint | None, key: str, fmt: str) -> str:
    value = None if point is None else (point.attainment if key == "slo_attainment" else point.summary.get(key))
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return fmt.format(100 * value if key == "slo_attainment" else value)


def markdown(measured: SweepFile, simulated: SweepFile, within: float = 15.0, at_rate: float | None = None,
             title: str | None = None) -> str:
    """The comparison as Markdown: capacities and error, capacity ratios, latencies at a common rate."""
    policies = list(dict.fromkeys([*measured.curves, *simulated.curves]))
    trace = measured.trace or simulated.trace or "workload"
    lines = [f"## {title or f'Goodput: {Path(trace).name}'}", "",
             f"Measured: `{measured.path}`; simulated: `{simulated.path}`. Capacity = the highest request rate "
             f"whose replay keeps the SLO (attainment >= {100 * measured.target:g} % and the contract); "
             "\"interpolated\": the rate where the condition missed crosses its target, linear between the highest "
             "passing and the lowest failing rate above it; \"+\": a lower bound (no higher rate failed).", "",
             f"| policy | measured capacity (req/s) | how | simulated capacity (req/s) | how | error | within "
             f"{within:g} % |", "| --- | ---: | --- | ---: | --- | ---: | --- |"]
    for policy in policies:
        m, s = measured.curves.get(policy), simulated.curves.get(policy)
        me, se = m.estimate if m else None, s.estimate if s else None
        err = error_pct(me, se)
        lines.append(f"| {policy} | {_cap(me)} | {_how(me)} | {_cap(se)} | {_how(se)} | "
                     f"{'-' if err is None else f'{err:+.1f} %'} | "
                     f"{'-' if err is None else ('yes' if abs(err) <= within else 'no')} |")
    base = "mux" if "mux" in policies else policies[0]
    mr, sr = ratios(measured, base), ratios(simulated, base)
    others = [p for p in policies if p != base]
    if others:
        lines += ["", "| capacity ratio | measured | simulated |", "| --- | ---: | ---: |"]
        for p in others:
            lines.append(f"| {base} / {p} | {_ratio(mr.get(p))} | {_ratio(sr.get(p))} |")
    rate, why = common_rate(measured, at_rate)
    lines += [""]
    if rate is None:
        lines.append(f"Latencies at a common rate: {why}.")
        return "\n".join(lines) + "\n"
    lines += [f"At {rate:.3g} req/s ({why}); simulated \"-\" where the simulation did not run that rate:", "",
              "| policy | attainment meas. (%) | sim. (%) | p99 TTFT meas. (ms) | sim. (ms) | p99 TBT meas. (ms) | "
              "sim. (ms) | kept meas. / sim. |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for policy in policies:
        m = measured.curves[policy].at(rate) if policy in measured.curves else None
        s = simulated.curves[policy].at(rate) if policy in simulated.curves else None
        kept = " / ".join("-" if p is None else ("yes" if p.passed else "no") for p in (m, s))
        lines.append(f"| {policy} | {_val(m, 'slo_attainment', '{:.1f}')} | {_val(s, 'slo_attainment', '{:.1f}')} | "
                     f"{_val(m, 'p99_ttft_ms', '{:.0f}')} | {_val(s, 'p99_ttft_ms', '{:.0f}')} | "
                     f"{_val(m, 'p99_itl_ms', '{:.1f}')} | {_val(s, 'p99_itl_ms', '{:.1f}')} | {kept} |")
    return "\n".join(lines) + "\n"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def write(measured: SweepFile, simulated: SweepFile, out_dir: Path, **kw: Any) -> tuple[str, list[Path]]:
    """comparison.md and attainment_measured_vs_simulated.png in `out_dir`; returns the Markdown and the paths."""
    from appliance.bench.plots import comparison_plot  # defers matplotlib to the commands that draw

    out_dir.mkdir(parents=True, exist_ok=True)
    text = markdown(measured, simulated, **kw)
    md = out_dir / "comparison.md"
    md.write_text(text)
    png = comparison_plot({p: c.points for p, c in measured.curves.items()},
                          {p: c.points for p, c in simulated.curves.items()}, measured.target,
                          out_dir / "attainment_measured_vs_simulated.png",
                          f"measured (solid) vs simulated (dashed): {Path(measured.trace or 'workload').name}",
                          measured.tbt_target)
    return text, [md, png]
