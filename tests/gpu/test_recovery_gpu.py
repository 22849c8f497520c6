"""A failed step on CUDA, recovered as the server recovers (engine/supervisor.py's `rebuild_engine`, which
async_engine.py calls after ending the step's requests): an out-of-memory error raised in the middle of a step, with
requests decoding on CUDA graphs and prefill layers in flight on an SM partition; the engine rebuilt around the same
weights serves the same greedy tokens with every page free, and holds no more device memory than the first did."""
from __future__ import annotations

import gc
import weakref

import torch
from copy_model import periodic_prompt
from recovery_scenario import fail_mid_step_and_rebuild

from appliance.config import Config
from appliance.engine.factory import build_engine
from appliance.engine.request import SamplingParams

MiB = 2**20


def test_engine_rebuilt_after_out_of_memory_mid_step(copy_model):
    engine = build_engine(Config.flat(model=copy_model, device="cuda", attention_backend="flashinfer", cuda_graph=True,
                                      compile=True, enable_prefix_caching=False, num_gpu_blocks_override=512,
                                      max_num_seqs=16, policy="layerwise", multiplex=True))
    assert engine.executor.multiplexed
    prompts = [periodic_prompt(seed, 40 + 5 * seed) for seed in range(12)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    engine.generate(prompts, params)  # what a first run allocates lazily (workspaces, buffers by size) counts from here
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    rebuilt, took, reference = fail_mid_step_and_rebuild(engine, prompts, params)
    assert rebuilt.model is engine.model and rebuilt.executor.multiplexed
    old = weakref.ref(engine)
    del engine
    gc.collect()
    assert old() is None  # nothing keeps the failed engine (its graphs, partitions, buffers) alive
    assert [c.token_ids for c in rebuilt.generate(prompts, params)] == reference
    assert rebuilt.pool.num_free_pages == rebuilt.pool.num_pages
    torch.cuda.synchronize()
    now = torch.cuda.memory_allocated()
    print(f"rebuilt in {took:.2f} s; device memory allocated {held / MiB:.0f} MiB after the first engine's first run, "
          f"{now / MiB:.0f} MiB after the rebuilt engine's")
    assert now <= held + 64 * MiB
