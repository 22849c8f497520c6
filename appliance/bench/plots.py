"""PNG plots of bench results with matplotlib (no display needed): TTFT and TBT CDFs per policy, SLO attainment
against request rate from a sweep (and a measured sweep beside a simulated one), and the SM-partition timeline a
server exposes at GET /debug/timeline (Chrome-trace JSON).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import httpx
import numpy as np

from appliance.bench.sweep import SweepPoint, SweepResult
from appliance.workload.metrics import RequestTimeline, request_metrics


def _figure(width: float = 6.4, height: float = 4.0):
    from matplotlib.figure import Figure  # the object API: no global pyplot state, no GUI backend

    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    return fig, fig.subplots()


def cdf_plot(series: dict[str, Sequence[float]], path: Path, title: str, xlabel: str,
             slo: tuple[str, float] | None = None) -> Path:
    """Empirical CDF of each series (milliseconds), one line per label; a dashed line at an SLO (name, ms)."""
    fig, ax = _figure()
    for label, values in series.items():
        if not len(values):
            continue
        xs = np.sort(np.asarray(values, dtype=float))
        ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post", label=f"{label} (n={len(xs)})")
    if slo is not None:
        ax.axvline(slo[1], color="grey", linestyle="--", label=f"{slo[0]} target {slo[1]:g} ms")
    ax.set(title=title, xlabel=xlabel, ylabel="fraction of samples", ylim=(0, 1.02))
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.savefig(path)
    return path


def latency_cdfs(runs: dict[str, Sequence[RequestTimeline]], out_dir: Path,
                 targets: dict[str, float] | None = None) -> list[Path]:
    """ttft_cdf.png (one sample per request) and tbt_cdf.png (every inter-token gap) for each policy."""
    out_dir.mkdir(parents=True, exist_ok=True)
    ttft: dict[str, list[float]] = {}
    tbt: dict[str, list[float]] = {}
    for label, timelines in runs.items():
        metrics = [request_metrics(t) for t in timelines if t.success]
        ttft[label] = [m.ttft * 1000 for m in metrics]
        tbt[label] = [g * 1000 for m in metrics for g in m.itls]
    targets = targets or {}
    tbt_target = next(((k.upper(), targets[k]) for k in ("tbt", "tpot") if k in targets), None)
    return [cdf_plot(ttft, out_dir / "ttft_cdf.png", "Time to first token", "TTFT (ms)",
                     ("TTFT", targets["ttft"]) if "ttft" in targets else None),
            cdf_plot(tbt, out_dir / "tbt_cdf.png", "Time between tokens (every gap)", "TBT (ms)", tbt_target)]


def attainment_plot(sweeps: Sequence[SweepResult], path: Path) -> Path:
    """SLO attainment against request rate, one line per policy, the target as a dashed line, capacities marked."""
    fig, ax = _figure()
    for s in sweeps:
        points = sorted(s.points, key=lambda p: p.rate)
        line, = ax.plot([p.rate for p in points], [100 * p.attainment for p in points], marker="o", label=s.label)
        if s.capacity is not None:
            ax.axvline(s.capacity, color=line.get_color(), linestyle=":", alpha=0.8)
    if sweeps:
        ax.axhline(100 * sweeps[0].target, color="grey", linestyle="--", label=f"target {100 * sweeps[0].target:g}%")
    ax.set(title="SLO attainment vs request rate (dotted: capacity)", xlabel="request rate (req/s)",
           ylabel="attainment (%)", ylim=(0, 102))
    ax.grid(alpha=0.3)
    ax.legend(loc="lower left")
    fig.savefig(path)
    return path


def comparison_plot(measured: dict[str, Sequence[SweepPoint]], simulated: dict[str, Sequence[SweepPoint]],
                    target: float, path: Path, title: str = "SLO attainment vs request rate",
                    tbt_target: float | None = None) -> Path:
    """Per policy against the rate: SLO attainment (left) and the contract's TBT percentile (right, when the points
    carry `contract_tbt_ms`). Measured: solid lines with markers, an x where the point missed the SLO; simulated:
    dashed lines in the same colour. The targets are dotted horizontal lines; a log rate axis when rates span 10x,
    a log TBT axis when the TBT percentiles do."""
    tbt = any("contract_tbt_ms" in p.summary for pts in (*measured.values(), *simulated.values()) for p in pts)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12.0 if tbt else 7.2, 4.6), dpi=100, layout="constrained")
    axes = fig.subplots(1, 2 if tbt else 1, squeeze=False)[0]
    panels = [(axes[0], lambda p: 100 * p.attainment, "attainment (%)", 100 * target, f"target {100 * target:g}%")]
    if tbt:
        panels.append((axes[1], lambda p: p.summary.get("contract_tbt_ms", float("nan")), "contract TBT percentile "
                       "(ms)", tbt_target, f"target {tbt_target:g} ms" if tbt_target else None))
    rates = [p.rate for pts in (*measured.values(), *simulated.values()) for p in pts]
    for ax, value, ylabel, goal, goal_label in panels:
        first = ax is axes[0]  # the policies' legend once, on the left
        for i, policy in enumerate(dict.fromkeys([*measured, *simulated])):
            color = f"C{i % 10}"
            ours = sorted(measured.get(policy, ()), key=lambda p: p.rate)
            sim = sorted(simulated.get(policy, ()), key=lambda p: p.rate)
            if ours:
                ax.plot([p.rate for p in ours], [value(p) for p in ours], color=color, marker="o",
                        label=f"{policy} measured" if first else None)
                missed = [p for p in ours if not p.passed]
                ax.scatter([p.rate for p in missed], [value(p) for p in missed], color="black", marker="x", zorder=3,
                           label="missed the SLO" if first and i == 0 else None)
            if sim:
                ax.plot([p.rate for p in sim], [value(p) for p in sim], color=color, linestyle="--",
                        label=f"{policy} simulated" if first else None)
        if goal is not None:
            ax.axhline(goal, color="grey", linestyle=":", label=goal_label)
        if rates and max(rates) > 10 * min(rates):
            ax.set_xscale("log")
        ax.set(xlabel="request rate (req/s)", ylabel=ylabel)
        ax.grid(alpha=0.3)
    axes[0].set_ylim(0, 102)
    if tbt:
        low, high = axes[1].dataLim.intervaly
        if low > 0 and high > 10 * low:  # log only where TBT spans 10x; a narrow range reads better linear
            axes[1].set_yscale("log")
        axes[1].legend(loc="upper left", fontsize="small")
    axes[0].legend(loc="lower left", fontsize="small")
    fig.suptitle(title)
    fig.savefig(path)
    return path


def fetch_timeline(base_url: str, timeout: float = 10.0) -> list[dict[str, Any]] | None:
    """Chrome-trace events from GET /debug/timeline, or None when the server has no such endpoint."""
    try:
        resp = httpx.get(base_url.rstrip("/") + "/debug/timeline", timeout=timeout)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    try:
        body = resp.json()
    except ValueError:
        return None
    events = body.get("traceEvents") if isinstance(body, dict) else body
    return events if isinstance(events, list) else None


def timeline_plot(events: list[dict[str, Any]], path: Path) -> Path | None:
    """Bars per track (pid, tid) from complete ('X') and begin/end ('B'/'E') events; None if there is none."""
    names: dict[tuple[Any, Any], str] = {}
    bars: dict[tuple[Any, Any], list[tuple[float, float, str]]] = {}
    open_: dict[tuple[Any, Any], list[tuple[float, str]]] = {}
    for e in events:
        key, ph = (e.get("pid"), e.get("tid")), e.get("ph")
        if ph == "M" and e.get("name") == "thread_name":
            names[key] = str((e.get("args") or {}).get("name", key))
        elif ph == "X" and "ts" in e:
            bars.setdefault(key, []).append((float(e["ts"]), float(e.get("dur", 0)), str(e.get("name", ""))))
        elif ph == "B" and "ts" in e:
            open_.setdefault(key, []).append((float(e["ts"]), str(e.get("name", ""))))
        elif ph == "E" and open_.get(key):
            start, name = open_[key].pop()
            bars.setdefault(key, []).append((start, float(e["ts"]) - start, name))
    if not bars:
        return None
    t0 = min(start for track in bars.values() for start, _, _ in track)
    kinds = sorted({name for track in bars.values() for _, _, name in track})
    fig, ax = _figure(9.0, 1.2 + 0.6 * len(bars))
    colors = {k: f"C{i % 10}" for i, k in enumerate(kinds)}
    tracks = sorted(bars, key=str)
    for row, key in enumerate(tracks):
        for kind in kinds:
            spans = [((s - t0) / 1000, d / 1000) for s, d, n in bars[key] if n == kind]
            if spans:
                ax.broken_barh(spans, (row - 0.4, 0.8), color=colors[kind])
    ax.set_yticks(range(len(tracks)), [names.get(k, f"{k[0]}/{k[1]}") for k in tracks])
    ax.set(title="SM-partition timeline", xlabel="time (ms)")
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color=colors[k], label=k) for k in kinds], loc="upper right", fontsize="small")
    fig.savefig(path)
    return path
