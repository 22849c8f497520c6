"""Entry point of the frozen `muxd` binary: the same typer app as the `muxd` console script."""
from appliance.cli import main

if __name__ == "__main__":
    main()
