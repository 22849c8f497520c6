"""Reporting of bench results: rich tables (one run, several policies side by side with ratios to the first, capacity
sweeps) and the result JSON files (vLLM `bench serve` keys).
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Sequence

from rich.console import Console
from rich.table import Table

from appliance.bench.client import client_lag_note
from appliance.bench.sweep import SweepResult, slug

_HEAD = [("Successful requests", "completed", "{:d}"), ("Failed requests", "failed", "{:d}"),
         ("Benchmark duration (s)", "duration", "{:.2f}"), ("Request throughput (req/s)", "request_throughput",
                                                             "{:.2f}"),
         ("Request goodput (req/s)", "request_goodput", "{:.2f}"), ("SLO attainment (%)", "slo_attainment", "pct"),
         ("Output token throughput (tok/s)", "output_throughput", "{:.1f}"),
         ("Total token throughput (tok/s)", "total_token_throughput", "{:.1f}")]
_SERIES = [("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "TBT (every gap)"), ("e2el", "E2E latency")]
_TAIL = [("Client lag mean (ms)", "mean_client_lag_ms", "{:.2f}"), ("Client lag max (ms)", "max_client_lag_ms",
                                                                     "{:.2f}")]
_CONTRACT = [("Contract kept", "contract_met", "yesno"), ("Contract TBT percentile (ms)", "contract_tbt_ms", "{:.2f}")]


def _rows(result: dict[str, Any]) -> list[tuple[str, str, str]]:
    rows = list(_HEAD)
    for key, name in _SERIES:
        # p50 is the median: shown once
        stats = [k for k in result if re.fullmatch(rf"(mean|median|p[\d.]+)_{key}_ms", k) and not k.startswith("p50_")]
        for k in stats:
            rows.append((f"{name} {k.split('_')[0]} (ms)", k, "{:.2f}"))
    return rows + _TAIL + (_CONTRACT if "contract_met" in result else [])


def _fmt(value: Any, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if fmt == "yesno":
        return "yes" if value else "no"
    if fmt == "pct":
        return f"{100 * value:.1f}"
    if fmt == "{:d}":
        return str(int(value))
    return fmt.format(value)


def _ratio(value: Any, base: Any) -> str:
    if not isinstance(value, (int, float)) or not isinstance(base, (int, float)) or not base:
        return "-"
    return f"{value / base:.2f}x"


def result_table(results: Sequence[dict[str, Any]], title: str = "muxd bench") -> Table:
    """One column per result; with several, a ratio column per result after the first (value / first's value)."""
    table = Table(title=title, title_justify="left")
    table.add_column("metric")
    labels = [str(r.get("label")) for r in results]
    for label in labels:
        table.add_column(label, justify="right")
    for label in labels[1:]:
        table.add_column(f"{label} / {labels[0]}", justify="right", style="cyan")
    for name, key, fmt in _rows(results[0]):
        values = [r.get(key) for r in results]
        cells = [_fmt(v, fmt) for v in values] + [_ratio(v, values[0]) for v in values[1:]]
        table.add_row(name, *cells)
    return table


def print_results(console: Console, results: Sequence[dict[str, Any]]) -> None:
    first = results[0]
    slo = f", SLO {first['slo']}" if first.get("slo") else ""
    console.print(result_table(results, f"muxd bench: {first['trace']}, {first['num_prompts']} requests, offered "
                                        f"{_rate_text(first['offered_rate'])}{slo}"))
    for r in results:
        misses = [f"contract missed: {m}" for m in r.get("contract_misses") or []]
        for note in [*misses, *r.get("notes", []), client_lag_note(r)]:
            if note:
                console.print(f"[yellow]note ({r['label']}): {note}[/yellow]")


def _rate_text(rate: Any) -> str:
    return "inf req/s (all at once)" if rate == "inf" else f"{float(rate):.2f} req/s"


def write_results(out_dir: Path, results: Sequence[dict[str, Any]], filename: str | None = None,
                  append: bool = False) -> list[Path]:
    """result.json (or `filename`) for one run; with several policies one result-<label>.json each and
    comparison.json (the first's metrics and every other's ratio to it). `append`: each result is added to its
    file as one more line of JSON, as vLLM's --append-result does."""
    out_dir.mkdir(parents=True, exist_ok=True)

    def write(path: Path, result: dict[str, Any]) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        if not append:
            path.write_text(json.dumps(result, indent=2))
            return path
        with path.open("a+", encoding="utf-8") as f:
            f.write(("\n" if f.tell() else "") + json.dumps(result))
        return path

    if len(results) == 1:
        return [write(out_dir / (filename or "result.json"), results[0])]
    paths = [write(out_dir / f"result-{slug(str(r['label']))}.json", r) for r in results]
    base = results[0]
    numeric = [k for k, v in base.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    comparison = {"baseline": base["label"], "policies": [r["label"] for r in results],
                  "ratios": {r["label"]: {k: (r[k] / base[k] if isinstance(r.get(k), (int, float)) and base[k]
                                              else None) for k in numeric} for r in results[1:]}}
    path = out_dir / "comparison.json"
    path.write_text(json.dumps(comparison, indent=2))
    return paths + [path]


def sweep_table(sweeps: Sequence[SweepResult]) -> Table:
    table = Table(title="muxd bench sweep: capacity = highest request rate meeting the attainment target",
                  title_justify="left")
    for col in ("policy", "rate (req/s)", "attainment (%)", "passed", "goodput (req/s)", "p99 TTFT (ms)",
                "p99 TPOT (ms)", "p99 TBT (ms)"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for s in sweeps:
        for p in sorted(s.points, key=lambda p: p.rate):
            table.add_row(s.label, f"{p.rate:.3f}", f"{100 * p.attainment:.1f}", "yes" if p.passed else "no",
                          _fmt(p.summary.get("request_goodput"), "{:.2f}"),
                          _fmt(p.summary.get("p99_ttft_ms"), "{:.1f}"), _fmt(p.summary.get("p99_tpot_ms"), "{:.1f}"),
                          _fmt(p.summary.get("p99_itl_ms"), "{:.1f}"))
    return table


def capacity_lines(sweeps: Sequence[SweepResult]) -> list[str]:
    lines = []
    base = sweeps[0].capacity if sweeps else None
    for s in sweeps:
        if s.capacity is None:
            lines.append(f"{s.label}: no tested rate met {100 * s.target:.0f}% attainment")
            continue
        bound = "" if s.bracketed else " (a lower bound: no higher tested rate failed)"
        if s.estimate is not None and s.estimate.failed_below:  # near a knee one replay moves more than a rate step
            bound += f"; a lower rate failed ({s.estimate.failed_note}): the points are noisy here"
        ratio = f", {s.capacity / base:.2f}x {sweeps[0].label}" if base and s is not sweeps[0] else ""
        how = " (the highest measured rate that passed)" if s.mode == "rates" else ""
        lines.append(f"{s.label}: capacity {s.capacity:.3f} req/s{how} at {100 * s.target:.0f}% attainment{bound}"
                     f"{ratio}")
        if s.estimate is not None and s.estimate.interpolated is not None:
            lo, hi = s.estimate.between
            lines.append(f"{s.label}: interpolated capacity {s.estimate.interpolated:.3f} req/s ({s.estimate.on} "
                         f"crosses its target between {lo:.3g} and {hi:.3g} req/s, linearly)")
    return lines
