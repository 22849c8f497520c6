import sys, time, logging, json
import torch
logging.basicConfig(level=logging.WARNING)
from appliance.bench.engine_bench import start_engine
from appliance.config import Config
from appliance.engine.supervisor import rebuild_engine
cfg = Config.flat(max_model_len=32768)
engine, startup = start_engine(sys.argv[1], "dummy", None, cfg)
def show(tag, d):
    print(tag, json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in d.items()
                           if isinstance(v, (int, float))}))
show("first", startup)
show("first engine.startup", engine.startup)
t = time.perf_counter()
engine = rebuild_engine(engine)
print(f"rebuild {time.perf_counter() - t:.1f} s")
show("rebuild engine.startup", engine.startup)
