"""The `muxd bench compare` command (registered on the `bench` command group): a measured sweep beside a simulated
one, written by appliance/bench/compare.py."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

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
