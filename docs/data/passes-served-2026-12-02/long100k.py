"""One ~100k-token prompt (and one of 120k) served with --max-model-len 131072 beside short requests: time, memory."""
import sys, logging, random, time, threading
import torch
logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
from appliance.bench.engine_bench import start_engine
from appliance.config import Config
from appliance.engine.request import SamplingParams
GiB = 2**30
eng, startup = start_engine(sys.argv[1], "dummy", None, Config.flat(max_model_len=131072))
g = eng.executor.memory_guard
print(f"kv_pages {startup['kv_pages']} limit {g.limit/GiB:.2f} GiB  planner {type(eng.scheduler.planner).__name__}")
rng = random.Random(0)
vocab = eng.runner.model.config.vocab_size
for plen in (100_000, 120_000):
    torch.cuda.reset_peak_memory_stats()
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(plen)]]
    prompts += [[rng.randrange(100, vocab - 100) for _ in range(200)] for _ in range(32)]
    t0 = time.perf_counter()
    outs = eng.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0))
    dt = time.perf_counter() - t0
    free, total = torch.cuda.mem_get_info()
    print(f"prompt {plen}: {dt:.2f} s, outputs {len(outs)}, long one {len(outs[0].token_ids)} tokens ({outs[0].finish_reason}), "
          f"max allocated {torch.cuda.max_memory_allocated()/GiB:.2f} GiB, max reserved "
          f"{torch.cuda.max_memory_reserved()/GiB:.2f} (limit {g.limit/GiB:.2f}), free now {free/GiB:.2f}; "
          f"free pages {eng.pool.num_free_pages} of {eng.pool.num_pages}", flush=True)
