"""Commands that read bench results back (registered on the `bench` command group): `muxd bench compare`, a
measured sweep beside a simulated one (appliance/bench/compare.py), and `muxd bench pool`, slices of one replay
judged together (appliance/bench/pool.py)."""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.markdown import Markdown

from appliance.errors import ApplianceError


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
        from appliance.bench import compare as cmp

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

        from appliance.bench import pool as pl
        from appliance.slo.contract import load_contract

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
