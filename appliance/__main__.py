"""`python -m appliance` is the `muxd` command."""
from appliance.cli.main import main

main()
