"""`muxd bench diagnose`: where a policy's time goes on the GPU. Replays a trace slice or a synthetic workload in
process (token-id prompts, dummy weights) and records every engine step — planning time, launch time, the plan's
mode, decode partition and prefill layers, the prefill launches in flight — every prefill launch's GPU time, and the
executor's timeline; writes them as JSON and prints a summary. With a profile it prints the serving factors too
(`write_serving` keeps them in a copy); from step and prefill logs alone it only calibrates.
"""
from __future__ import annotations

import bisect
import cProfile
import gzip
import io
import json
import pstats
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from appliance.bench.client import replay_in_process
from appliance.bench.prompts import PromptSynth
from appliance.bench.launcher import parse_serve_args as serve_flags
from appliance.config import EMBEDDED_MODEL_DIR
from appliance.config_flags import parse_serve_args
from appliance.engine.factory import build_engine
from appliance.engine.steplog import StepLog
from appliance.errors import ConfigError
from appliance.model_zoo.loader import load_model
from appliance.predictor.profile import ProfileFile, keepable, load_predictor, read_profile, save_profile
from appliance.predictor.split import MIN_OBSERVATIONS
from appliance.profile.calibrate import (BATCH_BINS, SPAN_BINS, full_prefill_factor, serving_factors,
                                         split_breakdown)
from appliance.workload import shaping as wl
from appliance.workload.metrics import summarize
from appliance.workload.traces import load_trace


@dataclass
class DiagnoseOptions:
    model: str = "configs/models/llama-3.1-8b"
    trace: str | None = None
    workload: str | None = None  # a named synthetic workload instead of a trace (workload/shaping.py PRESETS)
    n: int = 80
    skip: int = 0
    seed: int = 0  # a synthetic workload's draw
    max_idle: float | None = None
    rate: float = 2.0
    policy: str = "mux"
    slo: str | None = None
    profile: str | None = None
    chunk_budget: int | None = None
    mixed_chunks: bool = False
    max_model_len: int = 32768
    out: str = "gpu-results"
    device: str = "cuda"
    write_serving: str | None = None
    from_steps: list[str] = field(default_factory=list)
    from_prefills: list[str] = field(default_factory=list)
    from_results: list[str] = field(default_factory=list)
    serve_args: str | None = None  # more `muxd serve` flags for the engine (e.g. "--prefill-graph-rows 2048")
    host_profile: bool = False  # cProfile the engine's steps (slows the host: read it for shares, not times)


def diagnose(args: DiagnoseOptions) -> None:
    """Replay and report (or, with step/prefill logs or served replays' results, only calibrate)."""
    if args.from_results:
        if args.from_steps or args.from_prefills:
            raise ConfigError("calibrate from step and prefill logs or from results (--from-results), not both")
        calibrate_from_results(args, args.from_results)
        return
    if args.from_steps or args.from_prefills:
        calibrate(args, [s for path in args.from_steps for s in _log(path, "steps")],
                  [p for path in args.from_prefills for p in _log(path, "prefills")])
        return
    if bool(args.trace) == bool(args.workload):
        raise ConfigError("a replay needs a trace (--trace) or a synthetic workload (--workload), not both")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.workload:
        if args.skip:
            raise ConfigError("--skip slices a trace; another draw of a synthetic workload is --seed")
        prompt_len, output_len = (wl.LengthDist.parse(d) for d in wl.preset(args.workload))
        specs = wl.synthetic(args.n, args.rate, prompt_len, output_len, seed=args.seed)
    else:
        raw = load_trace(args.trace)
        specs = wl.select(wl.spread_ties(raw) if "mooncake" in args.trace else raw, skip=args.skip,
                          max_requests=args.n)
        specs = wl.retime(specs, rate=args.rate)
    specs, _ = wl.clip_to_context(specs, args.max_model_len - 1)
    cuda = args.device.startswith("cuda")
    model = load_model(EMBEDDED_MODEL_DIR if args.model == "embedded" else args.model, device=args.device,
                       load_format="dummy", dtype=None if cuda else "float32")
    synth = PromptSynth(vocab_size=model.config.vocab_size)
    prompts = [synth.token_ids(s, i) for i, s in enumerate(specs)]
    settings = dict(policy=args.policy, slo=args.slo, profile=args.profile, max_model_len=args.max_model_len,
                    chunk_budget=args.chunk_budget, mixed_chunks=args.mixed_chunks)
    config = parse_serve_args(serve_flags(args.serve_args), **settings)
    engine = build_engine(config, model)
    gpu = torch.cuda.get_device_name() if cuda else "cpu"
    predictor = load_predictor(args.profile, model.config, gpu) if args.profile else None
    log = StepLog(engine, predictor).attach()
    steps = log.steps

    profiler = _profile_steps(engine) if args.host_profile else None
    loop_cpu = time.thread_time()  # the replay's event loop runs in this thread, the engine in its own
    defaults = config.model.sampling_defaults()  # what the server fills in for a request that leaves it unset
    result = replay_in_process(engine, specs, prompts, max_idle=args.max_idle, defaults=defaults)
    loop_cpu = time.thread_time() - loop_cpu
    summary = summarize(result.timelines, result.duration)
    engine.executor.timeline.save(out / f"timeline-{args.policy}.json", last_seconds=30)
    (out / f"steps-{args.policy}.json").write_text(json.dumps(steps))
    (out / f"prefills-{args.policy}.json").write_text(json.dumps(log.prefills))
    (out / f"requests-{args.policy}.json").write_text(json.dumps(
        [{"arrival": t.arrival, "prompt_tokens": t.prompt_tokens, "token_times": t.token_times, "error": t.error,
          "index": t.index} for t in result.timelines]))
    stats = getattr(engine.scheduler.planner, "stats", None)
    print(f"{args.policy}: {len(specs)} requests at {args.rate} req/s, {len(steps)} steps, "
          f"{gpu}" + (f", sampling defaults {defaults}" if defaults else ""))
    for k in ("p50_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "p50_itl_ms", "p99_itl_ms"):
        print(f"  {k} {summary.get(k, float('nan')):.1f}")
    print("  modes", Counter(s["mode"] for s in steps))
    print("  decode_sms", Counter(s["decode_sms"] for s in steps))
    print("  layers per launch", Counter(s["layers"] for s in steps if s["layers"]))
    for k in ("plan_ms", "launch_ms"):
        vals = [s[k] for s in steps if k in s]
        print(f"  {k}: median {statistics.median(vals):.2f}, p99 {sorted(vals)[int(0.99 * len(vals))]:.2f}, "
              f"total {sum(vals) / 1e3:.1f} s of {result.duration:.1f} s")
    for kind in ("mixed", "decode"):  # host time between a busy step's launch and the next step's planning
        gaps = sorted(b["gap_ms"] for a, b in zip(steps, steps[1:]) if b.get("gap_ms") is not None and a["decode"]
                      and a["mixed"] == (kind == "mixed"))
        if gaps:
            print(f"  host after {kind} steps: {len(gaps)}, median {statistics.median(gaps):.2f} ms, "
                  f"p90 {gaps[int(0.9 * len(gaps))]:.2f}, p99 {gaps[int(0.99 * len(gaps))]:.2f}")
    timed = [s for s in steps if _timed_decode(s)]
    if timed:  # (CUDA only) what the host adds to a decode step: none once the loop hides it behind the device
        wall, dev = (statistics.fmean(s[k] for s in timed) for k in ("launch_ms", "device_ms"))
        own = statistics.fmean(_own_device_ms(s) for s in timed)
        print(f"  decode steps: {len(timed)}, mean wall {wall:.2f} ms, mean device {dev:.2f} ms "
              f"(wall / device {wall / dev:.3f}; {wall / own:.3f} counting a temporal step's prefill layers; "
              f"overlapped {sum(bool(s.get('overlapped')) for s in timed)})")
        for (lo, hi), (n, wall, dev, launch) in decode_by_batch(timed).items():
            print(f"    batch {lo}-{hi}: {n} steps, mean wall {wall:.2f} ms, mean device {dev:.2f} ms "
                  f"(wall / device {wall / dev:.3f}), launch's host time {launch:.2f} ms at the median")
        for kind, (n, wall, dev) in decode_by_previous(steps).items():
            print(f"    after {kind}: {n} steps, mean wall {wall:.2f} ms, mean device {dev:.2f} ms with its own "
                  f"prefill layers (wall / device {wall / dev:.3f})")
        for kind, (n, wall, dev, launch) in decode_by_next(steps).items():
            print(f"    before {kind}: {n} steps, mean wall {wall:.2f} ms, mean device {dev:.2f} ms with its own "
                  f"prefill layers (wall / device {wall / dev:.3f}), the next launch's host time {launch:.2f} ms "
                  "at the median")
    snapshot = engine.scheduler.planner.snapshot()
    if snapshot is not None:
        print("  planner", snapshot)
    elif stats is not None:
        print("  planner", {k: v for k, v in vars(stats).items() if k != "decode_sms"})
    print(f"  switches {engine.executor.switches}, layers launched {engine.executor.layers_launched}")
    streamed = sum(len(t.token_times) for t in result.timelines)
    if streamed and result.duration > 0:  # interpreter time the engine thread's launches may wait behind
        print(f"  event loop (replay and streams): {loop_cpu:.2f} s of CPU in {result.duration:.1f} s "
              f"({loop_cpu / result.duration:.0%}), {loop_cpu / streamed * 1e6:.0f} us a streamed token")
    _launch_host(steps)
    _mixed_host(steps)
    for kind, key in (("mixed", "mixed"), ("decode beside prefill", "beside"), ("decode alone", None)):
        rows = [s for s in steps if "pred_ms" in s and (
            s["mixed"] if key == "mixed" else (not s["mixed"] and bool(s.get("beside")) == (key is not None)))]
        if rows:
            wall = sorted(s["launch_ms"] / s["pred_ms"] for s in rows)
            print(f"  {kind}: {len(rows)} steps, wall / predicted median {statistics.median(wall):.2f}, "
                  f"p90 {wall[int(0.9 * len(wall))]:.2f}, p99 {wall[int(0.99 * len(wall))]:.2f}")
    for beside in (False, True):  # layer-wise prefill launches, GPU time over the profile's solo figure
        rows = [p for p in log.prefills if "pred_ms" in p and p["pred_ms"] > 0 and p["beside"] == beside]
        if rows:
            ratio = sorted(p["ms"] / p["pred_ms"] for p in rows)
            total = sum(p["ms"] for p in rows) / sum(p["pred_ms"] for p in rows)
            print(f"  prefill launches {'beside decode' if beside else 'alone'}: {len(rows)}, GPU / predicted "
                  f"median {statistics.median(ratio):.2f}, p90 {ratio[int(0.9 * len(ratio))]:.2f}, total {total:.2f}")
    if args.profile:
        calibrate(args, steps, log.prefills, result.timelines if args.policy == "serial" else ())
    if profiler is not None:
        _report_profile(profiler, out / f"host-profile-{args.policy}.pstats")


DECODE_BATCH_BINS = (1, 8, 32, 128)  # decode batch sizes: where the bins of `decode_by_batch` start


def decode_by_batch(steps: list[dict]) -> dict[tuple[int, int], tuple[int, float, float, float]]:
    """Decode steps timed on the device, by batch size (DECODE_BATCH_BINS; the last bin open): {(first, last batch
    size): (steps, mean wall ms, mean device ms, median host time of the launch)}. A wall above the device time
    in the big batches only says the host, not the GPU, sets their pace."""
    bins: dict[tuple[int, int], list[dict]] = {}
    top = max((s["decode"] for s in steps), default=0)
    ends = [b - 1 for b in DECODE_BATCH_BINS[1:]] + [top]
    for s in steps:
        i = bisect.bisect_right(DECODE_BATCH_BINS, s["decode"]) - 1
        if i >= 0:
            bins.setdefault((DECODE_BATCH_BINS[i], ends[i]), []).append(s)
    return {key: (len(rows), statistics.fmean(r["launch_ms"] for r in rows),
                  statistics.fmean(r["device_ms"] for r in rows),
                  statistics.median(r.get("host_launch_ms") or 0.0 for r in rows))
            for key, rows in sorted(bins.items())}


def decode_by_next(steps: list[dict]) -> dict[str, tuple[int, float, float, float]]:
    """Decode steps timed on the device, by the step launched after them: {"a decode step" or "a prefill launch":
    (steps, mean wall ms, mean device ms counting the step's own prefill layers after decode, median host time of
    the next step's launch)}. In the overlapped loop a step's tokens are read once the next launch returns: before
    a decode step a wall over the device time is the host falling behind; before a long prefill launch it is that
    launch, the device busy meanwhile."""
    bins: dict[str, list[tuple[dict, dict]]] = {}
    for step, nxt in zip(steps, steps[1:]):
        if _timed_decode(step):
            kind = "a prefill launch" if nxt["mixed"] or nxt.get("prefill_tokens") else "a decode step"
            bins.setdefault(kind, []).append((step, nxt))
    return {kind: (len(rows), statistics.fmean(s["launch_ms"] for s, _ in rows),
                   statistics.fmean(_own_device_ms(s) for s, _ in rows),
                   statistics.median(n.get("host_launch_ms") or 0.0 for _, n in rows))
            for kind, rows in sorted(bins.items())}


def decode_by_previous(steps: list[dict]) -> dict[str, tuple[int, float, float]]:
    """Decode steps timed on the device, by the step before them: {"a decode step" or "a prefill step" (mixed,
    temporal or launching prefill): (steps, mean wall ms, mean device ms counting the step's own prefill layers)}.
    The overlapped loop launches a step while the one before still runs, so after a longer step the rest of its
    device time lands in this step's wall: after decode steps alone is wall against device the host's share."""
    bins: dict[str, list[dict]] = {}
    for before, step in zip(steps, steps[1:]):
        if _timed_decode(step):
            plain = not before.get("mixed") and not before.get("prefill_tokens") and not before.get("after_ms")
            bins.setdefault("a decode step" if plain else "a prefill step", []).append(step)
    return {kind: (len(rows), statistics.fmean(s["launch_ms"] for s in rows),
                   statistics.fmean(_own_device_ms(s) for s in rows))
            for kind, rows in sorted(bins.items())}


def _timed_decode(step: dict) -> bool:
    """A decode step (no prefill in its forward) whose wall and device time the log has."""
    return bool(step.get("device_ms")) and bool(step["decode"]) and not step["mixed"] and "launch_ms" in step


def _own_device_ms(step: dict) -> float:
    """A decode step's kernels on the device, a temporal step's prefill layers after them included."""
    return step["device_ms"] + (step.get("after_ms") or 0.0)


def _launch_host(steps: list[dict]) -> None:
    """Print the host time of the steps' prefill launches, eager and replaying graphs apart, and a line through
    each: a fixed part per step's launches and a part per layer launched (what the host model's `launch_ms` and
    `per_layer_ms`, and their graph_ twins, stand for)."""
    for graphs in (False, True):
        rows = [(s["layers"], s["prefill_launch_ms"]) for s in steps if s.get("prefill_launch_ms") is not None
                and s.get("layers") and bool(s.get("prefill_graphs")) == graphs]
        if len(rows) < 2:
            continue
        layers, ms = (np.array(v, dtype=float) for v in zip(*rows))
        p10, p50, p90, p99 = np.percentile(ms, [10, 50, 90, 99])
        line = ""
        if np.ptp(layers) > 0:
            slope, fixed = np.polyfit(layers, ms, 1)
            line = f"; least squares {fixed:.2f} ms + {slope:.3f} ms a layer"
        print(f"  prefill launches' host time ({'replaying graphs' if graphs else 'eager'}): {len(rows)} steps, "
              f"p10 {p10:.2f} ms, median {p50:.2f}, p90 {p90:.2f}, p99 {p99:.2f}{line}")


def _mixed_host(steps: list[dict]) -> None:
    """Print the host time of launching the mixed steps (a prompt's layers in the decode step's forward), those
    replaying piecewise graphs and those launched eagerly apart, beside their device time: a mixed step whose launch
    takes the host about as long as its kernels take the GPU keeps the GPU waiting (a small model's, launched
    eagerly)."""
    for graphs in (True, False):
        rows = [s for s in steps if s.get("mixed") and s.get("host_launch_ms") is not None
                and bool(s.get("prefill_graphs")) == graphs]
        if not rows:
            continue
        host = np.percentile([s["host_launch_ms"] for s in rows], [50, 90])
        tokens = statistics.median(s["prefill_tokens"] for s in rows)
        device = [s["device_ms"] for s in rows if s.get("device_ms")]
        timed = f", device median {statistics.median(device):.2f} ms" if device else ""
        print(f"  mixed steps' launch host time ({'replaying graphs' if graphs else 'eager'}): {len(rows)} "
              f"step{'s' if len(rows) > 1 else ''}, "
              f"median {host[0]:.2f} ms, p90 {host[1]:.2f}{timed}; {tokens:.0f} prompt tokens at the median")


def _profile_steps(engine) -> cProfile.Profile:
    """Profile every `engine.step()`. Before Python 3.12 cProfile records the enabling thread only; from 3.12 on
    (it runs on `sys.monitoring`) every thread's calls while a step runs, the replay's event loop among them, and
    its counts of calls that overlap across threads read as recursion."""
    profiler, step = cProfile.Profile(), engine.step

    def profiled_step():
        profiler.enable()
        try:
            return step()
        finally:
            profiler.disable()

    engine.step = profiled_step
    return profiler


def _report_profile(profiler: cProfile.Profile, path: Path) -> None:
    profiler.dump_stats(str(path))
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(20)
    stats.sort_stats("cumulative").print_stats(30)
    print(f"  engine thread's host profile ({path}; cProfile slows the host, so read shares, not times):")
    print("\n".join(line for line in text.getvalue().splitlines() if line.strip()))


def calibrate(args: DiagnoseOptions, steps: list[dict], prefills: list[dict], serial_timelines=()) -> None:
    """Print the serving factors of `steps` (and prefill launches; a serial replay's first tokens) against the
    profile; with --write-serving, keep them in a copy of it."""
    if not args.profile:
        raise ConfigError("serving factors are measured against a profile: pass --profile")
    profile = read_profile(args.profile)
    predictor = profile.predictor(profile.model.shape["num_layers"], "profile")
    factors = {**full_prefill_factor(serial_timelines, predictor), **serving_factors(steps, predictor, prefills)}
    cells = split_breakdown(prefills, predictor)
    if cells:
        spans = [f"<{b:g}k" for b in SPAN_BINS] + [f">{SPAN_BINS[-1]:g}k"]
        batches = ([f"decode batch {'0' if b == 0 else f'<={b}'}" for b in BATCH_BINS]
                   + [f"decode batch >{BATCH_BINS[-1]}"])
        print("  the split's slowdown (measured / solo) by attention span and the decode beside it:")
        for (span, batch), (n, ratio, reused) in cells.items():
            print(f"    span {spans[span]:>6}, {batches[batch]:<18}: {ratio:.3f} over {n:.0f} launches "
                  f"({reused:.0%} of their tokens reused)")
    _keep(args, profile, factors)


def _read_json(path: str, flag: str) -> Any:
    """A JSON file, gzip-compressed where its name ends in .gz."""
    try:
        if path.endswith(".gz"):
            with gzip.open(path, "rt") as f:
                return json.load(f)
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{flag} {path}: cannot read it as JSON ({exc})") from None


def _log(path: str, kind: str) -> list[dict]:
    """A step or prefill-launch log: a JSON list (`muxd bench diagnose`'s, `muxd profile`'s calibration logs), or a
    result JSON of `muxd bench --in-process --save-steps` holding it under `kind`."""
    raw = _read_json(path, f"--from-{kind}")
    if isinstance(raw, dict) and raw.get("simulated"):
        raise ConfigError(f"--from-{kind} {path}: a simulated replay's log (`--simulate --save-steps`): its times "
                          "are the profile's own; calibrate from a served replay's")
    rows = raw.get(kind) if isinstance(raw, dict) else raw
    if not isinstance(rows, list):
        raise ConfigError(f"--from-{kind} {path}: neither a list of {kind} nor a result JSON with `{kind}` (a replay "
                          "of `muxd bench --in-process --save-steps`)")
    return rows


def split_from_results(paths: list[str]) -> dict[str, float]:
    """The split's slowdown that the mux planner learned online while serving (its `split` fit over the latest
    prefill launches, against the profile's solo figures), from replays' result JSONs (a point of `muxd bench
    sweep --in-process`, or the `planner` object of one): the observation-weighted mean of their flat parts and
    slopes, as prefill_split and prefill_split_per_1k. Replays shorter than MIN_OBSERVATIONS launches are left out."""
    flat = slope = weight = 0.0
    for path in paths:
        raw = _read_json(path, "--from-results")
        split = (raw.get("planner", raw) if isinstance(raw, dict) else {}).get("split")
        if not isinstance(split, dict) or not {"flat", "per_1k", "observations"} <= set(split):
            raise ConfigError(f"--from-results {path}: no mux planner's split fit in it (a result of a replay "
                              "served under --policy mux, with its `planner` object)")
        n = float(split["observations"])
        if n >= MIN_OBSERVATIONS:
            flat, slope, weight = flat + n * float(split["flat"]), slope + n * float(split["per_1k"]), weight + n
    if not weight:
        raise ConfigError(f"--from-results: no replay measured {MIN_OBSERVATIONS} or more split prefill launches")
    return {"prefill_split": flat / weight, "prefill_split_per_1k": slope / weight}


def calibrate_from_results(args: DiagnoseOptions, paths: list[str]) -> None:
    """Print (with --write-serving, keep in a copy of --profile) the split's slowdown learned while serving; the
    replays must have been served with that profile (their fits are against its solo figures)."""
    if not args.profile:
        raise ConfigError("serving factors are kept in a copy of a profile: pass --profile (the one the replays "
                          "were served with)")
    _keep(args, read_profile(args.profile), split_from_results(paths))


def _keep(args: DiagnoseOptions, profile: ProfileFile, factors: dict[str, float]) -> None:
    """Print `factors`; with --write-serving, write `profile` with those a profile may keep in its serving block (as
    `muxd profile`'s calibration keeps them)."""
    print("  serving factors (measured / profiled, total time):",
          ", ".join(f"{k} {v:.4g}" for k, v in factors.items()) or "too few steps")
    factors, dropped = keepable(factors)
    for why in dropped:
        print(f"  {why}")
    if args.write_serving:
        save_profile(profile.model_copy(update={"serving": {**profile.serving, **factors}}), args.write_serving)
        print(f"  wrote {args.write_serving}")
