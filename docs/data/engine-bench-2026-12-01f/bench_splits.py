"""muxd bench engine with the one-row split kernel at SPLITS splits and STAGES stages:
python exp/bench_splits.py SPLITS STAGES ARGS (0 0: as shipped)"""
import sys

import appliance.attention.triton_decode as t

splits, stages = int(sys.argv[1]), int(sys.argv[2])
orig = t.TritonDecode.__init__


def init(self, *a, **k):
    if splits and a[3] == 1:
        k["splits"], k["num_stages"] = splits, stages
    orig(self, *a, **k)
    if a[3] == 1:
        print(f"one-row split kernel: {self.splits} splits, {self.num_stages} stages", flush=True)


t.TritonDecode.__init__ = init
sys.argv = ["muxd", "bench", "engine"] + sys.argv[3:]
from appliance.cli import main  # noqa: E402

main()
