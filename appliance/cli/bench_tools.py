"""Bench commands beside the replay (registered on the `bench` command group): `muxd bench compare`, a measured sweep
beside a simulated one (appliance/bench/compare.py), `muxd bench pool`, slices of one replay judged together
(appliance/bench/pool.py), and `muxd bench diagnose`, where a policy's time goes (appliance.profile.diagnose.py)."""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.markdown import Markdown

from appliance.bench import compare as cmp
from appliance.bench import pool as pl
from appliance.errors import ApplianceError
from appliance.profile.diagnose import DiagnoseOptions
from appliance.profile.diagnose import diagnose as run
from appliance.slo.contract import load_contract


def compare_command(bench_app: typer.Typer) -> None:
    @bench_app.command("compare")
    def compare(
        measured: Path = typer.Argument(..., help="A measured sweep: its --result-dir or its summary.csv."),
        simulated: Path = typer.Argument(..., help="A `muxd bench sweep --simulate` of the same workload: its "
                                                   "--result-dir or its summary.csv."),
        out: Optional[Path] = typer.Option(None, help="Write comparison.md and attainment_measured_vs_simulated.png "
                                                      "here (default: MEASURED's directory)."),
        at_rate: Optional[float] = typer.Option(None, help="Rate at which to set p99 TTFT/TBT side by side "
                                                           "(default: the highest rate measured for every policy "
                                                           "at which one kept the SLO)."),
        within: float = typer.Option(15.0, help="Error (%) the simulated capacity should stay within."),
        attainment: Optional[float] = typer.Option(None, help="Attainment target, for summary.csv files that do "
                                                              "not record theirs."),
        title: Optional[str] = typer.Option(None, help="Heading of the Markdown report (default: the trace's "
                                                       "name)."),
    ) -> None:
        """Set a measured sweep beside a simulated one: capacity per policy, the simulation's error, capacity ratios
        of mux to the others, p99 TTFT/TBT at a common rate (Markdown), SLO attainment and TBT vs rate (PNG)."""

        try:
            m, s = cmp.read_summary(measured, attainment), cmp.read_summary(simulated, attainment)
            text, paths = cmp.write(m, s, out or cmp.summary_path(measured).parent, within=within, at_rate=at_rate,
                                    title=title)
        except ApplianceError as exc:
            typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
            raise typer.Exit(code=2) from None
        console = Console()
        console.print(Markdown(text))
        console.print("wrote " + ", ".join(str(p) for p in paths))


def pool_command(bench_app: typer.Typer) -> None:
    @bench_app.command("pool")
    def pool(
        points: List[Path] = typer.Argument(..., help="Point JSONs (a sweep's points/*.json, written with "
                                                      "--save-detailed), one per slice of the trace."),
        slo: Path = typer.Option(..., "--slo", help="The SLO contract (YAML) the slices were judged by."),
        attainment: float = typer.Option(0.0, help="Attainment target, where stricter than the contract's."),
        out: Optional[Path] = typer.Option(None, help="Write the pooled verdict here (JSON)."),
    ) -> None:
        """Judge consecutive slices of one replay (`--skip`, `--max-requests`, the same rate) as one replay of all
        their requests: attainment, the TTFT share, the TTFT and TBT percentiles over every slice."""
        import json


        try:
            contract = load_contract(slo)
            result = pl.pool([pl.read_point(p) for p in points], contract, attainment, [str(p) for p in points])
        except ApplianceError as exc:
            typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
            raise typer.Exit(code=2) from None
        verdict = "passes" if result.passed else "fails: " + "; ".join(result.misses.values())
        slices = f"{len(points)} slice{'s' if len(points) > 1 else ''}"
        Console().print(f"{result.policy} at {result.rate:g} req/s, {result.requests} requests in {slices}: "
                        f"attainment {result.attainment:.1%}, TTFT met by {result.ttft_ok:.1%}, p99 TTFT "
                        f"{result.ttft_ms['p99']:.1f} ms, contract TBT {result.tbt_ms:.1f} ms: {verdict}")
        if out is not None:
            out.write_text(json.dumps(result.as_dict(), indent=2) + "\n")
            Console().print(f"wrote {out}")


def diagnose_command(bench_app: typer.Typer) -> None:
    @bench_app.command("diagnose")
    def diagnose(
        trace: Optional[str] = typer.Option(None, help="The trace to replay (not needed with --from-steps or "
                                                       "--from-prefills)."),
        workload: Optional[str] = typer.Option(None, help="A synthetic workload instead of a trace: chat-short "
                                                          "(prompts lognormal, median 1,000 tokens; outputs 250)."),
        model: str = typer.Option("configs/models/llama-3.1-8b", help="Model directory (dummy weights), or "
                                  "'embedded' for the model shipped inside muxd."),
        num_requests: int = typer.Option(80, "-n", "--num-requests", help="Requests of the trace to replay."),
        skip: int = typer.Option(0, help="Leave out the trace's first SKIP requests."),
        seed: int = typer.Option(0, help="--workload: seed of its arrivals and lengths (another draw of the same "
                                         "workload), as `muxd bench --seed`."),
        max_idle: Optional[float] = typer.Option(None, help="Cut idle waits to this many seconds."),
        rate: float = typer.Option(2.0, help="Requests per second."),
        policy: str = typer.Option("mux", help="Scheduling policy."),
        slo: Optional[str] = typer.Option(None, help="SLO contract (YAML)."),
        profile: Optional[str] = typer.Option(None, help="Latency profile (also: print serving factors)."),
        chunk_budget: Optional[int] = typer.Option(None, help="chunked: tokens per step."),
        mixed_chunks: bool = typer.Option(False, "--mixed-chunks", help="mux: TBT-sized mixed chunks."),
        max_model_len: int = typer.Option(32768, help="Context of the served model."),
        out: str = typer.Option("gpu-results", help="Directory for the step, prefill, request logs and timeline."),
        device: str = typer.Option("cuda", help="cuda, or cpu for a dry run."),
        write_serving: Optional[str] = typer.Option(None, help="Write PROFILE with this replay's serving factors "
                                                               "here."),
        from_steps: Optional[List[str]] = typer.Option(None, help="Step logs to calibrate from (no replay)."),
        from_prefills: Optional[List[str]] = typer.Option(None, help="Prefill launch logs to calibrate from (no "
                                                                     "replay)."),
        from_results: Optional[List[str]] = typer.Option(None, help="Result JSONs of replays served under mux with "
                                                                    "--profile (no replay): keep the split's "
                                                                    "slowdown their planners learned online."),
        serve_args: Optional[str] = typer.Option(None, help="More `muxd serve` flags for the engine, quoted (e.g. "
                                                            "\"--prefill-graph-rows 2048\")."),
        host_profile: bool = typer.Option(False, "--host-profile", help="cProfile the engine's steps: where the "
                                                                         "host's time goes (shares; from Python "
                                                                         "3.12, other threads' calls during a step "
                                                                         "too)."),
    ) -> None:
        """Where a policy's time goes: replay a trace slice (or --workload) in process and report every step's
        planning, launch and host time, decode steps' wall against device time (CUDA), partitions, layers per
        launch, the predictor's error, and (with --profile) serving factors."""

        try:
            run(DiagnoseOptions(model=model, trace=trace, workload=workload, n=num_requests, skip=skip, seed=seed,
                                max_idle=max_idle, rate=rate, policy=policy, slo=slo, profile=profile,
                                chunk_budget=chunk_budget,
                                mixed_chunks=mixed_chunks, max_model_len=max_model_len, out=out, device=device,
                                write_serving=write_serving, from_steps=list(from_steps or []),
                                from_prefills=list(from_prefills or []), from_results=list(from_results or []),
                                serve_args=serve_args,
                                host_profile=host_profile))
        except ApplianceError as exc:
            typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
            raise typer.Exit(code=2) from None
