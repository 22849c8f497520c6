"""The `muxd` entry point (`python -m appliance`, the console script). `muxd slo ...` runs without importing torch
and the server stack, so that checking a contract answers in about a second; every other command loads the whole
typer app (cli/commands.py). `from appliance.cli.main import app` gives that app."""
from __future__ import annotations

import sys
from typing import Any


def main() -> None:
    if sys.argv[1:2] == ["slo"]:
        from appliance.cli.slo import app as slo_app  # defers torch: `muxd slo check` needs only pyyaml + pydantic

        slo_app(args=sys.argv[2:], prog_name="muxd slo")
        return
    from appliance.cli.commands import app  # defers torch, the engine and the server until a command needs them

    app()


def __getattr__(name: str) -> Any:
    if name == "app":
        from appliance.cli.commands import app  # defers torch, the engine and the server (as main does)

        return app
    raise AttributeError(name)


if __name__ == "__main__":
    main()
