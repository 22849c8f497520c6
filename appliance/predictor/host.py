"""The host's share of an engine step: what the CPU spends outside the GPU's kernels, which a client sees in every
inter-token gap at the rates where it matters (planning, batch layout, flashinfer plans, launches, sampling
read-back, detokenizing and streaming the outputs).

A step's wall time, as the synchronous loop runs it (decode launched first, then the prefill layers, then the tokens
read back): `max(decode on the GPU, prefill launches on the host) + step host time`. The overlapped loop (the engine's
default) plans and launches step N+1 while step N runs, so the host's work hides behind the device:
`max(decode on the GPU, step host time + prefill launches)`. The step's host time grows with its decode rows; a
prefill launch costs the host a fixed part and a part per layer launched, each of its own for launches that replay
piecewise CUDA graphs (those of at most `graph_rows` tokens: two graph launches and an attention call a layer) and
for launches run eagerly (the compiled layers' Python: 3-4x as much a layer). `muxd profile` fits the coefficients
from a replay's step log (`fit_host`); without one, the prior below (measured on H100 and H200 hosts with
Llama-3.1-8B shapes) applies. A profile without graph launch figures takes its eager ones scaled by the prior's
ratio between the two.
"""
from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, replace
from typing import Any, Iterable

import numpy as np

MAX_HOST_MS = 50.0  # a logged host time above this is an idle wait, not work
LAUNCH_WINDOW = 256  # prefill launches the online per-layer figure is taken from
LAUNCH_QUANTILE = 0.98  # planned at this quantile: one slow launch is a late token for every decode row, and
#                         the contract's p99 of gaps leaves room for few
MIN_LAUNCHES = 16  # launches measured before the figure replaces the profile's


GRAPH_LAYER_SHARE = 0.375  # a graph-replayed layer's launch against an eager one's (prior: 0.15 against 0.4 ms)


@dataclass(frozen=True)
class HostModel:
    step_ms: float = 0.5        # a step's fixed host time (plan, layout, read-back, outputs)
    per_row_us: float = 7.0     # per decode row
    launch_ms: float = 0.3      # per prefill launch run eagerly (a layer range of a batch)
    per_layer_ms: float = 0.4   # per prefill layer launched eagerly
    graph_launch_ms: float | None = None     # per launch replaying piecewise graphs (None: launch_ms)
    graph_per_layer_ms: float | None = None  # per layer replayed (None: per_layer_ms x GRAPH_LAYER_SHARE)
    source: str = "prior"
    overlapped: bool = False    # the engine's loop hides the host behind the device (not a profile field)
    graph_rows: int = 0         # launches of at most this many tokens replay graphs (the engine's; not a profile field)

    def __post_init__(self) -> None:
        if self.graph_launch_ms is None:
            object.__setattr__(self, "graph_launch_ms", self.launch_ms)
        if self.graph_per_layer_ms is None:
            object.__setattr__(self, "graph_per_layer_ms", self.per_layer_ms * GRAPH_LAYER_SHARE)

    def step(self, rows: int) -> float:
        """Host milliseconds of a step with `rows` decode rows, outside its launches."""
        return self.step_ms + self.per_row_us * rows / 1e3

    def replays_graphs(self, tokens: int) -> bool:
        """Whether a prefill launch of `tokens` tokens replays piecewise graphs."""
        return 0 < tokens <= self.graph_rows

    def launch_costs(self, tokens: int = 0) -> tuple[float, float]:
        """(fixed, per layer) host milliseconds of a prefill launch of `tokens` tokens."""
        if self.replays_graphs(tokens):
            return self.graph_launch_ms, self.graph_per_layer_ms
        return self.launch_ms, self.per_layer_ms

    def prefill_launch(self, layers: int, tokens: int = 0) -> float:
        """Host milliseconds spent launching `layers` prefill layers of `tokens` tokens (0 layers: none)."""
        if layers <= 0:
            return 0.0
        fixed, per_layer = self.launch_costs(tokens)
        return fixed + per_layer * layers

    def gap(self, rows: int, decode_ms: float, layers: int = 0, tokens: int = 0) -> float:
        """The inter-token gap of a decode step of `rows` rows whose kernels take `decode_ms`, with `layers`
        prefill layers of `tokens` tokens launched beside it."""
        if self.overlapped:
            return max(decode_ms, self.step(rows) + self.prefill_launch(layers, tokens))
        return max(decode_ms, self.prefill_launch(layers, tokens)) + self.step(rows)

    def launch_room(self, rows: int, decode_ms: float, target_ms: float) -> float:
        """Host milliseconds left for launching prefill layers beside a decode step of `rows` rows taking
        `decode_ms`, keeping its gap within `target_ms` (or within the decode step itself, when that is longer)."""
        if self.overlapped:
            return max(decode_ms, target_ms) - self.step(rows)
        return max(decode_ms, target_ms - self.step(rows))

    def device_room(self, rows: int, target_ms: float) -> float:
        """The longest a step of `rows` decode rows may run on the device for its gap to stay within `target_ms`."""
        return target_ms if self.overlapped and self.step(rows) <= target_ms else target_ms - self.step(rows)

    def scaled(self, factor: float) -> "HostModel":
        """This model with every time `factor` x longer (a simulated host slower or faster than modelled)."""
        return replace(self.launch_scaled(factor), step_ms=self.step_ms * factor, per_row_us=self.per_row_us * factor)

    def launch_scaled(self, factor: float) -> "HostModel":
        """This model with its prefill launches `factor` x longer."""
        return replace(self, launch_ms=self.launch_ms * factor, per_layer_ms=self.per_layer_ms * factor,
                       graph_launch_ms=self.graph_launch_ms * factor,
                       graph_per_layer_ms=self.graph_per_layer_ms * factor)

    def with_loop(self, overlapped: bool) -> "HostModel":
        """This model for an engine loop that does (or does not) overlap the host with the device."""
        return replace(self, overlapped=overlapped)

    def with_graphs(self, rows: int) -> "HostModel":
        """This model for an engine whose prefill launches of at most `rows` tokens replay graphs (0: none)."""
        return replace(self, graph_rows=max(0, int(rows)))

    def as_dict(self) -> dict[str, float]:
        out: dict[str, Any] = asdict(self)
        for key in ("source", "overlapped", "graph_rows"):
            out.pop(key)
        return out

    @classmethod
    def from_dict(cls, raw: dict[str, float] | None, source: str = "profile") -> "HostModel":
        return cls(source=source, **raw) if raw else cls()


def fit_host(steps: Iterable[dict[str, Any]]) -> HostModel | None:
    """Fit the host model from a step log (engine/steplog.py): each step's host time outside the executor (planning
    plus the time after its launch) against its decode rows, and each prefill launch's host time against its
    layers, eager launches and graph replays (`prefill_graphs`; a log without it counts every launch eager) apart.
    None when the log holds too few steps."""
    rows, host = [], []
    launches: dict[bool, tuple[list[int], list[float]]] = {False: ([], []), True: ([], [])}
    for s in steps:
        if s.get("gap_ms") is None or "launch_ms" not in s:
            continue
        h = float(s["plan_ms"]) + float(s["gap_ms"])
        if s.get("decode") and h < MAX_HOST_MS:
            rows.append(int(s["decode"]))
            host.append(h)
        # (a launch that takes longer ran its layers on the host: a CPU engine, not launch overhead)
        if s.get("prefill_launch_ms") is not None and s.get("layers") and s["prefill_launch_ms"] < MAX_HOST_MS:
            layers, launch = launches[bool(s.get("prefill_graphs"))]
            layers.append(int(s["layers"]))
            launch.append(float(s["prefill_launch_ms"]))
    if len(host) < 20:
        return None
    step_ms, per_row = _line(rows, host)
    eager, graphs = ((_line(*launches[g]) if len(launches[g][0]) >= 20 else None) for g in (False, True))
    launch_ms, per_layer = eager or (HostModel.launch_ms, HostModel.per_layer_ms)
    graph_launch, graph_layer = graphs or (None, None)
    return HostModel(step_ms, per_row * 1e3, launch_ms, per_layer, graph_launch, graph_layer, "fitted")


def _line(x, y, quantile: float = 0.75) -> tuple[float, float]:
    """A non-negative intercept and slope through the host times per x, least squares raised to the `quantile` of
    the residuals (the tail is what gaps see; a mean would plan to the middle)."""
    xs, ys = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if np.ptp(xs) == 0:
        return _quantile(ys, quantile), 0.0
    dx = xs - xs.mean()  # least squares in closed form (np.polyfit's SVD costs more than the rest of a refit)
    slope = float(dx @ (ys - ys.mean()) / (dx @ dx))
    intercept = float(ys.mean() - slope * xs.mean())
    intercept += _quantile(ys - (intercept + slope * xs), quantile)
    return max(0.0, intercept), max(0.0, slope)


def _quantile(values: np.ndarray, q: float) -> float:
    """np.quantile(values, q) with its default linear interpolation, from a partial sort: a few times faster on the
    few hundred values of a launch window (refitted at every prefill launch, on the engine thread)."""
    k = q * (len(values) - 1)
    lo = int(k)
    hi = min(lo + 1, len(values) - 1)
    part = np.partition(values, (lo, hi))
    a, b, t = float(part[lo]), float(part[hi]), k - lo
    return b - (b - a) * (1 - t) if t >= 0.5 else a + (b - a) * t


class LaunchCost:
    """Online: the host time of prefill launches, as the serving engine measures it, so with whatever else the host
    runs meanwhile (the HTTP server, streaming, other threads holding the interpreter). A profile measures launches
    on an idle host; while serving they take longer (an H200 host: 0.7-0.9 ms a launch idle, 5 ms serving), and a
    gap that the plan fits within the TBT target by the idle figure overruns it. Kept as a line through the recent
    launches, a fixed part per launch and a part per layer, raised to the high quantile of their residuals (one slow
    launch is one late token for every decode row); launches that all hold as many layers give the per-layer part
    alone (the fixed part stays as profiled). Launches that replay piecewise graphs and eager ones are two
    populations (a layer costs 3-4x as much eagerly): each has its own window and line."""

    def __init__(self) -> None:
        # (layers, ms) per launch, eager (False) and replaying graphs (True)
        self.windows: dict[bool, deque[tuple[float, float]]] = {g: deque(maxlen=LAUNCH_WINDOW) for g in (False, True)}

    def observe(self, model: HostModel, launches: int, layers: int, measured_ms: float,
                graphs: bool = False) -> HostModel:
        """`model` with its launch times learned from `launches` launches of `layers` layers in all, measured to
        take `measured_ms` of host time, eager or (`graphs`) replaying graphs (`model` itself until enough
        launches of that kind were measured)."""
        if launches <= 0 or layers <= 0 or not 0 <= measured_ms < MAX_HOST_MS:  # (longer: a compile, or a CPU)
            return model
        window = self.windows[graphs]
        window.append((layers / launches, measured_ms / launches))
        if len(window) < MIN_LAUNCHES:
            return model
        fixed_name, layer_name = ("graph_launch_ms", "graph_per_layer_ms") if graphs else ("launch_ms", "per_layer_ms")
        x, y = (np.fromiter(v, float) for v in zip(*window))
        if np.ptp(x) > 0:
            fixed, slope = _line(x, y, LAUNCH_QUANTILE)
            if slope > 0:
                return replace(model, **{fixed_name: fixed, layer_name: slope})
        per_layer = _quantile(np.maximum(0.0, y - getattr(model, fixed_name)) / x, LAUNCH_QUANTILE)
        return replace(model, **{layer_name: per_layer})
