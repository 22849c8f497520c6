"""The `muxd` command line (the top layer): typer commands that build a config and call the layers below."""
