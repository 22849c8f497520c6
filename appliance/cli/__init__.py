"""The `muxd` command line (the top layer): typer commands that build a config and call the layers below. `main` is
the entry point; `app`, the typer app, loads on first use (console scripts installed as `appliance.cli:app` keep
working, through the slower path that imports everything)."""
from typing import Any

from appliance.cli.main import main

__all__ = ["app", "main"]


def __getattr__(name: str) -> Any:
    if name == "app":
        from appliance.cli.commands import app  # defers torch, the engine and the server (see cli/main.py)

        return app
    raise AttributeError(name)
