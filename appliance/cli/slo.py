"""`muxd slo`: commands about SLO contracts (`muxd slo check FILE`)."""
from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from appliance.errors import ContractError
from appliance.slo.contract import Contract, load_contract

app = typer.Typer(add_completion=False, no_args_is_help=True, help="SLO contracts: check a contract file.",
                  context_settings={"help_option_names": ["-h", "--help"]})


@app.callback()
def slo() -> None:
    """SLO contracts: check a contract file."""  # a group even alone (`muxd slo check`, run by cli/main.py)


@app.command()
def check(file: Path = typer.Argument(..., help="SLO contract (YAML), e.g. configs/slo/chat.yaml.")) -> None:
    """Validate a contract: print every problem (file:line: field: what is wrong), or a summary of what it
    promises. Exit status 1 when it is invalid, 2 when it cannot be read as YAML at all (unreadable, too large,
    not UTF-8, not YAML, or hostile YAML: nesting too deep, recursive or exploding aliases)."""
    try:
        contract = load_contract(file)
    except ContractError as exc:
        console = Console(stderr=True, highlight=False, soft_wrap=True)
        if exc.unreadable:  # one line: why the file could not be read as a contract at all
            console.print(f"error: {exc.problems[0].format(str(file))}", markup=False)
            raise typer.Exit(code=2)
        console.print(f"[red]{len(exc.problems)} problem{'s' if len(exc.problems) != 1 else ''}[/red] in {file}:")
        for problem in exc.problems:
            console.print(f"  {problem.format(str(file))}", markup=False)
        raise typer.Exit(code=2 if exc.unreadable else 1)
    Console(highlight=False, soft_wrap=True).print(summary(contract, str(file)))


def summary(contract: Contract, source: str) -> Table:
    """One table: a row per request class with its resolved targets; the caption says attainment and overload."""
    o = contract.overload
    shed = "shed (429 + Retry-After) when the predicted TTFT misses" if o.mode == "shed" else "queue"
    table = Table(title=f"SLO contract {contract.name!r} ({source}): valid",
                  caption=f"attainment {contract.attainment:.2%} of requests meet every target; overload: {shed}, "
                          f"queue limit {o.queue_limit}; default class {contract.default_class_name!r}")
    for col in ("class", "priority", "TTFT", "TBT", "TPOT", "E2E"):
        table.add_column(col)
    for name in contract.class_names():
        s = contract.slo_for(name)
        ttft = f"p{s.ttft_percentile:g} {s.ttft_ms:g} ms" + (
            f" + {s.ttft_per_1k_ms:g} ms/1k uncached tokens" if s.ttft_per_1k_ms else "")
        table.add_row(name, str(s.priority), ttft, f"p{s.tbt_percentile:g} {s.tbt_ms:g} ms",
                      f"{s.tpot_ms:g} ms" if s.tpot_ms else "-", f"{s.e2e_ms:g} ms" if s.e2e_ms else "-")
    return table
