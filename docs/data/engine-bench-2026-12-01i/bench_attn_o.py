"""muxd bench engine with the one-row merge folded into the output projection (1) or not (0), run from the repository
root with attn_o.py copied to exp/attn_o.py:
python exp/bench_attn_o.py 0|1 ARGS (env ATTN_O_ROWS, ATTN_O_BLOCK_N, ATTN_O_WARPS, ATTN_O_CHUNK)"""
import atexit
import os
import sys

sys.path.insert(0, os.getcwd())
on = sys.argv[1] == "1"
if on:
    import exp.attn_o as ao

    ao.install()
    print(f"attn_o on: rows {ao.ROWS} block {ao.BLOCK_N} warps {ao.WARPS} chunk {ao.CHUNK}", flush=True)
    atexit.register(lambda: print(f"fused calls: {ao.used_fused[0]}", flush=True))
sys.argv = ["muxd", "bench", "engine"] + sys.argv[2:]
from appliance.cli import main  # noqa: E402

main()
