"""Capture times of every partition's decode and prefill graphs, warming up all layers or WARM_LAYERS."""
import sys, time, logging
import torch
logging.basicConfig(level=logging.WARNING)
from appliance.bench.engine_bench import start_engine
from appliance.config import Config
from appliance.engine import prefill_graphs as pg, graphs as dg

cfg = Config.flat(max_model_len=32768)
engine, startup = start_engine(sys.argv[1], "dummy", None, cfg)
print("first", {k: round(v, 2) for k, v in engine.startup.items() if isinstance(v, float)})
ex = engine.executor
rows = engine.prefill_graph_rows
sizes = ex._graphs["full"].sizes
print("partitions", [(p.name, p.prefill_sms) for p in ex.partitions.partitions], "rows", rows, "decode sizes", sizes)
for warm in (None, 2, None, 2):
    pg.WARM_LAYERS = dg.WARM_LAYERS = warm
    t = time.perf_counter(); ex.capture(sizes); torch.cuda.synchronize(); d = time.perf_counter() - t
    t = time.perf_counter(); ex.capture_prefill(rows); torch.cuda.synchronize(); p = time.perf_counter() - t
    print(f"warm layers {warm}: decode graphs {d:.2f} s, prefill graphs {p:.2f} s")
