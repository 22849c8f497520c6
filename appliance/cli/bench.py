"""`muxd bench`: the typer sub-app. `muxd bench [OPTIONS]` replays one workload (per policy with --policies);
`muxd bench sweep [OPTIONS]` searches the capacity (or measures the --rates given); `muxd bench compare` sets a
measured sweep beside a simulated one. Replay and sweep share the workload, target, SLO and output options.
"""
from __future__ import annotations

import itertools
import math
import time
from pathlib import Path
from typing import Any, Callable, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from appliance.bench import plots, report
from appliance.bench.rates import RatePlan, criteria, measure_rates, parse_rates
from appliance.bench.run import BenchOptions, Session, load_workload, prompt_synth, shape, variants
from appliance.bench.simulated import run_simulated, simulated_measures
from appliance.bench.sweep import SweepResult, find_capacity, write_summary
from appliance.cli.bench_options import BenchGroup, with_common_options
from appliance.errors import ConfigError
from appliance.workload import shaping as wl
from appliance.workload.metrics import RequestTimeline
from appliance.workload.traces import RequestSpec

app = typer.Typer(cls=BenchGroup, add_completion=False, pretty_exceptions_enable=False,
                  help="Replay a request trace (or a synthetic workload) against an OpenAI-compatible server, the "
                       "muxd appliance per scheduling policy, or the engine in process; report latency, SLO "
                       "attainment, goodput and capacity.")


def console() -> Console:
    """The terminal's console, sized as a command prints (not when muxd is imported)."""
    return Console()


def _workload(opts: BenchOptions) -> tuple[Any, list[RequestSpec]]:
    """The prompt builder and the requests, checked before any server starts."""
    synth = prompt_synth(opts)
    raw = load_workload(opts, synth)
    if synth is None and any(s.prompt is None for s in raw):
        raise ConfigError("--url: pass --tokenizer DIR (the served model's Hugging Face directory) so prompts of "
                          "the recorded lengths can be built")
    return synth, raw


def _prompts(synth: Any, specs: list[RequestSpec], salt: int = 0) -> list[str | list[int]]:
    return [s.prompt if synth is None else synth.prompt(s, i, salt) for i, s in enumerate(specs)]


def _replay(session: Session, specs: list[RequestSpec], prompts: list, show: bool, what: str):
    if not show:
        return session.replay(specs, prompts)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("failed {task.fields[failed]}"))
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(what, total=len(specs), failed=0)

        def done(t: RequestTimeline) -> None:
            bar.update(task, advance=1, failed=bar.tasks[task].fields["failed"] + (not t.success))

        return session.replay(specs, prompts, done)


def _timeline_plot(session: Session, out_dir: Path, notes: list[str]) -> None:
    url = session.target.base_url if hasattr(session.target, "base_url") else None
    events = plots.fetch_timeline(url) if url else None
    if events is None:
        notes.append("no SM-partition timeline: the target has no GET /debug/timeline")
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    if plots.timeline_plot(events, out_dir / f"timeline-{report.slug(session.label)}.png") is None:
        notes.append("GET /debug/timeline returned no span to draw")


def _targets(opts: BenchOptions) -> dict[str, float] | None:
    return opts.slo.targets_for(None) if opts.slo is not None else None


# Subcommands register on `app`: `sweep` below; `muxd bench engine` (engine_cli.py) and `muxd bench compare`
# (compare_cli.py) are added by appliance/cli/main.py; `--simulate` replays come from appliance/bench/simulated.py.
@app.callback(invoke_without_command=True)
@with_common_options
def bench(ctx: typer.Context, opts: BenchOptions) -> None:
    """Replay one workload and report latency, attainment and goodput (one column per --policies and --routers
    entry)."""
    if ctx.invoked_subcommand is not None:
        return
    _run_bench(ctx, opts)


def _run_bench(ctx: typer.Context, opts: BenchOptions) -> None:
    if opts.simulate:

        run_simulated(opts, opts.gpu, console())
        return
    show = ctx.params.get("progress", True)
    synth, raw = _workload(opts)
    results, runs = [], {}
    for policy, router in variants(opts):
        with Session(opts, policy, router) as session:
            specs, notes = shape(raw, opts, session.max_model_len)
            prompts = _prompts(synth, specs)
            result = _replay(session, specs, prompts, show, f"replaying on {session.label}")
            if opts.result_dir is not None and not opts.in_process:
                _timeline_plot(session, opts.result_dir, notes)
            results.append(session.summarize(result, specs, notes))
            runs[session.label] = result.timelines
    report.print_results(console(), results)
    if opts.result_dir is not None:
        paths = report.write_results(opts.result_dir, results, opts.result_filename, opts.append_result)
        paths += plots.latency_cdfs(runs, opts.result_dir, _targets(opts))
        console().print("wrote " + ", ".join(str(p) for p in paths))


@app.command()
@with_common_options
def sweep(
    ctx: typer.Context,
    opts: BenchOptions,
    attainment: float = typer.Option(0.9, help="Fraction of requests that must be good for a rate to pass (with a "
                                               "YAML contract, the stricter of this and the contract's own)."),
    rates: Optional[str] = typer.Option(None, help="Measure exactly these rates (req/s) instead of searching: "
                                                   "R1,R2,... for every policy, or per policy 'mux=2,3 chunked=1,1.5'. "
                                                   "Capacity: the highest passing rate, and the crossing interpolated "
                                                   "between it and the next failing rate."),
    start_rate: Optional[float] = typer.Option(None, help="First rate tried (default: the trace's own rate, "
                                                          "else 1 req/s)."),
    min_rate: Optional[float] = typer.Option(None, help="Lowest rate tried (default: the first rate / 64)."),
    max_rate: Optional[float] = typer.Option(None, help="Highest rate tried (default: no limit)."),
    tolerance: Optional[float] = typer.Option(None, help="Stop bisecting when (fail - pass) / pass is at most this "
                                                         "(default 0.05)."),
    max_points: Optional[int] = typer.Option(None, help="Replays at most, per policy (default 12)."),
) -> None:
    """Find the capacity: the highest request rate whose SLO attainment meets --attainment (needs --goodput or
    --slo), by bisection or at the --rates given; with --simulate on the simulated executor. Every point is written
    to summary.csv."""
    if opts.slo is None:
        raise ConfigError("muxd bench sweep needs an SLO: --goodput ttft:MS tpot:MS e2el:MS (or --slo FILE)")
    plan = _rate_plan(rates, {"--start-rate": start_rate, "--min-rate": min_rate, "--max-rate": max_rate,
                              "--tolerance": tolerance, "--max-points": max_points})
    conditions = criteria(attainment, opts.slo)
    target = conditions[0].target  # the stricter of --attainment and the contract's own: what a point must reach

    def passes(summary: dict[str, Any]) -> bool:
        return summary.get("contract_met", True)  # with a YAML contract, its percentile targets too

    def search(measure: Callable[[float], dict[str, Any]], label: str, policy: str | None, own: float) -> SweepResult:
        if plan is not None:
            return measure_rates(measure, plan.for_policy(policy), target, label, passes, conditions)
        first = start_rate or (own if math.isfinite(own) else 1.0)
        return find_capacity(measure, target, first, 0.05 if tolerance is None else tolerance,
                             12 if max_points is None else max_points, min_rate or first / 64,
                             math.inf if max_rate is None else max_rate, label=label, passes=passes)

    out_dir = opts.result_dir or Path(f"bench-sweep-{time.strftime('%Y%m%d-%H%M%S')}")
    if opts.simulate:
        sweeps = _simulated_sweep(opts, plan, search)
    else:
        sweeps = _served_sweep(opts, plan, search, ctx.params.get("progress", True))
    console().print(report.sweep_table(sweeps))
    for line in report.capacity_lines(sweeps):
        console().print(line)
    csv_path, json_path = write_summary(sweeps, out_dir, conditions, str(opts.trace) if opts.trace else "synthetic")
    png = plots.attainment_plot(sweeps, out_dir / "attainment_vs_rate.png")
    console().print(f"wrote {csv_path}, {json_path}, {png}")


def _rate_plan(rates: str | None, search_flags: dict[str, Any]) -> RatePlan | None:
    if rates is None:
        return None
    given = [flag for flag, value in search_flags.items() if value is not None]
    if given:
        raise ConfigError(f"--rates measures exactly the rates given, so it cannot go with the capacity search's "
                          f"{', '.join(given)}")
    return parse_rates(rates)


def _served_sweep(opts: BenchOptions, plan: RatePlan | None, search: Callable[..., SweepResult],
                  show: bool) -> list[SweepResult]:
    """Per policy, one server (or in-process engine) kept up for every rate of its sweep."""
    if plan is not None:
        plan.check(opts.policies)
    synth, raw = _workload(opts)
    sweeps = []
    for policy, router in variants(opts):
        with Session(opts, policy, router) as session:
            base, notes = shape(raw, opts, session.max_model_len)
            salts = itertools.count(1)

            def measure(rate: float) -> dict[str, Any]:
                specs = wl.retime(base, rate=rate, burstiness=opts.burstiness, seed=opts.seed)
                # fresh prompts per point: the server's prefix cache must not carry over from the previous point
                prompts = _prompts(synth, specs, next(salts))
                result = _replay(session, specs, prompts, show, f"{session.label} at {rate:.3g} req/s")
                for note in result.notes:  # failed requests and their commonest errors, short outputs, skips
                    console().print(f"[yellow]note ({session.label} at {rate:.3g} req/s): {note}[/yellow]")
                return session.summarize(result, specs, notes, rate)

            sweeps.append(search(measure, session.label, policy, wl.offered_rate(base)))
    return sweeps


def _simulated_sweep(opts: BenchOptions, plan: RatePlan | None,
                     search: Callable[..., SweepResult]) -> list[SweepResult]:
    """Per policy, replays on the simulated executor (no server, no GPU)."""

    measures, notes, own = simulated_measures(opts, opts.gpu)
    if plan is not None:
        plan.check([policy for policy, _ in measures])
    sweeps = [search(measure, policy, policy, own) for policy, measure in measures]
    for note in notes:
        console().print(f"[yellow]note: {note}[/yellow]")
    return sweeps

