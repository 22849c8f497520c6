"""A step that fails in its middle (an out-of-memory error at a prefill launch, layer-wise prefill beside decode),
then the engine rebuilt as the server rebuilds it: the same weights, every page free, the same greedy tokens. The
same scenario runs on CUDA with graphs and SM partitions in tests/gpu/test_recovery_gpu.py."""
from __future__ import annotations

import gc
import weakref

from recovery_scenario import fail_mid_step_and_rebuild

from appliance.config import Config
from appliance.engine.factory import build_engine
from appliance.engine.request import SamplingParams


def test_engine_rebuilt_after_a_failure_in_the_middle_of_a_step(llama_checkpoint):
    path, _ = llama_checkpoint
    engine = build_engine(Config.flat(model=path, num_gpu_blocks_override=64, policy="layerwise", layers_per_step=1,
                                      enable_prefix_caching=False))
    prompts = [[3 + (7 * seed + i) % 50 for i in range(12 + 3 * seed)] for seed in range(8)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    rebuilt, _, reference = fail_mid_step_and_rebuild(engine, prompts, params)
    assert rebuilt is not engine and rebuilt.model is engine.model
    old = weakref.ref(engine)
    del engine
    gc.collect()
    assert old() is None  # nothing keeps the failed engine (its KV cache, runner, executor) alive
    assert [c.token_ids for c in rebuilt.generate(prompts, params)] == reference
    assert rebuilt.pool.num_free_pages == rebuilt.pool.num_pages
