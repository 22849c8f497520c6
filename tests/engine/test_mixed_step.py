"""A mixed step (decode rows + prefill chunks in one forward) gives the same tokens as separate forwards."""
from __future__ import annotations

import torch
from spies import on_forward

from appliance.config import Config
from appliance.engine.factory import build_engine
from appliance.engine.plan import PrefillWork, StepPlan
from appliance.engine.planners.base import Planner, admit_fcfs, reserve_all
from appliance.engine.request import SamplingParams
from appliance.engine.scheduler import Scheduler


class ChunkEveryStep(Planner):
    """Test planner: every step decodes all decoding requests and advances each prefill by `chunk` tokens,
    all in one mixed forward."""

    name = "test-chunks"

    def __init__(self, chunk: int) -> None:
        self.chunk = chunk

    def plan(self, sched: Scheduler) -> StepPlan:
        decode = reserve_all(sched, list(sched.decoding))
        admit_fcfs(sched, 10_000)
        works = tuple(PrefillWork(r.request_id, r.num_computed_tokens,
                                  min(r.num_computed_tokens + self.chunk, r.num_tokens), 0, sched.num_layers)
                      for r in sched.prefilling)
        return StepPlan(decode=decode, prefill=works, mixed=True)


def test_mixed_chunks_match_serial(llama_checkpoint):
    path, _ = llama_checkpoint
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (5, 23, 40, 17)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    reference = build_engine(Config.flat(model=path, num_gpu_blocks_override=64)).generate(prompts, params)
    engine = build_engine(Config.flat(model=path, num_gpu_blocks_override=64))
    engine.scheduler.planner = ChunkEveryStep(chunk=7)
    mixed_steps = []
    on_forward(engine, lambda plan, logits: mixed_steps.append(bool(plan.decode and plan.prefill)))
    out = engine.generate(prompts, params)
    assert any(mixed_steps), "the planner never mixed decode rows with prefill chunks"
    assert [c.token_ids for c in out] == [c.token_ids for c in reference]
    assert engine.pool.num_free_pages == engine.pool.num_pages


def test_long_prompts_are_prefilled_in_chunks_of_the_token_budget(llama_checkpoint):
    """serial and layerwise never run more than max_prefill_tokens new tokens of prefill in one step (the engine
    sizes activation memory for that many), and chunking changes no token."""
    path, _ = llama_checkpoint
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (50, 9, 33)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    reference = build_engine(Config.flat(model=path, num_gpu_blocks_override=64)).generate(prompts, params)
    for planner in ("serial", "layerwise"):
        engine = build_engine(Config.flat(model=path, num_gpu_blocks_override=64, policy=planner,
                                                                  max_num_batched_tokens=16, layers_per_step=2))
        sizes = []
        on_forward(engine, lambda plan, logits: sizes.append(sum(w.num_tokens for w in plan.prefill)))
        out = engine.generate(prompts, params)
        assert max(sizes) <= 16, planner
        assert [c.token_ids for c in out] == [c.token_ids for c in reference], planner
