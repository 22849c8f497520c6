"""`muxd profile`: measures the profiling grid (profile/grid.py) with the step timer (profile/timer.py) within a
time budget, appending every sample to a log next to the profile so that an interrupted run resumes where it stopped,
then fits the profile file the server loads and scores the fitted predictor on the held-out samples; `refit_profile`
fits a samples log again without measuring.

Times are what serving sees: a decode step from its launch to its tokens on the host (the time between tokens), a
prefill from its launch to its last layer's completion.
"""
from __future__ import annotations

import json
import logging
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from appliance.engine.graphs import capture_sizes
from appliance.errors import ConfigError
from appliance.model_zoo.config import ModelConfig
from appliance.predictor.decode_plan import DecodePlan
from appliance.predictor.gemm_table import GemmTable
from appliance.predictor.predictor import Predictor
from appliance.predictor.prefill_plan import PrefillPlan
from appliance.predictor.profile import (
    ProfileFile,
    build_profile,
    model_shape,
    read_profile,
    save_profile,
)
from appliance.predictor.roofline import DEVICES, device_spec
from appliance.profile.grid import Point, phase_partitions

log = logging.getLogger("muxd.profile")
from appliance.attention.flashinfer_backend import CUDA_CORE_DECODE_GROUPS
from appliance.profile.timer import StepTimer

SAMPLES_FORMAT = "muxd-profile-samples"
REVISIT_MS = 50.0  # prefill and mixed steps shorter than this are host-bound: measured again later (see run_profile)
REVISITS = 2
NOISY_SPREAD = 0.2  # runs of one repeated point differing by more than this, at the 90th percentile: a busy host
@dataclass
class ProfileResult:
    path: Path
    samples_path: Path
    profile: ProfileFile | None = None  # set once fitted
    measured: int = 0          # this run
    resumed: int = 0           # read back from the samples log
    skipped_budget: int = 0
    skipped_memory: int = 0
    failed: int = 0            # could not be measured (see the log)
    revisited: int = 0         # host-bound points measured again at later moments
    spread: list[float] = field(default_factory=list)  # per repeated point: its slowest run over its fastest, - 1
    errors: dict[str, float] = field(default_factory=dict)  # held-out errors by phase
    worst: dict[str, tuple[Point, float, float]] = field(default_factory=dict)  # per phase: point, measured, predicted
    elapsed_s: float = 0.0

    @property
    def spread_median(self) -> float:
        return float(np.median(self.spread)) if self.spread else 0.0

    @property
    def spread_p90(self) -> float:
        return float(np.percentile(self.spread, 90)) if self.spread else 0.0

    @property
    def noisy(self) -> bool:
        """The host was busy while profiling: repeated measurements of one point disagree too often."""
        return self.spread_p90 > NOISY_SPREAD


def samples_path_for(out: Path) -> Path:
    return out.with_name(out.name + ".samples.jsonl")


def _header(timer: StepTimer, model_name: str) -> dict:
    decode, prefill = timer.decode_plan, timer.prefill_plan
    return {"format": SAMPLES_FORMAT, "model": model_name, "shape": model_shape(timer.engine.model.config),
            "tensor_parallel_size": timer.engine.model.config.tp_size,
            "gpu": timer.gpu_name, "sm_count": timer.sm_count, "decode_partitions": timer.decode_partitions,
            "decode_plan": decode.to_dict() if decode else None,
            "prefill_plan": prefill.to_dict() if prefill else None}


def logged_gemm(path: Path) -> GemmTable | None:
    """The GEMM table a samples log's prefills were padded by (None: they were not)."""
    with path.open(encoding="utf-8") as f:
        head = json.loads(f.readline() or "{}")
    return GemmTable.from_dict(head["gemm"]) if isinstance(head, dict) and head.get("gemm") else None


def read_samples(path: Path, header: dict) -> dict[str, tuple[Point, float]]:
    """Samples measured by an earlier run (key -> point, ms); ConfigError when they were measured for another
    model, GPU or partition set."""
    lines = path.read_text(encoding="utf-8").splitlines()
    if not lines:
        return {}
    try:
        head = json.loads(lines[0])
    except json.JSONDecodeError:
        head = None
    if not isinstance(head, dict) or head.get("format") != SAMPLES_FORMAT:
        raise ConfigError(f"{path}: not a muxd profile samples log; remove it or drop --resume")
    for k in ("shape", "tensor_parallel_size", "gpu", "sm_count", "decode_partitions"):
        default = 1 if k == "tensor_parallel_size" else None  # a log from before tensor parallelism: one rank
        if head.get(k, default) != header.get(k, default):
            raise ConfigError(f"{path}: measured with {k} {head.get(k, default)!r}, this run has "
                              f"{header.get(k, default)!r}; remove it or drop --resume")
    out = {}
    for n, line in enumerate(lines[1:], start=2):
        try:
            row = json.loads(line)
            point = Point(**{k: row[k] for k in ("kind", "sms", "new", "reused", "batch", "context", "holdout")})
            out[point.key] = (point, float(row["ms"]))
        except (json.JSONDecodeError, KeyError, TypeError):
            if n == len(lines):  # a line cut short by an interrupted run
                break
            raise ConfigError(f"{path}:{n}: not a sample line") from None
    return out


def score_held_out(profile: ProfileFile, num_layers: int, held: Sequence[tuple[Point, float]]
                   ) -> tuple[dict[str, float], dict[str, tuple[Point, float, float]]]:
    """The fitted predictor on held-out samples, per phase (contended: the guarded worst case against the measured
    step): mean and max relative error, and the sample it missed most (point, measured ms, predicted ms)."""
    predictor: Predictor = profile.predictor(num_layers, "profile")
    rows: dict[str, list[tuple[float, Point, float, float]]] = {"prefill": [], "decode": [], "contended": [],
                                                                 "mixed": []}
    for point, ms in held:
        if point.kind == "prefill":
            pred = predictor.prefill_solo_ms(point.items, point.sms)
        elif point.kind == "decode":
            pred = predictor.decode_ms(point.load, point.sms)
        elif point.kind == "mixed":
            pred = predictor.mixed_ms(point.items, point.load)
        else:
            pred = predictor.decode_ms(point.load, point.sms, point.items)
        rows[point.kind].append((abs(pred - ms) / ms, point, ms, pred))
    out, worst = {}, {}
    for kind, scored in rows.items():
        if scored:
            top = max(scored, key=lambda row: row[0])
            out[f"{kind}_mean"], out[f"{kind}_max"] = float(np.mean([row[0] for row in scored])), float(top[0])
            out[f"{kind}_n"] = float(len(scored))
            worst[kind] = top[1:]
    return out, worst


def _fit_profile(result: "ProfileResult", done: dict[str, tuple[Point, float]], model: ModelConfig, **header
                 ) -> ProfileFile:
    """Fit the profile of `done`'s samples (the held-out ones scored, never fitted) into `result`; `header`: what
    build_profile takes besides the samples and the model."""
    fit = [p.sample(ms) for p, ms in done.values() if not p.holdout]
    held = [(p, ms) for p, ms in done.values() if p.holdout]
    profile = build_profile(fit, model=model, **header)
    prefill_sms, decode_sms = phase_partitions(header["sm_count"], header["decode_partitions"])
    short = [f"prefill on {s} SMs" for s in prefill_sms if str(s) not in profile.prefill]
    short += [f"decode on {s} SMs" for s in decode_sms if str(s) not in profile.decode]
    if short:
        log.warning("%s: too few samples to fit, predicted from the nearest narrower partition (run again with "
                    "--resume to measure them)", ", ".join(short))
    result.errors, result.worst = score_held_out(profile, model.num_layers, held)
    profile.fit.update({f"holdout_{k}": v for k, v in result.errors.items()})
    profile.fit["samples_fit"], profile.fit["samples_holdout"] = float(len(fit)), float(len(held))
    result.profile = profile
    return profile


def run_profile(timer: StepTimer, points: Sequence[Point], out: Path, *, model_name: str, budget_s: float,
                started: float, resume: bool = False, kv_tokens: int | None = None,
                on_point: Callable[[Point, float | None], None] | None = None) -> ProfileResult:
    """Measure the GEMM table (prefills are padded by it from then on; a resumed run keeps its log's) and `points` in
    order until the budget (counted from `started`, a perf_counter time) would run out, then fit and write the
    profile. Samples go to the log as they are measured."""
    out = Path(out)
    log_path = samples_path_for(out)
    header = _header(timer, model_name)
    done = read_samples(log_path, header) if resume and log_path.is_file() else {}
    if done:
        gemm = logged_gemm(log_path)  # the resumed samples' padding; none before the log recorded one
        rows = timer.engine.prefill_graph_rows
        if gemm is not None and gemm.graph_rows != rows:
            raise ConfigError(f"{log_path} was measured with prefill graphs up to {gemm.graph_rows} rows, this run "
                              f"has them up to {rows}: resume with --prefill-graph-rows {gemm.graph_rows}")
    else:
        t0 = time.perf_counter()
        gemm = timer.measure_gemm()
        log.info("GEMM times at %d row buckets on %d prefill partitions measured in %.1f s", len(gemm.rows),
                 len(gemm.ms), time.perf_counter() - t0)
    timer.pad_prefills(gemm)
    header["gemm"] = gemm.to_dict() if gemm else None
    result = ProfileResult(out, log_path, resumed=len(done))
    cost = _CostModel(timer)
    deadline = started + budget_s
    measured_now: list[Point] = []
    with log_path.open("w", encoding="utf-8") as f:  # rewritten whole: a line an interruption cut short goes
        f.write(json.dumps(header) + "\n")
        for point, ms in done.values():
            f.write(json.dumps({**asdict(point), "ms": ms}) + "\n")
        for point in points:
            if point.key in done:
                if on_point:
                    on_point(point, done[point.key][1])
                continue
            if kv_tokens is not None and point.tokens > kv_tokens:
                result.skipped_memory += 1
                if on_point:
                    on_point(point, None)
                continue
            if time.perf_counter() + cost.estimate(point) > deadline:
                result.skipped_budget += 1
                if on_point:
                    on_point(point, None)
                continue
            t0 = time.perf_counter()
            ms = timer.measure(point)
            cost.learn(point, time.perf_counter() - t0)
            if ms is None:
                result.failed += 1
                if on_point:
                    on_point(point, None)
                continue
            done[point.key] = (point, ms)
            measured_now.append(point)
            result.measured += 1
            f.write(json.dumps({**asdict(point), "ms": ms}) + "\n")
            f.flush()
            if on_point:
                on_point(point, ms)
        result.revisited, result.spread = _revisit(timer, done, measured_now, cost, deadline, f)
    try:
        profile = _fit_profile(result, done, timer.engine.model.config, model_name=model_name,
                               gpu_name=timer.gpu_name, sm_count=timer.sm_count,
                               decode_partitions=timer.decode_partitions, decode_plan=timer.decode_plan, gemm=gemm,
                               prefill_plan=timer.prefill_plan)
    except ConfigError as exc:
        raise ConfigError(f"the budget ran out before the fit had its samples ({exc}); the {len(done)} samples "
                          f"measured are kept in {log_path}: run again with --resume, or a larger --budget-minutes"
                          ) from None
    if result.spread:
        profile.fit["repeat_spread_median"], profile.fit["repeat_spread_p90"] = result.spread_median, result.spread_p90
    save_profile(profile, out)
    result.elapsed_s = time.perf_counter() - started
    return result


def refit_profile(samples_path: Path, out: Path, model: ModelConfig, *, max_graph_batch: int = 256,
                  page_size: int = 16) -> ProfileResult:
    """Fit a profile again from a samples log, measuring nothing (after the model's form changed): the same fit,
    held-out scoring and file as a run, keeping the serving block of the profile the log sits beside. A log that
    predates recording the attention kernels' plans gets those a GPU engine with these defaults would have run
    (flashinfer's tensor-core decode for GQA groups of 3 or more, graphs up to `max_graph_batch`; FA3 prefill on
    Hopper)."""
    lines = samples_path.read_text(encoding="utf-8").splitlines() if samples_path.is_file() else []
    if not lines:
        raise ConfigError(f"{samples_path}: no samples log to refit")
    try:
        head = json.loads(lines[0])
    except json.JSONDecodeError:
        head = None
    if not isinstance(head, dict) or head.get("format") != SAMPLES_FORMAT or not all(
            k in head for k in ("model", "gpu", "sm_count", "decode_partitions")):
        raise ConfigError(f"{samples_path}: not a muxd profile samples log (its first line is not the header)")
    if head.get("shape") != model_shape(model):
        raise ConfigError(f"{samples_path}: measured for model shape {head.get('shape')}, not {model_shape(model)}")
    model = model.sharded(head.get("tensor_parallel_size", 1))  # the ranks' share, as it was measured
    done = read_samples(samples_path, head)
    if "decode_plan" in head:
        plan = DecodePlan.from_dict(head["decode_plan"]) if head["decode_plan"] else None
    elif head["gpu"] != "cpu" and model.num_heads // model.num_kv_heads not in CUDA_CORE_DECODE_GROUPS:
        plan = DecodePlan(head["sm_count"], model.num_kv_heads, page_size, tuple(capture_sizes(max_graph_batch)))
    else:
        plan = None
    result = ProfileResult(out, samples_path, resumed=len(done))
    gemm = GemmTable.from_dict(head["gemm"]) if head.get("gemm") else None
    if "prefill_plan" in head:
        prefill_plan = PrefillPlan.from_dict(head["prefill_plan"]) if head["prefill_plan"] else None
    else:  # Hopper's flashinfer ran FA3 prefill (for bf16 and fp16 models)
        prefill_plan = PrefillPlan(head["sm_count"], model.num_heads) if _hopper(head["gpu"]) else None
    profile = _fit_profile(result, done, model, model_name=head["model"], gpu_name=head["gpu"],
                           sm_count=head["sm_count"], decode_partitions=head["decode_partitions"], decode_plan=plan,
                           gemm=gemm, prefill_plan=prefill_plan)
    stem = samples_path.name.removesuffix(".samples.jsonl")  # OUT.samples.jsonl, or NAME.samples.jsonl of NAME.json
    for beside in (samples_path.with_name(stem), samples_path.with_name(stem + ".json")):
        if beside.is_file() and beside.suffix == ".json":
            try:
                profile.serving = read_profile(beside).serving
            except ConfigError as exc:
                log.warning("%s: its serving block is not kept (%s)", beside, exc)
            break
    save_profile(profile, out)
    return result


def _hopper(gpu_name: str) -> bool:
    """The GPU is one of the Hopper devices muxd knows (roofline.py)."""
    try:
        return device_spec(gpu_name) in (DEVICES["h100"], DEVICES["h200"])
    except ConfigError:
        return False


def _revisit(timer: StepTimer, done: dict[str, tuple[Point, float]], measured: Sequence[Point], cost: "_CostModel",
             deadline: float, log_file) -> tuple[int, list[float]]:
    """The host's speed changes in phases of seconds, and a short prefill or mixed step (its layers launched one by
    one) takes its time from the host: a point measured in a slow phase reads up to 1.7x its usual time. With the
    budget left after the grid, each such point is measured REVISITS more times, at moments spread over the rest
    of the run, and keeps the median. Returns the number of extra measurements and, per point measured more than
    once, how far its runs spread (slowest over fastest, - 1): on an idle host most agree within a few percent."""
    short = [p for p in measured if p.kind in ("prefill", "mixed") and done[p.key][1] < REVISIT_MS]
    runs = {p.key: [done[p.key][1]] for p in short}
    extra = 0

    def spread() -> list[float]:
        return [max(r) / min(r) - 1.0 for r in runs.values() if len(r) > 1 and min(r) > 0]

    for _ in range(REVISITS):
        for point in short:
            if time.perf_counter() + cost.estimate(point) > deadline:
                return extra, spread()
            ms = timer.measure(point)
            if ms is None:
                continue
            extra += 1
            runs[point.key].append(ms)
            done[point.key] = (point, statistics.median(runs[point.key]))
            log_file.write(json.dumps({**asdict(point), "ms": done[point.key][1], "runs": runs[point.key]}) + "\n")
            log_file.flush()
    return extra, spread()


class _CostModel:
    """How long measuring a point will take: the roofline prior's step time times the steps the point runs, scaled
    by how much longer than that the points of the same kind measured so far actually took."""

    OVERHEAD_S = 0.05

    def __init__(self, timer: StepTimer) -> None:
        try:
            spec = device_spec(timer.gpu_name)
        except ConfigError:
            spec = DEVICES["h100"]
        self.prior = Predictor.prior(timer.engine.model.config, spec)
        self.timer = timer
        self.scale: dict[str, list[float]] = {}

    def _raw(self, point: Point) -> float:
        p, t = self.prior, self.timer
        sms = min(point.sms, p.sm_count)
        if point.kind == "prefill":
            return p.prefill_ms(point.items, sms) / 1e3 * (t.reps + 1) + self.OVERHEAD_S
        if point.kind == "decode":
            return p.decode_ms(point.load, sms) / 1e3 * (t.decode_steps + 2) + self.OVERHEAD_S
        if point.kind == "mixed":
            return p.mixed_ms(point.items, point.load) / 1e3 * (t.reps + 1) + self.OVERHEAD_S
        steps = t.contended_steps + 2
        return (p.decode_ms(point.load, sms) * steps + p.prefill_ms(point.items, p.sm_count - sms) * 3) / 1e3 \
            + self.OVERHEAD_S

    def estimate(self, point: Point) -> float:
        seen = self.scale.get(point.kind)
        return self._raw(point) * (max(1.0, statistics.median(seen)) if seen else 2.0)

    def learn(self, point: Point, seconds: float) -> None:
        self.scale.setdefault(point.kind, []).append(seconds / self._raw(point))


# ---- serving calibration ---------------------------------------------------------------------------------------
