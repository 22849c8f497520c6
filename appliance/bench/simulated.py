"""`muxd bench --simulate`: capacity planning without a GPU. Replays the workload per policy on the simulated
executor (the profile's predictor as the clock), judges each replay against the SLO contract, searches each
policy's capacity, and prints one table; `muxd bench sweep --simulate` takes its replays from here too."""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Callable

from rich.console import Console
from rich.table import Table

from appliance.bench.capacity import PolicyRun, SimulatedBench, kv_pages
from appliance.bench.run import BenchOptions, load_workload, model_dir, shape
from appliance.bench.simulate import ServingClock, SimConfig
from appliance.bench.sweep import SweepResult
from appliance.config import POLICIES, Config, SchedulerSettings
from appliance.config_flags import parse_serve_args
from appliance.engine.compile import cache_dir
from appliance.errors import ConfigError
from appliance.model_zoo.config import ModelConfig
from appliance.model_zoo.loader import resolve_model_dir
from appliance.predictor.catalog import find_profile
from appliance.predictor.predictor import Predictor
from appliance.predictor.profile import load_predictor
from appliance.predictor.roofline import DEVICES, DeviceSpec, device_spec
from appliance.slo.contract import Contract, default_contract
from appliance.workload import shaping as wl
from appliance.workload.metrics import detailed_arrays
from appliance.workload.traces import RequestSpec

DEFAULT_POLICIES = ("mux", "chunked", "serial")
Measure = Callable[[float], dict[str, Any]]


def simulated_bench(opts: BenchOptions, gpu: str) -> tuple[SimulatedBench, ModelConfig, list[str]]:
    """The simulation of `opts.model` on `gpu` under the options' contract; notes say what it rests on."""
    contract = opts.slo if isinstance(opts.slo, Contract) else None
    if opts.slo is not None and contract is None:
        raise ConfigError("--simulate judges replays against an SLO contract: pass --slo FILE (not --goodput)")
    contract = contract or default_contract()
    # the serve flags a simulation honours: the scheduler's (chunked's token budget, mux's adaptive chunks, ...) and
    # the tensor-parallel degree (each rank's share of the model, its collectives, its KV pool)
    serve = parse_serve_args(list(opts.serve_args))
    options, tp = serve.scheduler, serve.parallel.tensor_parallel_size
    model = ModelConfig.from_file(resolve_model_dir(model_dir(opts.model_or_default)) / "config.json",
                                  serve.model.config_overrides()).sharded(tp)
    profile = opts.profile
    if profile is None:  # as `muxd serve` does: the profile cached by `muxd profile`, or shipped, for this GPU
        profile = find_profile(model, gpu, cache_dir(), by_kind=True)
    predictor = load_predictor(profile, model, gpu)
    # the engine's loop: overlapped unless told otherwise
    predictor.host = predictor.host.with_loop(serve.runtime.async_scheduling)
    # prefill launches up to the engine's graph size replay graphs on a GPU (the host's cheaper launches)
    predictor.host = predictor.host.with_graphs(serve.captured_graph_rows(model))
    try:
        device = device_spec(gpu)
    except ConfigError:
        device = DEVICES["h100"]
    truth = host = None
    if opts.planner_prior:  # the GPU and host as profiled; the planner knows only the prior, as a server without one
        prior = Predictor.prior(model, device)
        if predictor.source == prior.source:
            raise ConfigError(f"--planner-prior plans with the roofline prior against a profiled GPU, and there is no "
                              f"profile of this model on {gpu}: give --profile")
        truth, host = ServingClock(predictor), predictor.host
        prior.host = prior.host.with_loop(host.overlapped).with_graphs(host.graph_rows)
        predictor = prior
    clocked = truth.predictor if truth is not None else predictor
    serving = ", ".join(f"{k} {v:.1f} ms" if k == "mixed_floor" else f"{k} x{v:.2f}"
                        for k, v in sorted(clocked.serving.items()))
    clock = (f"clock: {clocked.source}; planner: {predictor.source} (--planner-prior)" if truth is not None
             else f"clock and planner: {predictor.source}")
    notes = [clock + (f"; the clock runs serving-calibrated ({serving})" if serving else ""), *clocked.notes,
             f"contract {contract.name!r}: p{contract.slo_for(None).tbt_percentile:g} TBT "
             f"{contract.slo_for(None).tbt_ms:g} ms, attainment {contract.attainment:.0%}"]
    if tp > 1:
        notes.append(f"tensor parallelism over {tp} GPUs (--tensor-parallel-size): each step is one rank's share "
                     "plus its all-reduces and the logits' all-gather")
    if options.chunk_budget is not None:
        notes.append(f"chunked budget {options.chunk_budget} tokens (--chunk-budget)")
    if options.mixed_chunks:
        notes.append("mux takes TBT-sized mixed chunks where they prefill faster than the split (--mixed-chunks)")
    if not options.temporal_prefill:
        notes.append("mux keeps prefill on the SM split (--no-temporal-prefill)")
    if opts.device_error:
        if not -0.9 < opts.device_error < 10:
            raise ConfigError(f"--device-error must be in (-0.9, 10), got {opts.device_error}")
        notes.append(f"model error injected: the simulated GPU takes {1 + opts.device_error:.2f}x the profile's "
                     "times (the planner is not told)")
    if opts.device_spread:
        if not 0 < opts.device_spread < 0.5:
            raise ConfigError(f"--device-spread must be in [0, 0.5), got {opts.device_spread:g}")
        notes.append(f"each point judged over three replays, the simulated GPU as profiled, {opts.device_spread:.0%} "
                     f"slower and {opts.device_spread:.0%} faster, pooled (--device-spread; 0: one replay)")
    if opts.host_error:
        if not -0.9 < opts.host_error < 10:
            raise ConfigError(f"--host-error must be in (-0.9, 10), got {opts.host_error}")
        notes.append(f"host error injected: the simulated host takes {1 + opts.host_error:.2f}x the host model's "
                     "times (the planner is not told)")
    if opts.host_spread:
        if not 0 < opts.host_spread <= 2:
            raise ConfigError(f"--host-spread must be in (0, 2], got {opts.host_spread}")
        notes.append(f"each prefill launch takes a lognormal multiple (sigma {opts.host_spread:g}) of the host "
                     "model's time, as on a serving host (--host-spread; the planner is not told; 0: the model's)")
    sim = sim_config(serve, model, device)
    if (sim.max_num_seqs, sim.max_waiting) != (256, 4096) or not sim.enable_prefix_caching:
        notes.append(f"engine limits from --serve-args: {sim.max_num_seqs} sequences at once, {sim.max_waiting} "
                     f"waiting, prefix caching {'on' if sim.enable_prefix_caching else 'off'}")
    return SimulatedBench(contract, predictor, sim, options=options,
                          device_error=opts.device_error, host_error=opts.host_error,
                          host_spread=opts.host_spread, device_spread=opts.device_spread,
                          save_steps=opts.save_steps, truth=truth, host=host), model, notes


def sim_config(serve: Config, model: ModelConfig, device: DeviceSpec) -> SimConfig:
    """The simulated engine's KV pool and limits as `muxd serve` with these flags would have them: pages from
    --num-gpu-blocks-override, else --kv-cache-memory, else --gpu-memory-utilization of the GPU less the weights;
    --block-size, --max-num-seqs, --max-waiting and prefix caching as given."""
    cache, sched = serve.cache, serve.scheduler
    pages = cache.num_gpu_blocks_override or kv_pages(model, device, page_size=cache.block_size,
                                                      utilization=cache.gpu_memory_utilization,
                                                      budget_bytes=cache.kv_cache_bytes)
    return SimConfig(num_pages=pages, page_size=cache.block_size, max_num_seqs=sched.max_num_seqs,
                     max_waiting=sched.max_waiting, enable_prefix_caching=cache.enable_prefix_caching)


def _prepare(opts: BenchOptions, gpu: str) -> tuple[list[str], SimulatedBench, list[RequestSpec], list[str]]:
    """The policies, the simulation, the shaped workload (clipped to what the KV pool holds) and notes."""
    policies = opts.policies or list(DEFAULT_POLICIES)
    for p in policies:
        if p not in POLICIES:
            raise ConfigError(f"--policies must name policies among {', '.join(POLICIES)}, got {p!r}")
    bench, model, notes = simulated_bench(opts, gpu)
    raw = load_workload(opts, None)
    max_len = min(model.max_position_embeddings, bench.sim.num_pages * bench.sim.page_size)
    specs, shaped_notes = shape(raw, opts, max_len)
    notes += shaped_notes
    measured = getattr(bench.predictor.latency, "measured", None)
    longer = sum(s.prompt_len > measured.kv for s in specs) if measured is not None else 0
    if longer:
        notes.append(f"{longer} of {len(specs)} prompts are longer than the profile measured ({measured.kv} tokens): "
                     "their prefill times scale from that edge as the roofline prior does (profile longer prompts "
                     "with `muxd profile --trace` of this workload)")
    if "pdmux" in policies:
        groups = "; ".join(g.describe() for g in bench.planner("pdmux").groups)
        notes.append(f"pdmux stream groups (SGLang's prefill/decode SMs -> muxd's): {groups}")
    if "chunked" in policies and (bench.options is None or bench.options.chunk_budget is None):
        slo = bench.contract.slo_for(None)
        compare = "not always chunked's best: compare budgets with --serve-args \"--chunk-budget N\""
        if math.isfinite(wl.offered_rate(specs)):
            notes.append(f"chunked budget {bench.tune_chunk_budget(specs)} tokens (the largest, in steps of 128, "
                         f"whose replay of this workload at its own times keeps p{slo.tbt_percentile:g} TBT <= "
                         f"{slo.tbt_ms:g} ms; {compare})")
        else:  # every request at once: a budget tuned on that burst would be the least one, whatever the rate
            budget = bench.idle_chunk_budget()
            bench.options = dataclasses.replace(bench.options or SchedulerSettings(), chunk_budget=budget)
            notes.append(f"chunked budget {budget} tokens (the largest whose step keeps TBT <= {slo.tbt_ms:g} ms on "
                         "an idle GPU, as `muxd serve --policy chunked` takes it: this workload has no arrival "
                         f"times to tune on, --request-rate gives it some; {compare})")
    return policies, bench, specs, notes


def simulated_measures(opts: BenchOptions, gpu: str) -> tuple[list[tuple[str, Measure]], list[str], float]:
    """For `muxd bench sweep --simulate`: per policy, measure(rate) -> the summary of a simulated replay of the
    workload re-timed to `rate` (as a real sweep re-times it); notes on what the simulation rests on; the
    workload's own rate."""
    policies, bench, specs, notes = _prepare(opts, gpu)

    def measure_for(policy: str) -> Measure:
        def measure(rate: float) -> dict[str, Any]:
            retimed = wl.retime(specs, rate=rate, burstiness=opts.burstiness, seed=opts.seed)
            budget = {"chunk_budget": bench.options.chunk_budget} if policy == "chunked" and bench.options else {}
            run = bench.run(policy, retimed)
            detail = detailed_arrays(run.result.timelines) if opts.save_detailed else {}
            return dict(run.report.summary, request_rate=rate, **budget, **detail)
        return measure

    return [(policy, measure_for(policy)) for policy in policies], notes, wl.offered_rate(specs)


def run_simulated(opts: BenchOptions, gpu: str, console: Console) -> list[dict[str, Any]]:
    """Replay per policy at the options' rate, then search each policy's capacity; prints and returns summaries."""
    policies, bench, specs, notes = _prepare(opts, gpu)
    offered = wl.offered_rate(specs)
    start = offered if math.isfinite(offered) and offered > 0 else 1.0
    summaries, tried = [], []
    table = _table(bench.contract, len(specs), offered)
    logs = {}
    for policy in policies:
        run = bench.run(policy, specs)
        sweep = bench.capacity(policy, specs, start_rate=start)
        summaries.append(_summary(run, sweep))
        if opts.save_steps:
            logs[policy] = {"steps": run.result.step_log, "prefills": run.result.prefill_log, "simulated": True}
        table.add_row(*_cells(run, sweep))
        tried.append(f"{policy}: " + ", ".join(f"{p.rate:.3g} {'met' if p.passed else 'missed'}"
                                              for p in sorted(sweep.points, key=lambda p: p.rate)))
    console.print(table)
    for line in tried:
        console.print(f"rates tried, {line}")
    for note in notes:
        console.print(f"[yellow]note: {note}[/yellow]")
    if opts.result_dir is not None:
        opts.result_dir.mkdir(parents=True, exist_ok=True)
        path = opts.result_dir / "simulated.json"
        path.write_text(json.dumps({"notes": notes, "results": summaries}, indent=2, default=str))
        console.print(f"wrote {path}")
        for policy, log in logs.items():
            (opts.result_dir / f"steps-{policy}.json").write_text(json.dumps(log, default=str))
    return summaries


def _table(contract: Contract, count: int, offered: float) -> Table:
    slo = contract.slo_for(None)
    table = Table(title=f"muxd bench --simulate: {count} requests at {offered:.3g} req/s, contract {contract.name!r}",
                  title_justify="left")
    for col in ("policy", "p99 TTFT (ms)", f"p{slo.tbt_percentile:g} TBT (ms)", "attainment", "contract",
                "capacity (req/s)"):
        table.add_column(col, justify="left" if col in ("policy", "contract") else "right")
    return table


def _cells(run: PolicyRun, sweep: SweepResult) -> list[str]:
    r = run.report
    capacity = "none" if sweep.capacity is None else f"{sweep.capacity:.3g}" + ("" if sweep.bracketed else "+")
    return [run.policy, f"{r.summary['p99_ttft_ms']:.0f}", f"{r.tbt_ms:.1f}", f"{r.attainment:.1%}",
            "met" if r.met else "missed: " + ", ".join(k if k == "attainment" else k.upper() for k in r.misses),
            capacity]


def _summary(run: PolicyRun, sweep: SweepResult) -> dict[str, Any]:
    out = {k: v for k, v in run.report.summary.items() if not isinstance(v, (list, dict))}
    out.update(capacity=sweep.capacity, capacity_bracketed=sweep.bracketed,
               capacity_points=[{"request_rate": p.rate, "passed": p.passed, "slo_attainment": p.attainment}
                                for p in sweep.points])
    if hasattr(run.planner, "stats"):
        out[f"{run.policy}_stats"] = {k: v for k, v in vars(run.planner.stats).items() if not isinstance(v, dict)}
    return out


