"""Where the caching allocator's reserve goes under bursts, per stream (the SM partition's stream that allocated it).
Run from the repository root: PYTHONPATH=. python docs/data/memory-2026-12-02/memsnap.py MODEL base|cap (cap: the
allocator capped at the memory guard's limit with set_per_process_memory_fraction); PYTORCH_CUDA_ALLOC_CONF applies."""
import sys, logging, random, time, os
from collections import defaultdict
import torch
logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
from appliance.bench.engine_bench import start_engine
from appliance.config import Config
from appliance.engine.request import SamplingParams
GiB = 2**30
model, mode = sys.argv[1], sys.argv[2]
print("MODE", mode, "ALLOC_CONF", os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
eng, startup = start_engine(model, "dummy", None, Config.flat(max_model_len=32768))
g = eng.executor.memory_guard
limit = g.limit
eng.executor.memory_guard = None  # no idle releases: see the accumulation
free, total = torch.cuda.mem_get_info()
if mode == "cap":
    torch.cuda.set_per_process_memory_fraction(limit / total)
print(f"kv_pages {startup['kv_pages']} limit {limit/GiB:.2f} GiB total {total/GiB:.2f}")
labels = {}
ps = eng.executor.partitions
for p in list(ps.splits) + [ps.full]:
    for role in ("decode", "prefill"):
        s = getattr(p, role + "_stream")
        if s is not None:
            labels[s.cuda_stream] = f"{p.name}/{role}"
labels[torch.cuda.current_stream().cuda_stream] = "current"
labels[0] = "legacy-default"
def per_stream():
    agg = defaultdict(lambda: [0, 0, 0])
    for seg in torch.cuda.memory_snapshot():
        a = agg[labels.get(seg["stream"], hex(seg["stream"]))]
        a[0] += seg["total_size"]; a[1] += seg["allocated_size"]; a[2] += 1
    return sorted(agg.items(), key=lambda kv: -kv[1][0])
def stats():
    s = torch.cuda.memory_stats()
    return {k: s.get(k) for k in ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams",
                                  "num_ooms")}
def show(tag):
    free, _ = torch.cuda.mem_get_info()
    print(f"{tag}: free {free/GiB:.2f}; allocated {torch.cuda.memory_allocated()/GiB:.2f}, reserved "
          f"{torch.cuda.memory_reserved()/GiB:.2f} (limit {limit/GiB:.2f}), burst max allocated "
          f"{torch.cuda.max_memory_allocated()/GiB:.2f}, max reserved {torch.cuda.max_memory_reserved()/GiB:.2f}; {stats()}")
    for name, (tot, alloc, n) in per_stream()[:12]:
        print(f"   {name:>18}: {tot/GiB:7.2f} GiB in {n:3d} segments, {alloc/GiB:7.2f} allocated")
show("after start")
rng = random.Random(0)
vocab = eng.runner.model.config.vocab_size
for burst, (n, plen, out) in enumerate([(40, 8000, 16), (300, 300, 48), (24, 30000, 4), (40, 8000, 16)]):
    torch.cuda.reset_peak_memory_stats()
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(plen + rng.randrange(0, 100))] for _ in range(n)]
    prompts += [[rng.randrange(100, vocab - 100) for _ in range(50)] for _ in range(200)]
    t0 = time.perf_counter()
    eng.generate(prompts, SamplingParams(max_tokens=out, ignore_eos=True, temperature=0.0))
    show(f"burst {burst} ({n} x {plen} + 200 short) {time.perf_counter() - t0:.2f} s")
