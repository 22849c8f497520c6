"""Where a served decode step's time goes beyond its graph: profile engine.step() (the overlapped loop, as `bench
engine` times it) against graph replays alone, at given (batch, context) points.

    PYTHONPATH=. python tests/gpu/step_profile.py [--model DIR] [--points 1@8192,1@1024,8@8192] [--steps 30]
        [--host N] [--prefill TOKENS]

Prints per point: wall ms a step, graph replay ms, device-busy ms a step (kernels + copies, union of intervals),
idle ms between device events, and the device events a step runs that the graph's replays do not (name, count a
step, ms a step), plus the largest idle gaps by the event before them. With `--host N`, also the N functions of
the engine's Python that take the most host time a step (cProfile over the same number of steps, run apart). With
`--prefill TOKENS`, also a prefill launch of that many new tokens through all layers, as `bench engine` times it:
its wall time and the functions taking the most host time in it (`--host N` of them, 25 by default)."""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from collections import defaultdict

import torch

from appliance.bench.ceilings import measure_ceilings, time_cuda
from appliance.bench.engine_bench import EngineBench, start_engine
from appliance.config import Config


def device(prof):
    cuda = torch.autograd.DeviceType.CUDA
    return sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events() if e.device_type == cuda))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="configs/models/llama-3.1-8b")
    ap.add_argument("--points", default="1@8192,1@1024,8@8192")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--host", type=int, default=0, help="print the N functions taking the most host time a step")
    ap.add_argument("--prefill", type=int, default=0, help="also profile a prefill launch of this many tokens")
    args = ap.parse_args()
    points = [tuple(int(x) for x in p.split("@")) for p in args.points.split(",") if p]
    config = Config.flat(max_num_seqs=max([b for b, _ in points] + [1]), max_num_batched_tokens=8192,
                         max_model_len=max([c for _, c in points] + [args.prefill]) + 1024)
    engine, _ = start_engine(args.model, "dummy", None, config)
    engine.kv_cache.data.normal_()
    bench = EngineBench(engine, measure_ceilings(), iters=args.steps * (2 if args.host else 1) + 10)
    graphs = engine.runner.graphs
    for batch, context in points:
        reqs = bench.seat(batch, context)
        size = graphs.padded_size(batch)
        try:
            for _ in range(5):
                engine.step()
            torch.cuda.synchronize()
            walls = []
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(args.steps):
                    t = time.perf_counter()
                    engine.step()
                    walls.append(time.perf_counter() - t)
                torch.cuda.synchronize()
            replay = time_cuda(lambda: graphs.replay(size)) * 1e3
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as gprof:
                for _ in range(args.steps):
                    graphs.replay(size)
                torch.cuda.synchronize()
            host = cProfile.Profile() if args.host else None
            if host is not None:
                host.enable()
                for _ in range(args.steps):
                    engine.step()
                host.disable()
        finally:
            bench.clear(reqs)
        ev, gev = device(prof), device(gprof)
        in_graph = defaultdict(int)
        for _, _, n in gev:
            in_graph[n] += 1
        step_counts = defaultdict(int)
        step_ms = defaultdict(float)
        for s, e, n in ev:
            step_counts[n] += 1
            step_ms[n] += (e - s) / 1e3
        busy, idle, end = 0.0, defaultdict(float), None
        prev = None
        for s, e, n in ev:
            if end is not None and s > end:
                idle[prev] += (s - end) / 1e3
            busy += max(0.0, e - max(s, end if end is not None else s)) / 1e3
            if end is None or e > end:
                end, prev = e, n
        span = (ev[-1][1] - ev[0][0]) / 1e3
        k = args.steps
        print(f"\n== b={batch} ctx={context}: wall {statistics.median(walls) * 1e3:.3f} ms a step (median), replay "
              f"{replay:.3f} ms, device span {span / k:.3f} ms a step, busy {busy / k:.3f}, idle "
              f"{sum(idle.values()) / k:.3f}")
        print("events outside the graph (count a step, ms a step):")
        for n in sorted(step_counts, key=lambda n: -step_ms[n]):
            extra = step_counts[n] - in_graph.get(n, 0)
            if extra > 0:
                print(f"  {extra / k:5.2f}  {step_ms[n] / k * extra / step_counts[n]:.4f}  {n[:110]}")
        print("largest idle time by the event before it (ms a step):")
        for n, ms in sorted(idle.items(), key=lambda x: -x[1])[:8]:
            print(f"  {ms / k:.4f}  {n[:110]}")
        if host is not None:
            print(f"host: the {args.host} functions taking the most time a step (cProfile, its own time):")
            print_host(host, args.host, k)
    if args.prefill:
        prefill(bench, args.prefill, args.steps, args.host or 25)


def print_host(profile: cProfile.Profile, top: int, k: int) -> None:
    stats = pstats.Stats(profile)
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:top]
    for (file, line, name), (_, calls, own, total, _) in rows:
        print(f"  {own / k * 1e3:.4f} ms own, {total / k * 1e3:.4f} ms with callees, {calls / k:6.1f} calls"
              f"  {file.rsplit('/', 2)[-1] if '/' in file else file}:{line}({name})")


def prefill(bench: EngineBench, tokens: int, launches: int, top: int) -> None:
    """A prefill launch of `tokens` new tokens through all layers, as `bench engine` times it: wall time, then
    the same launches under cProfile."""
    row = bench.prefill(tokens, 0)
    print(f"\n== prefill of {tokens} tokens: {row.ms:.3f} ms a launch ({row.note or 'eager'})")
    host = cProfile.Profile()
    bench.iters = launches * 5  # (bench.prefill times max(3, iters // 5) launches)
    host.enable()
    bench.prefill(tokens, 0)
    host.disable()
    print(f"host: the {top} functions taking the most time a launch (cProfile, its own time):")
    print_host(host, top, launches + 1)


if __name__ == "__main__":
    main()
