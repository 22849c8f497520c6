"""muxd bench engine with the split kernel's early first tile on (1) or off (0): python exp/bench_early.py 0|1 ARGS"""
import sys

import appliance.attention.triton_decode as t

t.EARLY_TILE = sys.argv[1] == "1"
sys.argv = ["muxd", "bench", "engine"] + sys.argv[2:]
from appliance.cli import main  # noqa: E402

main()
