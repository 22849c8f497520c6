"""`muxd bench engine`: decode step latency by batch and context, prefill time by new and cached tokens, eager vs
CUDA-graph decode, host overhead per step and start-up times, each against a floor from ceilings measured in the same
run (bytes moved over the copy bandwidth; model FLOPs over the bf16 GEMM rate). A decode row's host time is what the
step shows beyond its device time (wall minus the graph replayed alone, back to back), with the engine's loop
overlapped (its default) and, with `sync_rows`, synchronous for comparison.

Decode requests are seated with their context taken as already computed (random KV), so a row costs seconds, not a
prefill of its whole batch. A prefill row runs through the executor, as served: up to --prefill-graph-rows tokens
it replays the piecewise graphs (its note says so). With tensor parallelism (`-tp N`) every row runs through the
executor, which every rank follows, and the floors are one rank's: its share of the weights and KV on its GPU over the
copy bandwidth (FLOPs over the GEMM rate), plus what the rank sends over the link in the step's collectives (the
all-reduces of the embedding and of each layer's two row-parallel projections, the all-gather of the logits) over the
link's measured rate.
"""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable

import numpy as np
import torch

from appliance.bench.ceilings import Ceilings, measure_ceilings
from appliance.bench.kernel_roles import RoleRow, by_role, weight_floors
from appliance.config import Config
from appliance.engine.cuda_timing import time_cuda_queued
from appliance.engine.engine import Engine
from appliance.engine.factory import build_engine
from appliance.engine.plan import PrefillWork, StepPlan
from appliance.engine.request import Request, SamplingParams
from appliance.model_zoo.loader import load_model


@dataclass
class Row:
    kind: str                  # decode | decode-sync (the synchronous loop) | prefill | decode-eager
    label: str
    ms: float                  # median wall time of one engine step (decode) or one prefill forward + sampling
    floor_ms: float
    device_ms: float | None = None  # decode: replay of the captured graph alone, back to back
    host_ms: float | None = None    # decode: what the step shows beyond the device (wall minus device; without a
    # captured graph, the wall time not spent waiting for the device)
    busy_ms: float | None = None    # decode: host time per step not spent waiting for the device (hidden or not)
    note: str = ""

    @property
    def ratio(self) -> float:
        return self.ms / self.floor_ms


@dataclass
class KernelRow:
    name: str
    launches: float  # per step
    ms: float        # device time per step


@dataclass
class Kernels:
    """The kernels of one decode step (a graph replay) from the profiler: by name, heaviest first, against the
    replay's own time; what the kernels leave of it is the gaps between them."""

    label: str
    replay_ms: float
    rows: list[KernelRow]
    roles: list[RoleRow] | str = ""  # the same kernels by role against their floors (kernel_roles.py), or why not

    @property
    def kernel_ms(self) -> float:
        return sum(r.ms for r in self.rows)

    @property
    def launches(self) -> float:
        return sum(r.launches for r in self.rows)


@dataclass
class EngineBenchResult:
    ceilings: dict
    model: str
    startup: dict
    rows: list[Row] = field(default_factory=list)
    extras: dict = field(default_factory=dict)
    kernels: list[Kernels] = field(default_factory=list)
    bench: "EngineBench | None" = field(default=None, repr=False)  # the engine, for follow-up measurements

    def to_json(self) -> dict:
        return {"ceilings": self.ceilings, "model": self.model, "startup": self.startup, "extras": self.extras,
                "rows": [dict(asdict(r), ratio=r.ratio) for r in self.rows],
                "kernels": [dict(asdict(k), kernel_ms=k.kernel_ms, launches=k.launches) for k in self.kernels]}


def kernel_rows(events: Iterable[tuple[str, float]], steps: int, top: int = 15) -> list[KernelRow]:
    """(name, device ms) of every kernel run over `steps` steps -> per name, launches and ms per step, heaviest
    first; past `top` names the rest in one row."""
    totals: dict[str, list[float]] = {}
    for name, ms in events:
        t = totals.setdefault(name, [0, 0.0])
        t[0] += 1
        t[1] += ms
    rows = sorted((KernelRow(n, c / steps, ms / steps) for n, (c, ms) in totals.items()), key=lambda r: -r.ms)
    if len(rows) > top:
        rest = rows[top:]
        rows = rows[:top] + [KernelRow(f"({len(rest)} other kernels)", sum(r.launches for r in rest),
                                       sum(r.ms for r in rest))]
    return rows


def device_events(events: Iterable) -> list[tuple[str, float]]:
    """(name, ms) of the device-side events (kernels, copies) among a torch profiler's events, in the order they
    started."""
    cuda = torch.autograd.DeviceType.CUDA
    device = sorted((e for e in events if e.device_type == cuda), key=lambda e: e.time_range.start)
    return [(e.name, e.time_range.elapsed_us() / 1e3) for e in device]


@dataclass
class ModelCosts:
    weight_bytes: int          # bytes a decode step reads: every weight but the embedding table (unless tied)
    kv_bytes_per_token: int
    linear_params: int         # parameters of the per-token matmuls of the layers
    lm_head_params: int
    num_layers: int
    num_heads: int
    head_dim: int
    hidden_size: int = 0
    vocab_size: int = 0
    elem: int = 2
    tp_size: int = 1

    @classmethod
    def of(cls, engine: Engine) -> "ModelCosts":
        model, cfg = engine.model, engine.model.config
        elem = next(model.parameters()).element_size()
        embed = model.model.embed_tokens.weight
        total = sum(p.numel() for p in model.parameters())
        tied = model.lm_head is None
        weights = (total - (0 if tied else embed.numel())) * elem
        layer_linear = sum(m.weight.numel() for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear))
        kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * elem
        return cls(weights, kv, layer_linear, embed.numel(), cfg.num_layers, cfg.num_heads, cfg.head_dim,
                   cfg.hidden_size, cfg.vocab_size, elem, cfg.tp_size)

    def link_bytes(self, tokens: int, logit_rows: int) -> float:
        """Bytes one rank sends to the others in a forward of `tokens` tokens whose last `logit_rows` rows make
        logits (ring collectives: an all-reduce sends 2 (n - 1) / n of its tensor, an all-gather n - 1 shards)."""
        n = self.tp_size
        if n == 1:
            return 0.0
        reduced = (2 * self.num_layers + 1) * tokens * self.hidden_size * self.elem * 2 * (n - 1) / n
        gathered = (n - 1) * logit_rows * -(-self.vocab_size // n) * self.elem
        return reduced + gathered

    def decode_bytes(self, batch: int, context: int) -> int:
        return self.weight_bytes + batch * context * self.kv_bytes_per_token

    def prefill_flops(self, new: int, cached: int) -> float:
        linear = 2 * new * self.linear_params + 2 * self.lm_head_params  # logits of the last row only
        # QK^T and PV, causal: token i of the chunk attends to cached + i + 1 positions
        attended = new * cached + new * (new + 1) / 2
        return linear + 4 * self.num_layers * self.num_heads * self.head_dim * attended


def _random_prompt(rng: np.random.Generator, vocab: int, n: int) -> list[int]:
    return rng.integers(3, vocab, n).tolist()


class EngineBench:
    def __init__(self, engine: Engine, ceilings: Ceilings, iters: int = 20, warmup: int = 3) -> None:
        self.engine, self.ceilings = engine, ceilings
        self.costs = ModelCosts.of(engine)
        if self.costs.tp_size > 1 and ceilings.link_bytes_per_s is None:
            raise ValueError("a tensor-parallel engine's floors need the link between its GPUs measured "
                             "(measure_ceilings(gpus=N))")
        self.iters, self.warmup = iters, warmup
        self.rng = np.random.default_rng(0)
        self.vocab = engine.model.config.vocab_size

    def seat(self, batch: int, context: int) -> list[Request] | str:
        """`batch` decoding requests at `context` tokens (KV taken as computed), or why they do not fit."""
        pages_needed = batch * -(-(context + self.warmup + self.iters + 1) // self.engine.pool.page_size)
        if pages_needed > self.engine.pool.num_free_pages:
            gib = pages_needed * self.costs.kv_bytes_per_token * self.engine.pool.page_size / 2**30
            return f"needs {gib:.0f} GiB of KV, more than the pool holds"
        reqs = []
        for i in range(batch):
            r = Request(f"bench-{batch}-{context}-{i}", _random_prompt(self.rng, self.vocab, context),
                        SamplingParams(max_tokens=self.warmup + self.iters + 8, temperature=0, ignore_eos=True))
            self.engine.scheduler.add(r)
            if not self.engine.scheduler.seat_decoding(r):
                raise RuntimeError(f"could not seat request {i} of a {batch} x {context} decode batch")
            reqs.append(r)
        return reqs

    def clear(self, reqs: list[Request]) -> None:
        for r in reqs:
            self.engine.abort(r.request_id)

    def kernels(self, batch: int, context: int, replays: int = 20) -> Kernels | str:
        """The decode graph's kernels at this batch and context (`replays` replays under the profiler), or why
        there are none (no captured graph of that size, a batch the pool cannot hold)."""
        graph_set = self.engine.runner.graphs
        size = graph_set.padded_size(batch) if graph_set is not None else None
        if size is None or self.engine.model.config.tp_size > 1:
            return f"no decode graph of batch {batch} on one GPU"
        reqs = self.seat(batch, context)
        if isinstance(reqs, str):
            return reqs
        try:
            for _ in range(self.warmup):  # the graph's inputs: this batch's
                self.engine.step()
            replay_ms = time_cuda_queued(lambda: graph_set.replay(size)) * 1e3
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(replays):
                    graph_set.replay(size)
                torch.cuda.synchronize()
        finally:
            self.clear(reqs)
        events = device_events(prof.events())
        model = self.engine.model
        head = (model.lm_head if model.lm_head is not None else model.model.embed_tokens).weight
        floors = weight_floors(model.model.layers, head.numel() * head.element_size(),
                               batch * context * self.costs.kv_bytes_per_token, self.ceilings.copy_bytes_per_s)
        return Kernels(f"decode b={batch} ctx={context}", replay_ms, kernel_rows(events, replays),
                       by_role(events, replays, self.costs.num_layers, floors))

    def _link_s(self, tokens: int, logit_rows: int) -> float:
        """Seconds the step's collectives take at the link's measured rate (0 on one GPU)."""
        sent = self.costs.link_bytes(tokens, logit_rows)
        return sent / self.ceilings.link_bytes_per_s if sent else 0.0

    def decode(self, batch: int, context: int, graphs: bool = True, overlap: bool | None = None) -> Row:
        """A decode row; `overlap` False runs the engine's synchronous loop (None: as the engine is configured)."""
        label = f"decode b={batch} ctx={context}"
        floor = (self.costs.decode_bytes(batch, context) / self.ceilings.copy_bytes_per_s
                 + self._link_s(batch, batch)) * 1e3
        kind = "decode" if graphs else "decode-eager"
        overlapping = self.engine.async_scheduling
        if overlap is not None:
            self.engine.async_scheduling = overlap
            kind = kind if overlap else "decode-sync"
        reqs = self.seat(batch, context)
        if isinstance(reqs, str):
            self.engine.async_scheduling = overlapping
            return Row(kind, label, float("nan"), floor, note=reqs)
        runner = self.engine.runner
        runner.use_graphs = graphs
        try:
            for _ in range(self.warmup):
                self.engine.step()
            walls, hosts = [], []
            for _ in range(self.iters):
                wait0, start = runner.gpu_wait_s, time.perf_counter()
                self.engine.step()
                wall = time.perf_counter() - start
                walls.append(wall)
                hosts.append(wall - (runner.gpu_wait_s - wait0))
            device = None
            graph_set = runner.graphs
            alone = self.engine.model.config.tp_size == 1  # a graph replayed on one rank alone would wait forever
            if alone and graphs and graph_set is not None and graph_set.padded_size(batch) is not None:
                device = time_cuda_queued(lambda: graph_set.replay(graph_set.padded_size(batch))) * 1e3
        finally:
            runner.use_graphs = True
            self.clear(reqs)
            self.engine.async_scheduling = overlapping
        ms, busy = statistics.median(walls) * 1e3, statistics.median(hosts) * 1e3
        return Row(kind, label, ms, floor, device_ms=device, host_ms=ms - device if device is not None else busy,
                   busy_ms=busy, note="" if self.engine.async_scheduling or kind == "decode-sync" else "sync loop")

    def prefill(self, new: int, cached: int) -> Row:
        label = f"prefill new={new} cached={cached}"
        floor = (self.costs.prefill_flops(new, cached) / self.ceilings.gemm_flops_per_s + self._link_s(new, 1)) * 1e3
        engine = self.engine
        if cached + new + 1 > engine.max_model_len:
            return Row("prefill", label, float("nan"), floor, note=f"longer than max_model_len {engine.max_model_len}")
        r = Request(f"bench-prefill-{new}-{cached}", _random_prompt(self.rng, self.vocab, cached + new),
                    SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        engine.scheduler.add(r)
        if not engine.scheduler.admit(r):
            engine.abort(r.request_id)
            return Row("prefill", label, float("nan"), floor, note="the KV pool cannot hold it")
        r.num_computed_tokens = cached  # the prefix's KV is taken as cached (random contents)
        plan = StepPlan(prefill=(PrefillWork(r.request_id, cached, cached + new, 0, engine.model.num_layers),))
        try:
            _execute(engine, plan)
            times = []
            for _ in range(max(3, self.iters // 5)):
                torch.cuda.synchronize()
                start = time.perf_counter()
                _execute(engine, plan)
                times.append(time.perf_counter() - start)
        finally:
            engine.abort(r.request_id)
        graphs = new <= engine.prefill_graph_rows  # (padded to a captured size, as a served launch is)
        return Row("prefill", label, statistics.median(times) * 1e3, floor,
                   note="piecewise graphs" if graphs else "")


def _execute(engine: Engine, plan: StepPlan) -> None:
    """Run a plan to its end through the executor, as the engine serves it (the other ranks follow it under tensor
    parallelism): a prefill of up to --prefill-graph-rows tokens replays the piecewise graphs."""
    engine.executor.launch(plan, engine.scheduler.requests)
    while engine.executor.has_inflight():
        engine.executor.wait()
        engine.executor.poll()


def start_engine(model_dir: str, load_format: str, dtype: str | None, config: Config) -> tuple[Engine, dict]:
    start = time.perf_counter()
    if config.parallel.tensor_parallel_size > 1:  # every rank loads its own share while the engine starts
        engine = build_engine(config.replace(model=str(model_dir), load_format=load_format, dtype=dtype or "auto",
                                             device="cuda"))
        load_s = 0.0
    else:
        model = load_model(model_dir, dtype=dtype, device="cuda", load_format=load_format,
                           overrides=config.model.config_overrides())
        torch.cuda.synchronize()
        load_s = time.perf_counter() - start
        start = time.perf_counter()
        engine = build_engine(config, model)
    startup = {"load_s": load_s, "engine_init_s": time.perf_counter() - start, **engine.startup,
               "attention_backend": engine.runner.backend_name, "decode_kernel": engine.runner.decode_kernel,
               "decode_blas": engine.runner.decode_blas,
               "fused_rope": engine.model.model.rotary.cos_sin is not None, "compiled": engine.compiled,
               "kv_pages": engine.pool.num_pages}
    return engine, startup


def run(model_dir: str, *, load_format: str = "dummy", dtype: str | None = None, batches=(1, 8, 32, 64, 128),
        contexts=(1024, 8192), prefills=((512, 0), (2048, 0), (8192, 0), (2048, 8192), (2048, 32768)),
        iters: int = 20, config: Config | None = None, startup_only: bool = False,
        sync_rows: bool = False, kernels: Iterable[tuple[int, int]] = ()) -> EngineBenchResult:
    """`sync_rows`: each decode row also with the engine's synchronous loop (kind decode-sync), for comparison;
    `kernels`: (batch, context) of decode steps whose kernels the profiler breaks down."""
    ceilings = measure_ceilings(gpus=config.parallel.tensor_parallel_size if config is not None else 1)
    config = config or Config.flat(max_num_seqs=max(batches), max_num_batched_tokens=max(n for n, _ in prefills),
                                    max_model_len=max(n + c for n, c in prefills) + 64)
    engine, startup = start_engine(model_dir, load_format, dtype, config)
    if engine.kv_cache.data.is_cuda:
        engine.kv_cache.data.normal_()  # random KV: never time attention over uninitialised memory
    result = EngineBenchResult(ceilings.as_dict(), str(model_dir), startup)
    bench = EngineBench(engine, ceilings, iters=iters)
    result.bench = bench
    if startup_only:
        return result
    for context in contexts:
        for batch in batches:
            result.rows.append(bench.decode(batch, context))
            if sync_rows:
                result.rows.append(bench.decode(batch, context, overlap=False))
    eager = bench.decode(1, contexts[0], graphs=False)
    result.rows.append(eager)
    graph_row = next((r for r in result.rows if r.kind == "decode" and r.label == f"decode b=1 ctx={contexts[0]}"
                      and r.ms), None)
    if graph_row is not None and eager.ms:  # (batches without one row: no graph row to compare with)
        result.extras["graph_speedup_b1"] = eager.ms / graph_row.ms
    for new, cached in prefills:
        result.rows.append(bench.prefill(new, cached))
    if engine.runner.graphs is not None:
        result.extras["graph_memory_MiB"] = engine.runner.graphs.memory_bytes / 2**20
    for batch, context in kernels:
        try:
            found = bench.kernels(batch, context)
        except RuntimeError as exc:  # (a profiler that cannot trace here costs the breakdown, not the rows above)
            found = f"the profiler failed: {exc}"
        if isinstance(found, str):
            result.extras[f"kernels b={batch} ctx={context}"] = found
        else:
            result.kernels.append(found)
    return result


def render(result: EngineBenchResult) -> str:
    """The result as a Markdown table (what docs/PERFORMANCE.md carries)."""
    c = result.ceilings
    link = f", GPU-to-GPU link {c['link_GBps']:.0f} GB/s (one way)" if "link_GBps" in c else ""
    lines = [f"device: {c['device']}; copy {c['copy_TBps']:.2f} TB/s (read+write), bf16 GEMM "
             f"{c['gemm_TFLOPps']:.0f} TFLOP/s{link}, measured in this run", "",
             "| row | measured ms | floor ms | ratio | device ms | host ms | host busy ms | note |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in result.rows:
        ratio = f"{r.ratio:.2f}x" if r.ms == r.ms else "-"
        if r.kind == "prefill" and r.ms == r.ms:
            ratio += f" ({100 / r.ratio:.0f}% of GEMM rate)"
        suffix = {"decode-eager": " (eager)", "decode-sync": " (sync loop)"}.get(r.kind, "")
        lines.append(f"| {r.label}{suffix} | "
                     f"{'-' if r.ms != r.ms else f'{r.ms:.2f}'} | {r.floor_ms:.2f} | {ratio} | "
                     f"{'' if r.device_ms is None else f'{r.device_ms:.2f}'} | "
                     f"{'' if r.host_ms is None else f'{r.host_ms:.2f}'} | "
                     f"{'' if r.busy_ms is None else f'{r.busy_ms:.2f}'} | {r.note} |")
    lines.append("")
    lines.append("start-up: " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                                         for k, v in result.startup.items()))
    if result.extras:
        lines.append("extras: " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k}: {v}"
                                            for k, v in result.extras.items()))
    for k in result.kernels:
        lines += ["", f"kernels of {k.label}: {k.launches:.0f} a step, {k.kernel_ms:.2f} ms of them in a "
                      f"{k.replay_ms:.2f} ms replay (between them: {k.replay_ms - k.kernel_ms:.2f} ms)", "",
                  "| kernel | launches a step | ms a step | share of the replay |", "| --- | ---: | ---: | ---: |"]
        lines += [f"| `{r.name[:90]}` | {r.launches:.0f} | {r.ms:.3f} | {100 * r.ms / k.replay_ms:.1f} % |"
                  for r in k.rows]
        lines += [""] + _role_lines(k)
    return "\n".join(lines)


def _role_lines(k: Kernels) -> list[str]:
    if isinstance(k.roles, str):
        return [f"by role: {k.roles}" if k.roles else "by role: -"]
    lines = [f"by role ({k.label}; floor: the bytes each role reads over the copy bandwidth):", "",
             "| role | launches a step | ms a step | floor ms | ratio |", "| --- | ---: | ---: | ---: | ---: |"]
    for r in k.roles:
        floor, ratio = ("", "") if r.ratio is None else (f"{r.floor_ms:.3f}", f"{r.ratio:.2f}x")
        lines.append(f"| {r.role} | {r.launches:.0f} | {r.ms:.3f} | {floor} | {ratio} |")
    lines.append(f"| between kernels | | {k.replay_ms - k.kernel_ms:.3f} | | |")
    return lines


def save(result: EngineBenchResult, path: str | Path) -> None:
    Path(path).write_text(json.dumps(result.to_json(), indent=2))
