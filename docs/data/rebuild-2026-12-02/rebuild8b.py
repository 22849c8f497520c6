"""An 8B engine (dummy weights, serve defaults) rebuilt as after a failed step: rebuild time, KV pages and memory."""
import sys, time, random, logging
import torch
logging.basicConfig(level=logging.WARNING)
from appliance.bench.engine_bench import start_engine
from appliance.config import Config
from appliance.engine.request import SamplingParams
from appliance.engine import supervisor
from appliance.engine.supervisor import rebuild_engine
if len(sys.argv) > 2 and sys.argv[2] == 'noclear':
    supervisor.clear_cublas_workspaces = lambda: None
    print('cuBLAS workspaces not cleared')
GiB = 2**30
cfg = Config.flat(max_model_len=32768)
engine, startup = start_engine(sys.argv[1], "dummy", None, cfg)
print(f"first: load {startup['load_s']:.1f} s, engine {startup['engine_init_s']:.1f} s, kv_pages {startup['kv_pages']}")
rng = random.Random(0)
prompts = [[rng.randrange(100, 30000) for _ in range(rng.choice([50, 400, 3000]))] for _ in range(48)]
params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
first = [c.token_ids for c in engine.generate(prompts, params)]
torch.cuda.synchronize()
free0, _ = torch.cuda.mem_get_info()
print(f"after first run: allocated {torch.cuda.memory_allocated()/GiB:.2f} GiB, reserved "
      f"{torch.cuda.memory_reserved()/GiB:.2f}, free {free0/GiB:.2f}")
for i in range(2):
    t = time.perf_counter()
    engine = rebuild_engine(engine)
    took = time.perf_counter() - t
    out = [c.token_ids for c in engine.generate(prompts, params)]
    torch.cuda.synchronize()
    free, _ = torch.cuda.mem_get_info()
    print(f"rebuild {i + 1}: {took:.1f} s, kv_pages {engine.pool.num_pages}, same tokens {out == first}, allocated "
          f"{torch.cuda.memory_allocated()/GiB:.2f} GiB, reserved {torch.cuda.memory_reserved()/GiB:.2f}, "
          f"free {free/GiB:.2f}, pages free {engine.pool.num_free_pages == engine.pool.num_pages}")
