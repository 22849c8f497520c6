import sys, json, logging
logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
for n in ("muxd",):
    logging.getLogger(n).setLevel(logging.INFO)
from appliance.bench.engine_bench import start_engine
from appliance.config import Config
model = sys.argv[1]
eng, startup = start_engine(model, "dummy", None, Config.flat(max_model_len=8192))
print("STARTUP", model, eng.prefill_graph_rows, json.dumps({k: v for k, v in startup.items() if not isinstance(v, (dict, list))}))
