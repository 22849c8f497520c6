"""Where the host's time goes when the engine launches prefill layers on a partition's prefill stream: each launch's
host time (the call that queues its kernels, not waiting for them) for whole prompts of several sizes, eager
(per-layer compiled code) and replaying piecewise graphs, and the functions that time is spent in (cProfile).

    PYTHONPATH=. python tests/gpu/prefill_host_bench.py [--tokens 256,1024,2048] [--sms 100] [--graph-rows 2048]
        [--reps 20] [--profile-tokens 1024] [--busy 0.5] [--switch-interval-ms 0.5] [--queued-ms 20]
        [--queued-eager 4096:8] [--tp 2] [--json OUT]

Dummy weights, Llama-3.1-8B shapes by default. The device is synchronised before every launch, so a launch never
waits for a full launch queue: what is measured is the host's own work. `--queued-ms 20` then measures launches
again with 20 ms of device work (a spin kernel) queued first on the prefill stream, on the decode stream and on the
default stream, in turn: a launch whose host time grows with that work waits for the device somewhere (a
synchronising copy, a legacy-stream dependency), which a serving engine, whose streams are always busy, pays at every
launch; a torch.profiler table of the CUDA runtime calls of those launches says which call waits. `--busy F` runs
another Python thread that holds the interpreter for a fraction F of the time in 1 ms slices (as a serving process's
event loop streaming tokens does): launches that slow down with it are paying for the interpreter lock, not for the
device.
`--switch-interval-ms` sets the interpreter's switch interval (Python's default: 5 ms).
`--queued-eager T:L` also measures launches behind L layers of a T-token prompt launched eagerly just before them (as
a serving engine queues a long prompt's chunks): with `--tp 2` those chunks leave all-reduces outstanding on the
prefill communicator, uncaptured, when the graph replays with their captured all-reduces start. `--tp N` runs the
engine over N GPUs (tensor parallelism; rank 0's launches are timed).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import threading
import time

import torch

from appliance.config import Config
from appliance.engine.factory import build_engine
from appliance.engine.plan import PrefillWork, StepPlan
from appliance.profile.grid import Point
from appliance.profile.timer import StepTimer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="configs/models/llama-3.1-8b")
    ap.add_argument("--tokens", default="256,1024,2048")
    ap.add_argument("--sms", type=int, default=100, help="the prefill partition nearest this many SMs")
    ap.add_argument("--graph-rows", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--profile-tokens", type=int, default=1024)
    ap.add_argument("--busy", type=float, default=0.0, help="another thread holds the interpreter this share of time")
    ap.add_argument("--switch-interval-ms", type=float, default=None)
    ap.add_argument("--queued-ms", type=float, default=0.0,
                    help="also launch with this much device work queued first on each stream (0: not)")
    ap.add_argument("--queued-eager", default=None, metavar="TOKENS:LAYERS",
                    help="also launch behind LAYERS eager layers of a TOKENS-token prompt, launched just before")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (GPUs)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.switch_interval_ms:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    if args.busy > 0:
        threading.Thread(target=_busy, args=(args.busy,), daemon=True).start()
    cfg = Config.flat(model=args.model, load_format="dummy", max_num_seqs=64, max_model_len=32768,
                      enable_prefix_caching=False, multiplex=True, prefill_graph_rows=args.graph_rows,
                      tensor_parallel_size=args.tp)
    cfg.check()
    engine = build_engine(cfg)
    timer, executor = StepTimer(engine), engine.executor
    parts = executor.partitions
    part = min(parts.splits, key=lambda p: abs(p.prefill_sms - args.sms)) if parts.splits else parts.full
    layers = engine.model.config.num_layers
    requests = engine.scheduler.requests
    print(f"{torch.cuda.get_device_name()}: prefill on {part.prefill_sms} SMs, graphs up to {args.graph_rows} rows "
          f"(capture {engine.startup.get('prefill_graph_capture_s', 0):.1f} s)")

    cycles_per_ms = _spin_rate() if args.queued_ms > 0 else 0.0
    streams = {"prefill": part.prefill_stream, "decode": part.decode_stream,
               "default": torch.cuda.default_stream()}
    queued_cases = [*streams] if args.queued_ms > 0 else []
    if args.queued_eager:
        eager_tokens, eager_layers = (int(x) for x in args.queued_eager.split(":"))
        queued_cases.append("eager")

    def queue_eager() -> list:
        """Launch `eager_layers` layers of an `eager_tokens`-token prompt eagerly, without waiting for them."""
        reqs, works = timer._prefill_works(Point("prefill", part.prefill_sms, new=eager_tokens))
        graphs, engine.runner.use_graphs = engine.runner.use_graphs, False
        try:
            executor.start(StepPlan(prefill=(PrefillWork(works[0].request_id, 0, eager_tokens, 0, eager_layers),)),
                           requests, partition=part)
        finally:
            engine.runner.use_graphs = graphs
        return reqs

    cpu_ms: list[float] = []  # each timed launch's CPU time on this thread (the wall beyond it: blocked)

    def launch_ms(tokens: int, ranges: list[tuple[int, int]], profile: cProfile.Profile | None = None,
                  queued_on: str | None = None) -> list[float]:
        reqs, works = timer._prefill_works(Point("prefill", part.prefill_sms, new=tokens))
        rid = works[0].request_id
        out = []
        try:
            for start, end in ranges:
                plan = StepPlan(prefill=(PrefillWork(rid, 0, tokens, start, end),))
                torch.cuda.synchronize()
                if queued_on == "eager":
                    reqs += queue_eager()
                elif queued_on is not None:  # the device busy for args.queued_ms on that stream when the launch starts
                    with torch.cuda.stream(streams[queued_on] or torch.cuda.current_stream()):
                        torch.cuda._sleep(int(args.queued_ms * cycles_per_ms))
                if profile is not None:
                    profile.enable()
                began, cpu = time.perf_counter(), time.thread_time()
                executor.start(plan, requests, partition=part)
                out.append((time.perf_counter() - began) * 1e3)
                cpu_ms.append((time.thread_time() - cpu) * 1e3)
                if profile is not None:
                    profile.disable()
                timer._drain()
        finally:
            timer._clear(reqs)
        return out

    rows = []
    for tokens in [int(t) for t in args.tokens.split(",")]:
        for mode in ("graphs", "eager"):
            engine.runner.use_graphs = mode == "graphs"
            launch_ms(tokens, [(0, layers)])  # warm: plans, compiles this size
            whole, halves = [], []
            for _ in range(args.reps):
                whole += launch_ms(tokens, [(0, layers)])
                halves += launch_ms(tokens, [(0, layers // 2), (layers // 2, layers)])
            w, h = statistics.median(whole), statistics.median(halves)
            per_layer = (w - h) / (layers - layers // 2)  # a launch of L layers: fixed + L x per layer
            rows.append({"tokens": tokens, "mode": mode, "launch_ms": w, "half_launch_ms": h,
                         "per_layer_ms": per_layer, "fixed_ms": w - layers * per_layer,
                         "p90_launch_ms": sorted(whole)[int(0.9 * len(whole))]})
            r = rows[-1]
            print(f"{tokens:6d} tokens {mode:6s}: {layers} layers {w:6.2f} ms (p90 {r['p90_launch_ms']:.2f}), "
                  f"{layers // 2} layers {h:6.2f} ms -> {per_layer:.3f} ms a layer + {r['fixed_ms']:.2f} ms")
    queued = []
    if args.queued_ms > 0 or args.queued_eager:
        tokens = args.profile_tokens
        for mode in ("graphs", "eager"):
            engine.runner.use_graphs = mode == "graphs"
            launch_ms(tokens, [(0, layers)])
            for on in ("none", *queued_cases):
                times, cpu_ms[:] = [], []
                for _ in range(args.reps):
                    times += launch_ms(tokens, [(0, layers)], queued_on=None if on == "none" else on)
                behind = args.queued_eager if on == "eager" else args.queued_ms
                queued.append({"tokens": tokens, "mode": mode, "queued_on": on, "queued": behind,
                               "launch_ms": statistics.median(times), "max_launch_ms": max(times),
                               "cpu_ms": statistics.median(cpu_ms)})
                what = f"{args.queued_eager} eager tokens:layers" if on == "eager" else f"{args.queued_ms:g} ms on {on}"
                print(f"{tokens:6d} tokens {mode:6s}: behind {what:28s}: launch "
                      f"{queued[-1]['launch_ms']:6.2f} ms (max {queued[-1]['max_launch_ms']:.2f}), CPU "
                      f"{queued[-1]['cpu_ms']:6.2f} ms")
            # which CUDA runtime calls (cudaLaunchKernel, cudaMemcpyAsync, ...: recorded by the CUDA activity, with
            # their host time) those launches spend the host in, behind the eager layers or the decode stream busy
            activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=activities) as prof:
                for _ in range(5):
                    launch_ms(tokens, [(0, layers)], queued_on="eager" if args.queued_eager else "decode")
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
            queued.append({"tokens": tokens, "mode": mode, "api_table": table})
            busy = "behind eager layers" if args.queued_eager else "device busy on the decode stream"
            print(f"\n== torch.profiler, {tokens} tokens, {mode}, 5 launches, {busy}")
            print(table)
    profiles = {}
    for mode in ("graphs", "eager"):
        engine.runner.use_graphs = mode == "graphs"
        prof = cProfile.Profile()
        for _ in range(5):
            launch_ms(args.profile_tokens, [(0, layers)], prof)
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
        profiles[mode] = text.getvalue()
        print(f"\n== cProfile, {args.profile_tokens} tokens, {mode}, 5 launches of {layers} layers (tottime)")
        print("\n".join(text.getvalue().splitlines()[:45]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "prefill_sms": part.prefill_sms,
                       "graph_rows": args.graph_rows, "busy": args.busy,
                       "switch_interval_ms": sys.getswitchinterval() * 1e3, "rows": rows, "queued": queued,
                       "profiles": profiles}, f,
                  indent=1)


def _spin_rate() -> float:
    """Cycles of torch.cuda._sleep per millisecond on this device, measured."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / start.elapsed_time(end)


def _busy(share: float) -> None:
    """Hold the interpreter `share` of the time: pure-Python work in 1 ms slices, then sleep (which releases it)."""
    while True:
        end = time.perf_counter() + 1e-3
        n = 0
        while time.perf_counter() < end:
            n += 1
        time.sleep(max(0.0, 1e-3 * (1 - share) / share))


if __name__ == "__main__":
    main()
