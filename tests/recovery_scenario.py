"""A step that fails in its middle, then the engine rebuilt as the server rebuilds it (engine/supervisor.py), shared
by the CPU test (tests/engine/test_recovery.py) and the CUDA one (tests/gpu/test_recovery_gpu.py)."""
from __future__ import annotations

import time

import pytest
import torch

from appliance.engine.engine import Engine
from appliance.engine.request import SamplingParams
from appliance.engine.supervisor import rebuild_engine


def fail_mid_step_and_rebuild(engine: Engine, prompts: list[list[int]], params: SamplingParams,
                              ) -> tuple[Engine, float, list[list[int]]]:
    """Generate `prompts` once for reference; then submit the first half, step until some decode, submit the rest
    and let the second prefill launch after that raise an out-of-memory error (the first is in flight, requests are
    decoding); rebuild. Returns (the rebuilt engine, seconds the rebuild took, the reference token ids)."""
    reference = [c.token_ids for c in engine.generate(prompts, params)]
    half = len(prompts) // 2
    for p in prompts[:half]:
        engine.submit(engine.make_request(p, params))
    for _ in range(100):
        if engine.scheduler.decoding:
            break
        engine.step()
    assert engine.scheduler.decoding
    patched = {"prefill": engine.runner.prefill, "launches": 0}

    def failing(*args, **kwargs):
        patched["launches"] += 1
        if patched["launches"] == 2:
            raise torch.OutOfMemoryError("CUDA out of memory (injected in the middle of a step)")
        return patched["prefill"](*args, **kwargs)

    engine.runner.prefill = failing
    for p in prompts[half:]:
        engine.submit(engine.make_request(p, params))
    with pytest.raises(torch.OutOfMemoryError, match="injected"):
        for _ in range(100):
            engine.step()
    assert engine.scheduler.decoding and patched["launches"] == 2
    patched.clear()  # (the old runner's bound method: nothing of the old engine stays referenced here)
    started = time.perf_counter()
    rebuilt = rebuild_engine(engine)
    return rebuilt, time.perf_counter() - started, reference
