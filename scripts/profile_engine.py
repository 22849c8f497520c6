"""Where a decode step's time goes on the GPU: the kernels of one step (torch.profiler, eager and graph replay), the
host's Python profile of steady-state steps, and microbenchmarks of the decode attention kernels and a GEMV.

    python scripts/profile_engine.py [--model configs/models/llama-3.1-8b] [--batches 1,64] [--context 1024]
"""
from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from appliance.bench.ceilings import measure_ceilings, time_cuda
from appliance.bench.engine_bench import EngineBench, build_engine
from appliance.engine.engine import EngineConfig


def kernel_table(engine, steps: int) -> str:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=90)


def host_breakdown(engine, steps: int) -> str:
    """Wall time of each host phase of a step (perf_counter around the engine's own functions), per step."""
    import time
    from collections import defaultdict

    totals: dict[str, float] = defaultdict(float)
    runner, sched = engine.runner, engine.scheduler
    wrapped = []

    def wrap(obj, name, label):
        inner = getattr(obj, name)

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                totals[label] += time.perf_counter() - t
        setattr(obj, name, timed)
        wrapped.append((obj, name))

    graphs = runner.graphs
    size = graphs.padded_size(len(sched.decoding))
    wrap(sched, "schedule", "schedule (planner)")
    wrap(runner.batches, "build", "batch build")
    wrap(graphs._graphs[size][1], "prepare", "attention plan")
    wrap(graphs._graphs[size][0], "replay", "graph launch")
    wrap(sched, "update", "scheduler update")
    wrap(engine, "_output", "outputs + detokenize")
    import appliance.engine.runner as runner_mod
    inner_sample = runner_mod.sample_tensor

    def timed_sample(*a, **k):
        t = time.perf_counter()
        try:
            return inner_sample(*a, **k)
        finally:
            totals["sampling launch"] += time.perf_counter() - t
    runner_mod.sample_tensor = timed_sample
    wait0 = runner.gpu_wait_s
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = time.perf_counter() - start
    runner_mod.sample_tensor = inner_sample
    for obj, name in wrapped:
        del obj.__dict__[name]
    wait = runner.gpu_wait_s - wait0
    lines = [f"step wall {wall / steps * 1e3:.3f} ms, waiting for the device {wait / steps * 1e3:.3f} ms, "
             f"host {(wall - wait) / steps * 1e3:.3f} ms"]
    lines += [f"  {k}: {v / steps * 1e3:.3f} ms" for k, v in totals.items()]
    return "\n".join(lines)


def attention_microbench(cfg, batch: int, context: int, copy_bw: float) -> str:
    import flashinfer

    heads, kv_heads, dim, page = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, 16
    pages = batch * context // page
    cache = torch.randn(pages, 2, page, kv_heads, dim, dtype=torch.bfloat16, device="cuda")
    q = torch.randn(batch, heads, dim, dtype=torch.bfloat16, device="cuda")
    indptr = torch.arange(0, pages + 1, context // page, dtype=torch.int32)
    indices = torch.randperm(pages, dtype=torch.int32)
    last = torch.full((batch,), page, dtype=torch.int32)
    lines = []
    for tc in (False, True):
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(torch.zeros(128 << 20, dtype=torch.uint8, device="cuda"),
                                                          "NHD", use_tensor_cores=tc)
        w.plan(indptr, indices, last, heads, kv_heads, dim, page, q_data_type=torch.bfloat16)
        t = time_cuda(lambda: w.run(q, cache), iters=50)
        kv_bytes = cache.numel() * 2
        lines.append(f"decode attention b={batch} ctx={context} tensor_cores={tc}: {t * 1e6:.1f} us, "
                     f"{kv_bytes / t / 1e12:.2f} TB/s ({kv_bytes / t / copy_bw:.2f} of copy)")
    return "\n".join(lines)


def gemv_microbench(cfg, copy_bw: float) -> str:
    lines = []
    for m in (1, 64):
        for n, k in ((cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size), (2 * cfg.intermediate_size, cfg.hidden_size),
                     (cfg.hidden_size, cfg.intermediate_size), (cfg.vocab_size, cfg.hidden_size)):
            ws = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") for _ in range(4)]
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            i = iter(range(10**9))
            t = time_cuda(lambda: torch.nn.functional.linear(x, ws[next(i) % 4]), iters=40)
            lines.append(f"linear m={m} [{n}x{k}]: {t * 1e6:.1f} us, {n * k * 2 / t / 1e12:.2f} TB/s "
                         f"({n * k * 2 / t / copy_bw:.2f} of copy)")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="configs/models/llama-3.1-8b")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--context", type=int, default=1024)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    ceilings = measure_ceilings()
    print(ceilings.as_dict())
    engine, startup = build_engine(args.model, "dummy", None, EngineConfig(max_num_seqs=max(batches),
                                                                           max_prefill_tokens=2048))
    print(startup)
    engine.kv_cache.data.normal_()
    cfg = engine.model.config
    print(attention_microbench(cfg, 64, args.context, ceilings.copy_bytes_per_s))
    print(gemv_microbench(cfg, ceilings.copy_bytes_per_s))
    bench = EngineBench(engine, ceilings, iters=150)
    for b in batches:
        reqs = bench.seat(b, args.context)
        for graphs in (False, True):
            engine.runner.use_graphs = graphs
            for _ in range(3):
                engine.step()
            print(f"==== kernels, batch {b}, graphs={graphs} (3 steps)")
            print(kernel_table(engine, 3))
        print(f"==== host breakdown, batch {b}, graphs (100 steps)")
        print(host_breakdown(engine, 100))
        bench.clear(reqs)


if __name__ == "__main__":
    main()
