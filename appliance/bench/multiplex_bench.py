"""`muxd bench engine --multiplex`: on each SM partition, the decode step (a CUDA graph captured on the partition's
decode stream) alone and while an 8k-token prefill runs on the partition's prefill stream, the graph memory of each
partition's graph set, and the cost of switching the decode partition between steps.

The contention slowdown per partition size is what the predictor's contention guard models.
"""
from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import asdict, dataclass

import numpy as np
import torch

from appliance.attention import ForwardContext, forward_context, make_backend
from appliance.bench.engine_bench import EngineBench, EngineBenchResult
from appliance.engine.graphs import DecodeGraphs
from appliance.engine.partitions import Partition, PartitionSet
from appliance.engine.request import Request, SamplingParams


@dataclass
class PartitionRow:
    partition: str
    decode_sms: int
    prefill_sms: int
    solo_ms: float
    contended_ms: float
    prefill_ms: float          # one prefill forward alone on the partition's prefill stream
    graph_memory_MiB: float
    capture_s: float

    @property
    def slowdown(self) -> float:
        return self.contended_ms / self.solo_ms


def _graph_set(bench: EngineBench, partition: Partition, batch: int, pool) -> DecodeGraphs:
    graphs = bench.engine.runner.graph_set(batch, stream=partition.decode_stream, pool=pool,
                                           sizes=[batch])  # one size per partition is enough to measure
    graphs.capture()
    return graphs


def _time_replays(graphs: DecodeGraphs, size: int, stream, n: int) -> list[float]:
    times = []
    with torch.cuda.stream(stream):
        for _ in range(n):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graphs.replay(size)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    return times


def _time_under_prefill(graphs: DecodeGraphs, size: int, stream, n: int, prefill_once) -> list[float]:
    """Decode replays timed while the prefill stream is busy the whole time: prefills are kept queued two deep,
    and a replay counts only if a prefill was still running when it ended."""
    pending: deque = deque()
    times = []
    while len(times) < n:
        while pending and pending[0].query():
            pending.popleft()
        while len(pending) < 2:
            pending.append(prefill_once())
        with torch.cuda.stream(stream):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graphs.replay(size)
            end.record()
        end.synchronize()
        if not pending[-1].query():
            times.append(start.elapsed_time(end))
    for event in pending:
        event.synchronize()
    return times


@torch.inference_mode()
def run(bench: EngineBench, partitions: PartitionSet, batch: int = 64, context: int = 1024,
        prefill_tokens: int = 8192, iters: int = 30) -> tuple[list[PartitionRow], dict]:
    engine, runner = bench.engine, bench.engine.runner
    reqs = bench.seat(batch, context)
    if isinstance(reqs, str):
        raise RuntimeError(f"decode batch {batch} x {context}: {reqs}")
    prefill_req = Request("bench-mux-prefill", np.random.default_rng(1).integers(3, 1000, prefill_tokens).tolist(),
                          SamplingParams(max_tokens=1))
    engine.scheduler.add(prefill_req)
    assert engine.scheduler.admit(prefill_req), "no room for the concurrent prefill"
    prefill_batch = runner.batches.build([prefill_req], [(0, prefill_tokens)])
    prefill_backend = make_backend(runner.backend_name, runner.model.config, runner.dtype, runner.device)
    spans = [(r.num_tokens - 1, r.num_tokens) for r in reqs]
    host = runner.batches.layout(reqs, spans)
    pool = torch.cuda.graph_pool_handle()
    rows, sets = [], {}
    try:
        for p in partitions.partitions:
            before = torch.cuda.memory_allocated()
            graphs = sets[p.name] = _graph_set(bench, p, batch, pool)
            memory = (torch.cuda.memory_allocated() - before) / 2**20
            with torch.cuda.stream(p.decode_stream):
                graphs.run(host, batch)  # plans the decode wrapper for this batch
            p.decode_stream.synchronize()  # torch.cuda.synchronize() does not wait for green-context streams
            solo = statistics.median(_time_replays(graphs, batch, p.decode_stream, iters))

            def prefill_once() -> torch.cuda.Event:
                with torch.cuda.stream(p.prefill_stream), forward_context(
                        ForwardContext(prefill_backend, prefill_batch.metadata, engine.kv_cache.data)):
                    hidden = runner.model.embed(prefill_batch.input_ids)
                    runner.model.forward_layers(prefill_batch.positions, hidden, None, 0, runner.num_layers)
                    done = torch.cuda.Event()
                    done.record()
                return done

            start_ev = torch.cuda.Event(enable_timing=True)
            start_ev.record(p.prefill_stream)
            prefill_once()
            end_ev = torch.cuda.Event(enable_timing=True)
            end_ev.record(p.prefill_stream)
            end_ev.synchronize()
            prefill_ms = start_ev.elapsed_time(end_ev)
            contended = _time_under_prefill(graphs, batch, p.decode_stream, iters, prefill_once)
            rows.append(PartitionRow(p.name, p.decode_sms, p.prefill_sms, solo, statistics.median(contended),
                                     prefill_ms, memory, graphs.capture_seconds))
        extras = _switch_cost(sets, partitions, host, batch)
    finally:
        bench.clear(reqs)
        engine.abort(prefill_req.request_id)
    extras["partition_create_ms"] = partitions.create_seconds * 1e3
    return rows, extras


def _switch_cost(sets: dict[str, DecodeGraphs], partitions: PartitionSet, host, batch: int) -> dict:
    """Cost of moving decode to another partition between steps: the wall time (launch to completion) of a step on
    partition a right after a step on b, minus the same after a step on a, for neighbouring splits."""
    by_name = {p.name: p for p in partitions.partitions}

    def step(name: str) -> float:
        p = by_name[name]
        start = time.perf_counter()
        with torch.cuda.stream(p.decode_stream):
            sets[name].run(host, batch)
        p.decode_stream.synchronize()
        return time.perf_counter() - start

    costs = []
    names = [p.name for p in partitions.splits]
    for a, b in zip(names[1:], names[:-1]):
        stay, moved = [], []
        for _ in range(10):
            step(a)
            stay.append(step(a))
            step(b)
            moved.append(step(a))
        costs.append(statistics.median(moved) - statistics.median(stay))
    return {"switch_cost_us_median": statistics.median(costs) * 1e6, "switch_cost_us_max": max(costs) * 1e6}


def render(rows: list[PartitionRow], extras: dict, batch: int, context: int, prefill_tokens: int) -> str:
    lines = [f"decode batch {batch} at context {context}; concurrent prefill of {prefill_tokens} tokens", "",
             "| partition | decode SMs | prefill SMs | decode solo ms | decode with prefill ms | slowdown | "
             "prefill ms | graph MiB |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r.partition} | {r.decode_sms} | {r.prefill_sms} | {r.solo_ms:.2f} | {r.contended_ms:.2f} | "
                     f"{r.slowdown:.2f}x | {r.prefill_ms:.1f} | {r.graph_memory_MiB:.0f} |")
    lines.append("")
    lines.append("extras: " + ", ".join(f"{k} {v:.1f}" for k, v in extras.items()))
    return "\n".join(lines)


def run_multiplex(result: EngineBenchResult, granularity: int, batch: int, context: int, prefill_tokens: int,
                  iters: int) -> str:
    """The --multiplex table on the engine `result` was measured with; also stored in result.extras."""

    partitions = PartitionSet.create(result.bench.engine.kv_cache.data.device, granularity)
    rows, extras = run(result.bench, partitions, batch, context, prefill_tokens, iters)
    result.extras["multiplex"] = {"rows": [dict(asdict(r), slowdown=r.slowdown) for r in rows], **extras}
    return (f"device: {result.ceilings['device']}\n\n"
            + render(rows, extras, batch, context, prefill_tokens))
