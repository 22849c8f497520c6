"""Prefix reuse across requests and preemption under KV-pool exhaustion, end to end through the engine."""
from __future__ import annotations

import torch
from spies import on_forward

from appliance.config import Config
from appliance.engine.engine import Engine
from appliance.engine.factory import build_engine
from appliance.engine.request import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 250, (n,), generator=g).tolist()


def first_logits(engine: Engine, rid: str) -> torch.Tensor:
    """Step until `rid` gets its first logits; returns them (the engine keeps running normally)."""
    box: dict[str, torch.Tensor] = {}
    undo = on_forward(engine, lambda plan, logits: box.setdefault(rid, logits[rid]) if rid in logits else None)
    while rid not in box:
        engine.step()
    undo()
    return box[rid]


def run_to_end(engine: Engine) -> None:
    while engine.has_unfinished():
        engine.step()


def test_second_request_reuses_three_cached_pages(llama_checkpoint):
    path, _ = llama_checkpoint
    shared = prompt(0, 48)  # exactly three pages of 16
    engine = build_engine(Config.flat(model=path, num_gpu_blocks_override=32))
    first = engine.add_request(shared + prompt(1, 10), GREEDY)
    engine.step()
    first_pages = list(engine.scheduler.requests[first].page_table.pages)
    run_to_end(engine)
    free_before = engine.pool.num_free_pages
    assert free_before == 32

    second = engine.add_request(shared + prompt(2, 12), GREEDY)
    works = []
    on_forward(engine, lambda plan, logits: works.extend(plan.prefill))
    logits = first_logits(engine, second)
    request = engine.scheduler.requests[second]
    pages = request.page_table.pages
    assert request.num_cached_tokens == 48
    assert pages[:3] == first_pages[:3]
    assert len(pages) == 4 and pages[3] not in first_pages[:3]  # one new page for 60 tokens
    assert [(w.token_start, w.token_end) for w in works] == [(48, 60)]  # only the suffix was computed
    run_to_end(engine)
    assert engine.pool.num_free_pages == free_before

    fresh = build_engine(Config.flat(model=path, num_gpu_blocks_override=32, enable_prefix_caching=False))
    rid = fresh.add_request(shared + prompt(2, 12), GREEDY)
    reference = first_logits(fresh, rid)
    assert ((logits - reference).abs().max() / reference.abs().max()).item() <= 1e-5
    assert engine.generate(shared + prompt(2, 12), GREEDY)[0].token_ids == \
        fresh.generate(shared + prompt(2, 12), GREEDY)[0].token_ids


def test_pool_exhaustion_preempts_and_every_request_matches_its_solo_run(llama_checkpoint):
    path, _ = llama_checkpoint
    prompts = [prompt(10 + i, 18 + 3 * i) for i in range(8)]
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True) if i % 2 == 0 else
              SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=i, ignore_eos=True)
              for i in range(8)]
    solo = build_engine(Config.flat(model=path, num_gpu_blocks_override=64))
    alone = [solo.generate(p, sp)[0].token_ids for p, sp in zip(prompts, params)]

    # every request needs 3-5 pages; 12 pages cannot hold all 8 at once
    tight = build_engine(Config.flat(model=path, num_gpu_blocks_override=12, enable_prefix_caching=False))
    preemptions = []
    inner = tight.scheduler.preempt
    tight.scheduler.preempt = lambda r: (preemptions.append(r.request_id), inner(r))[1]
    together = tight.generate(prompts, params)
    assert preemptions, "the pool was never exhausted; the test lost its point"
    assert [c.token_ids for c in together] == alone
    assert all(c.finish_reason == "length" for c in together)
    assert tight.pool.num_free_pages == 12


def test_abort_frees_every_page_at_once(llama_checkpoint):
    path, _ = llama_checkpoint
    engine = build_engine(Config.flat(model=path, num_gpu_blocks_override=40, policy="layerwise"))
    ids = [engine.add_request(prompt(20 + i, 30), SamplingParams(max_tokens=50, ignore_eos=True))
           for i in range(4)]
    for _ in range(6):
        engine.step()
    assert engine.pool.num_free_pages < 40
    for rid in ids:
        assert engine.abort(rid)
    assert not engine.abort(ids[0])
    assert engine.pool.num_free_pages == 40
    assert not engine.has_unfinished()
    assert engine.runner._partials == {}


def test_aborted_and_finished_requests_leave_no_executor_state(llama_checkpoint):
    """The plan names who left; an engine going idle releases them at once, not at some later step."""
    path, _ = llama_checkpoint
    engine = build_engine(Config.flat(model=path, num_gpu_blocks_override=64))
    ids = [engine.add_request(list(range(5 + i, 25 + i)), SamplingParams(max_tokens=12, ignore_eos=True))
           for i in range(4)]
    for _ in range(3):
        engine.step()
    for rid in ids[::2]:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    assert engine.pool.num_free_pages == engine.pool.num_pages
    assert not engine.runner.batches._mirrors
    late = engine.add_request([7, 8, 9], SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    assert engine.abort(late) and not engine.runner.batches._mirrors  # aborted while the engine had nothing else
