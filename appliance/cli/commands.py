"""The `muxd` typer app: serve and generate (cli/serve.py), cluster (cli/cluster.py), bench (cli/bench.py,
cli/bench_tools.py, cli/bench_engine.py), profile (cli/profile.py), slo (cli/slo.py), version. cli/main.py is the
entry point."""
from __future__ import annotations

import typer

from appliance import __version__
from appliance.cli.bench import app as bench_app
from appliance.cli.bench_engine import engine_bench_command
from appliance.cli.bench_tools import compare_command, diagnose_command, pool_command
from appliance.cli.cluster import register as register_cluster
from appliance.cli.profile import profile_command
from appliance.cli.serve import register as register_serve
from appliance.cli.slo import app as slo_app

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  context_settings={"help_option_names": ["-h", "--help"]},  # every subcommand inherits -h
                  help="muxd: an LLM serving appliance with an OpenAI-compatible API.")
register_serve(app)
register_cluster(app)
engine_bench_command(bench_app)  # `muxd bench engine` joins the bench group
compare_command(bench_app)  # and `muxd bench compare`
pool_command(bench_app)  # and `muxd bench pool`
diagnose_command(bench_app)  # and `muxd bench diagnose`
app.add_typer(bench_app, name="bench")
app.add_typer(slo_app, name="slo")
profile_command(app)


@app.command()
def version() -> None:
    """Print the muxd version."""
    typer.echo(f"muxd {__version__}")


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"muxd {__version__}")
        raise typer.Exit()


@app.callback()
def _root(show_version: bool = typer.Option(False, "--version", "-V", is_eager=True, callback=_print_version,
                                            help="Print the muxd version and exit.")) -> None:
    """muxd: an LLM serving appliance with an OpenAI-compatible API."""
