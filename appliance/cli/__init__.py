"""The `muxd` command line (the top layer): typer commands that build a config and call the layers below."""
from appliance.cli.main import app, main

__all__ = ["app", "main"]
