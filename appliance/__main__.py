"""`python -m appliance` is the `muxd` command."""
from appliance.cli import main

main()
