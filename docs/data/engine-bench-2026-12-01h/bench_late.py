"""muxd bench engine with the split kernel's SOON launch of the merge on (1) or off (0): python exp/bench_soon.py 0|1 ARGS"""
import sys

import appliance.attention.triton_decode as t

t.LATE = int(sys.argv[1])
print(f"LATE {t.LATE}", flush=True)
sys.argv = ["muxd", "bench", "engine"] + sys.argv[2:]
from appliance.cli import main  # noqa: E402

main()
