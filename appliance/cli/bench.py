"""`muxd bench`: the typer sub-app. `muxd bench [OPTIONS]` replays one workload (per policy with --policies);
`muxd bench sweep [OPTIONS]` searches the capacity (or measures the --rates given); `muxd bench compare` sets a
measured sweep beside a simulated one. Replay and sweep share the workload, target, SLO and output options.
"""
from __future__ import annotations

import functools
import inspect
import itertools
import math
import time
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from appliance.bench import plots, report
from appliance.bench.launcher import parse_policies, parse_serve_args
from appliance.bench.rates import RatePlan, criteria, measure_rates, parse_rates
from appliance.bench.run import BenchOptions, Session, load_workload, prompt_synth, shape
from appliance.bench.simulated import run_simulated, simulated_measures
from appliance.bench.sweep import SweepResult, find_capacity, write_summary
from appliance.errors import ApplianceError, ConfigError
from appliance.slo.contract import load_contract
from appliance.workload import shaping as wl
from appliance.workload.metrics import METRIC_NAMES, SLO, RequestTimeline, parse_goodput
from appliance.workload.traces import FORMATS, RequestSpec

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False,
                  help="Replay a request trace (or a synthetic workload) against an OpenAI-compatible server, the "
                       "muxd appliance per scheduling policy, or the engine in process; report latency, SLO "
                       "attainment, goodput and capacity.")
console = Console()
_W, _T, _S, _O = "Workload", "Target", "SLO", "Output"

# name -> (annotated type, default); shared by `muxd bench` and `muxd bench sweep`
COMMON: dict[str, tuple[Any, Any]] = {
    "trace": (Annotated[Optional[Path], typer.Option("--trace", "--dataset-path",
                                                     help="Trace file (Azure or BurstGPT CSV, Mooncake JSONL, "
                                                          "ShareGPT JSON); omit for a synthetic workload.",
                                                     rich_help_panel=_W)], None),
    "trace_format": (Annotated[str, typer.Option("--trace-format", "--dataset-name", help=f"auto, "
                                                 f"{', '.join(FORMATS)}; random: a synthetic workload.",
                                                 rich_help_panel=_W)], "auto"),
    "num_prompts": (Annotated[int, typer.Option(help="Synthetic: number of requests.", rich_help_panel=_W)], 100),
    "workload": (Annotated[Optional[str], typer.Option(help="A named synthetic workload instead of a trace: "
                                                          "chat-short (prompts lognormal, median 1,000 tokens; outputs "
                                                          "lognormal, median 250; Poisson arrivals unless "
                                                          "--burstiness). Sets --input-len and --output-len.",
                                                     rich_help_panel=_W)], None),
    "input_len": (Annotated[str, typer.Option("--input-len", "--random-input-len",
                                              help="Synthetic prompt tokens: N, uniform:LO:HI or "
                                                   "lognormal:MEDIAN:SIGMA.", rich_help_panel=_W)], "256"),
    "output_len": (Annotated[str, typer.Option("--output-len", "--random-output-len",
                                               help="Synthetic output tokens (same forms as --input-len).",
                                               rich_help_panel=_W)], "64"),
    "window": (Annotated[Optional[str], typer.Option(help="Part of the trace to replay, START:END seconds from its "
                                                          "start (e.g. 600:900).", rich_help_panel=_W)], None),
    "skip": (Annotated[int, typer.Option(help="Skip this many requests first.", rich_help_panel=_W)], 0),
    "max_requests": (Annotated[Optional[int], typer.Option(help="Replay at most this many requests.",
                                                           rich_help_panel=_W)], None),
    "request_rate": (Annotated[Optional[float], typer.Option(help="Re-time to this average rate (req/s), keeping "
                                                                 "the trace's burst pattern; 'inf' sends all at "
                                                                 "once. Default: the trace's own times (synthetic: "
                                                                 "inf).", rich_help_panel=_W)], None),
    "speedup": (Annotated[Optional[float], typer.Option(help="Replay the trace this many times faster.",
                                                        rich_help_panel=_W)], None),
    "burstiness": (Annotated[float, typer.Option(help="Gamma shape of synthetic gaps (1 = Poisson, < 1 burstier, "
                                                      "inf = constant).", rich_help_panel=_W)], 1.0),
    "seed": (Annotated[int, typer.Option(help="Seed of arrivals, lengths and prompts.", rich_help_panel=_W)], 0),
    "max_model_len": (Annotated[Optional[int], typer.Option(help="Clip requests to this context (default: what "
                                                                 "the server reports).", rich_help_panel=_W)], None),
    "url": (Annotated[Optional[str], typer.Option("--url", "--base-url",
                                                  help="Base URL of a running OpenAI-compatible server (e.g. "
                                                       "http://127.0.0.1:8000); default: start muxd serve.",
                                                  rich_help_panel=_T)], None),
    "endpoint": (Annotated[str, typer.Option(help="completions or chat.", rich_help_panel=_T)], "completions"),
    "served_model_name": (Annotated[Optional[str], typer.Option(help="Model name to send (default: the first of "
                                                                     "GET /v1/models).", rich_help_panel=_T)], None),
    "model": (Annotated[Optional[str], typer.Option("--model", "-m", help="Model directory (or 'embedded') to serve "
                                                                          "when muxd bench starts the server; also "
                                                                          "the tokenizer source.",
                                                    rich_help_panel=_T)], None),
    "tokenizer": (Annotated[Optional[str], typer.Option(help="Hugging Face directory whose tokenizer builds "
                                                             "exact-length prompts (needed with --url unless the "
                                                             "trace records prompt texts).",
                                                        rich_help_panel=_T)], None),
    "policies": (Annotated[Optional[str], typer.Option(help="Comma-separated scheduling policies: start muxd serve "
                                                            "once per policy and compare them.",
                                                       rich_help_panel=_T)], None),
    "serve_args": (Annotated[Optional[str], typer.Option(help="Extra `muxd serve` flags for the server bench starts "
                                                              "or the in-process engine, e.g. '--max-num-seqs 64 "
                                                              "--load-format dummy'.", rich_help_panel=_T)], None),
    "in_process": (Annotated[bool, typer.Option("--in-process", help="Drive the engine in this process (no HTTP).",
                                                rich_help_panel=_T)], False),
    "ready_timeout": (Annotated[float, typer.Option(help="Seconds to wait for a started server's /ready.",
                                                    rich_help_panel=_T)], 600.0),
    "temperature": (Annotated[float, typer.Option(help="Sampling temperature sent with every request.",
                                                  rich_help_panel=_T)], 0.0),
    "max_concurrency": (Annotated[Optional[int], typer.Option(help="Requests in flight at most (latency then "
                                                                   "counts from the send).",
                                                              rich_help_panel=_T)], None),
    "request_timeout": (Annotated[Optional[float], typer.Option(help="Seconds after which a request counts as "
                                                                     "failed.", rich_help_panel=_T)], None),
    "max_idle": (Annotated[Optional[float], typer.Option(help="While no request is in flight, wait at most this "
                                                              "many seconds for the next arrival and move the rest "
                                                              "of the schedule earlier (latencies are unchanged, "
                                                              "times reported on the trace's clock): long replays "
                                                              "at low rates take their busy time only.",
                                                         rich_help_panel=_T)], None),
    "goodput": (Annotated[Optional[list[str]], typer.Option(help="vLLM-style SLO, a request is good when it meets "
                                                                 "every target: ttft:MS tpot:MS e2el:MS (repeat the "
                                                                 "flag or quote them together).",
                                                            rich_help_panel=_S)], None),
    "slo": (Annotated[Optional[Path], typer.Option(help="YAML SLO contract (per-request targets).",
                                                   rich_help_panel=_S)], None),
    "metric_percentiles": (Annotated[str, typer.Option(help="Percentiles to report, comma-separated.",
                                                       rich_help_panel=_S)], "50,90,99"),
    "percentile_metrics": (Annotated[str, typer.Option(help="Metrics whose percentiles are reported, "
                                                             "comma-separated among ttft, tpot, itl, e2el.",
                                                        rich_help_panel=_S)], ",".join(METRIC_NAMES)),
    "result_dir": (Annotated[Optional[Path], typer.Option(help="Write result JSON, plots (and sweep summary.csv) "
                                                               "here.", rich_help_panel=_O)], None),
    "save_result": (Annotated[bool, typer.Option("--save-result", help="Write the result JSON (to --result-dir, "
                                                                       "else the current directory).",
                                                 rich_help_panel=_O)], False),
    "result_filename": (Annotated[Optional[str], typer.Option(help="File name of the result JSON of a single run "
                                                                   "(default: result.json).", rich_help_panel=_O)],
                        None),
    "save_detailed": (Annotated[bool, typer.Option("--save-detailed", help="Add per-request arrays to the JSON "
                                                                           "(ttfts, itls, input/output lens).",
                                                   rich_help_panel=_O)], False),
    "spread_ties": (Annotated[bool, typer.Option("--spread-ties", help="Spread requests that share a timestamp "
                                                                       "(traces recorded in coarse steps, e.g. "
                                                                       "Mooncake's 3 s) over the gap to the next.",
                                                 rich_help_panel=_W)], False),
    "simulate": (Annotated[bool, typer.Option("--simulate", help="No server and no GPU: replay each --policies "
                                                                 "entry on the simulated executor, judge it against "
                                                                 "--slo and search its capacity.",
                                              rich_help_panel=_T)], False),
    "profile": (Annotated[Optional[Path], typer.Option(help="--simulate: latency profile of --model on --gpu "
                                                            "(default: the roofline prior).",
                                                       rich_help_panel=_T)], None),
    "gpu": (Annotated[str, typer.Option(help="--simulate: the GPU to plan for (h100, h200).", rich_help_panel=_T)],
            "h100"),
    "device_error": (Annotated[float, typer.Option(help="--simulate: model error injected, the simulated GPU runs "
                                                        "(1 + this) x the profile's times (0.2: 20 % slower, -0.2: "
                                                        "20 % faster); the planner is not told.",
                                                   rich_help_panel=_T)], 0.0),
    "progress": (Annotated[bool, typer.Option("--progress/--no-progress", help="Show a progress bar.",
                                              rich_help_panel=_O)], True),
}


def with_common_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """Give a command the COMMON options (typer reads the signature); they reach it as one BenchOptions `opts`."""
    sig = inspect.signature(func)
    own = [p for name, p in sig.parameters.items() if name != "opts"]
    shared = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)
              for name, (annotation, default) in COMMON.items()]
    ctx = [p for p in own if p.annotation is typer.Context]
    rest = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own if p.annotation is not typer.Context]

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        common = {name: kwargs.pop(name) for name in COMMON}
        try:
            opts = _options(**common)
            return func(*args, opts=opts, **kwargs)
        except ApplianceError as exc:
            typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
            raise typer.Exit(code=2) from None

    del wrapper.__wrapped__
    wrapper.__signature__ = sig.replace(parameters=ctx + rest + shared)  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in ctx + rest + shared}
    return wrapper


def _options(**kw: Any) -> BenchOptions:
    """Flags -> BenchOptions, refusing contradictory combinations before anything starts."""
    if kw["simulate"] and (kw["url"] or kw["in_process"]):
        raise ConfigError("--simulate replays on the simulated executor; --url and --in-process run a real one")
    if kw["url"] and (kw["policies"] or kw["in_process"]):
        raise ConfigError("--url targets a running server; --policies and --in-process start their own")
    if kw["serve_args"] and kw["url"]:
        raise ConfigError("--serve-args configures the muxd serve that bench starts (or --in-process), not --url")
    if kw["endpoint"] not in ("completions", "chat"):
        raise ConfigError(f"--endpoint must be completions or chat, got {kw['endpoint']!r}")
    if kw["trace_format"] == "random":  # vLLM's --dataset-name random: a synthetic workload
        if kw["trace"] is not None:
            raise ConfigError("--dataset-name random is a synthetic workload; leave out --trace/--dataset-path")
        kw["trace_format"] = "auto"
    if kw["trace_format"] not in ("auto", *FORMATS):
        raise ConfigError(f"--trace-format (--dataset-name) must be one of auto, random, {', '.join(FORMATS)}, "
                          f"got {kw['trace_format']!r}")
    if kw.pop("save_result") and kw["result_dir"] is None:
        kw["result_dir"] = Path(".")
    if kw["result_filename"] is not None and not kw["result_filename"].strip():
        raise ConfigError("--result-filename is empty; give a file name")
    kw["percentile_metrics"] = _metric_names(kw["percentile_metrics"])
    if kw["max_concurrency"] is not None and kw["max_concurrency"] < 1:
        raise ConfigError(f"--max-concurrency must be >= 1, got {kw['max_concurrency']}")
    if kw["max_idle"] is not None and kw["max_idle"] < 0:
        raise ConfigError(f"--max-idle must be >= 0 seconds, got {kw['max_idle']:g}")
    if kw["in_process"] and kw["endpoint"] == "chat":
        raise ConfigError("--in-process sends prompts straight to the engine; --endpoint chat needs a server")
    preset = kw.pop("workload")
    if preset is not None:
        if kw["trace"] is not None:
            raise ConfigError("--workload names a synthetic workload; give it or --trace, not both")
        kw["input_len"], kw["output_len"] = wl.preset(preset)
    slo = _slo(kw.pop("goodput") or [], kw.pop("slo"))
    percentiles = _percentiles(kw.pop("metric_percentiles"))
    policies = parse_policies(kw.pop("policies")) if kw["policies"] else []
    serve_args = parse_serve_args(kw.pop("serve_args"))
    window = wl.parse_window(kw.pop("window")) if kw["window"] else None
    kw.pop("progress")
    return BenchOptions(**{k: v for k, v in kw.items() if k not in ("policies", "serve_args", "window")},
                        window=window, slo=slo, percentiles=percentiles, policies=policies, serve_args=serve_args)


def _slo(goodput: list[str], contract: Optional[Path]) -> SLO | None:
    if goodput and contract:
        raise ConfigError("give either --goodput or --slo, not both")
    if contract is None:
        return parse_goodput(goodput)
    if not contract.is_file():
        raise ConfigError(f"--slo {contract}: file not found")

    return load_contract(contract)  # a Contract gives per-request targets (targets_for) and a verdict on the run


def _metric_names(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in METRIC_NAMES]
    if unknown or not names:
        raise ConfigError(f"--percentile-metrics: {', '.join(unknown) or 'nothing given'}; choose among "
                          f"{', '.join(METRIC_NAMES)}")
    return names


def _percentiles(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(p) for p in text.split(",") if p.strip())
    except ValueError:
        values = ()
    if not values or any(not 0 < p < 100 for p in values):
        raise ConfigError(f"--metric-percentiles: expected numbers in (0, 100) like 50,90,99, got {text!r}")
    return values


# ---- shared steps -------------------------------------------------------------------------------------------------
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
    """Replay one workload and report latency, attainment and goodput (one column per --policies entry)."""
    if ctx.invoked_subcommand is not None:
        return
    _run_bench(ctx, opts)


def _run_bench(ctx: typer.Context, opts: BenchOptions) -> None:
    if opts.simulate:

        run_simulated(opts, opts.gpu, console)
        return
    show = ctx.params.get("progress", True)
    synth, raw = _workload(opts)
    results, runs = [], {}
    for policy in opts.policies or [None]:
        with Session(opts, policy) as session:
            specs, notes = shape(raw, opts, session.max_model_len)
            prompts = _prompts(synth, specs)
            result = _replay(session, specs, prompts, show, f"replaying on {session.label}")
            if opts.result_dir is not None and not opts.in_process:
                _timeline_plot(session, opts.result_dir, notes)
            results.append(session.summarize(result, specs, notes))
            runs[session.label] = result.timelines
    report.print_results(console, results)
    if opts.result_dir is not None:
        paths = report.write_results(opts.result_dir, results, opts.result_filename)
        paths += plots.latency_cdfs(runs, opts.result_dir, _targets(opts))
        console.print("wrote " + ", ".join(str(p) for p in paths))


@app.command()
@with_common_options
def sweep(
    ctx: typer.Context,
    opts: BenchOptions,
    attainment: float = typer.Option(0.9, help="Fraction of requests that must be good for a rate to pass."),
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

    def passes(summary: dict[str, Any]) -> bool:
        return summary.get("contract_met", True)  # with a YAML contract, its percentile targets too

    def search(measure: Callable[[float], dict[str, Any]], label: str, policy: str | None, own: float) -> SweepResult:
        if plan is not None:
            return measure_rates(measure, plan.for_policy(policy), attainment, label, passes, conditions)
        first = start_rate or (own if math.isfinite(own) else 1.0)
        return find_capacity(measure, attainment, first, 0.05 if tolerance is None else tolerance,
                             12 if max_points is None else max_points, min_rate or first / 64,
                             math.inf if max_rate is None else max_rate, label=label, passes=passes)

    out_dir = opts.result_dir or Path(f"bench-sweep-{time.strftime('%Y%m%d-%H%M%S')}")
    if opts.simulate:
        sweeps = _simulated_sweep(opts, plan, search)
    else:
        sweeps = _served_sweep(opts, plan, search, ctx.params.get("progress", True))
    console.print(report.sweep_table(sweeps))
    for line in report.capacity_lines(sweeps):
        console.print(line)
    csv_path, json_path = write_summary(sweeps, out_dir, conditions, str(opts.trace) if opts.trace else "synthetic")
    png = plots.attainment_plot(sweeps, out_dir / "attainment_vs_rate.png")
    console.print(f"wrote {csv_path}, {json_path}, {png}")


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
    for policy in opts.policies or [None]:
        with Session(opts, policy) as session:
            base, notes = shape(raw, opts, session.max_model_len)
            salts = itertools.count(1)

            def measure(rate: float) -> dict[str, Any]:
                specs = wl.retime(base, rate=rate, burstiness=opts.burstiness, seed=opts.seed)
                # fresh prompts per point: the server's prefix cache must not carry over from the previous point
                prompts = _prompts(synth, specs, next(salts))
                result = _replay(session, specs, prompts, show, f"{session.label} at {rate:.3g} req/s")
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
        console.print(f"[yellow]note: {note}[/yellow]")
    return sweeps

