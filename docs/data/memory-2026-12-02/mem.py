"""Where the start-up's memory reserve goes: the reserve estimated, what the graphs and a heavy burst really use."""
import sys, json, logging, random
import torch
logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
from appliance.engine import factory
from appliance.bench.engine_bench import start_engine
from appliance.config import Config
from appliance.engine.request import SamplingParams

seen = {}
orig = factory._Builder._profile_activations
def spy(self, num_tokens, partitions):
    r = orig(self, num_tokens, partitions)
    seen["reserve"] = r
    seen["partitions"] = len(partitions.partitions)
    seen["free_total_after_warmup"] = torch.cuda.mem_get_info()
    seen["allocated_after_warmup"] = torch.cuda.memory_allocated()
    seen["reserved_after_warmup"] = torch.cuda.memory_reserved()
    return r
factory._Builder._profile_activations = spy
GiB = 2**30
model = sys.argv[1]
eng, startup = start_engine(model, "dummy", None, Config.flat(max_model_len=32768))
free, total = torch.cuda.mem_get_info()
def show(tag):
    free, total = torch.cuda.mem_get_info()
    print(f"{tag}: free {free/GiB:.2f} GiB of {total/GiB:.2f}; allocated {torch.cuda.memory_allocated()/GiB:.2f}, "
          f"reserved {torch.cuda.memory_reserved()/GiB:.2f}, max allocated {torch.cuda.max_memory_allocated()/GiB:.2f}, "
          f"max reserved {torch.cuda.max_memory_reserved()/GiB:.2f}; unused of the 0.9 budget {(free - 0.1*total)/GiB:.2f} GiB")
print("RESERVE", json.dumps({k: (v / GiB if isinstance(v, int) and v > 1e6 else v) for k, v in seen.items()}, default=str))
print("STARTUP", json.dumps({k: v for k, v in startup.items() if not isinstance(v, (dict, list))}))
kv = eng.runner.kv_cache.data
print(f"KV {kv.numel() * kv.element_size() / GiB:.2f} GiB; weights {sum(p.numel() * p.element_size() for p in eng.runner.model.parameters()) / GiB:.2f} GiB")
show("after start")
rng = random.Random(0)
vocab = eng.runner.model.config.vocab_size
import time
g = eng.executor.memory_guard
print("GUARD limit", None if g is None else round(g.limit / GiB, 2), "GiB")
for burst, (n, plen, out) in enumerate([(40, 8000, 16), (300, 300, 48), (24, 30000, 4), (40, 8000, 16), (300, 300, 48)]):
    t0 = time.perf_counter()
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(plen + rng.randrange(0, 100))] for _ in range(n)]
    # short prompts alongside so decode runs on its partition while prefill runs beside it
    prompts += [[rng.randrange(100, vocab - 100) for _ in range(50)] for _ in range(200)]
    eng.generate(prompts, SamplingParams(max_tokens=out, ignore_eos=True, temperature=0.0))
    show(f"after burst {burst} ({n} x {plen} tokens + 200 short, {time.perf_counter() - t0:.1f} s)")
    if g is not None:
        print(f"  guard: {g.releases} releases, {g.released_bytes / GiB:.2f} GiB given back in {g.release_seconds * 1e3:.0f} ms")
print("allocator retries", torch.cuda.memory_stats().get("num_alloc_retries"))
