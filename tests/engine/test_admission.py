"""The waiting queue's limit counts only requests that must wait: a burst submitted between two steps fills the free
seats and then --max-waiting places, and the next one is refused with a CapacityError (HTTP 429)."""
from __future__ import annotations

import pytest

from appliance.config import Config
from appliance.engine.factory import build_engine
from appliance.engine.request import SamplingParams
from appliance.errors import CapacityError


def test_a_burst_fills_every_seat_and_every_queue_place(llama_checkpoint):
    path, _ = llama_checkpoint
    engine = build_engine(Config.flat(model=path, kv_cache_memory="4MiB", max_num_seqs=8, max_waiting=8))
    params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0)
    for i in range(16):  # no step in between, as when the engine thread drains its inbox in one go
        engine.submit(engine.make_request([1, 2, 3, i], params))
    with pytest.raises(CapacityError, match=r"8 requests are waiting \(limit 8\)"):
        engine.submit(engine.make_request([4, 5, 6], params))
    engine.step()  # 8 start running: the 8 left are the queue, still full
    assert engine.scheduler.num_running == 8 and len(engine.scheduler.waiting) == 8
    with pytest.raises(CapacityError):
        engine.submit(engine.make_request([4, 5, 6], params))
    while engine.has_unfinished():
        engine.step()
    assert engine.pool.num_free_pages == engine.pool.num_pages


def test_a_continued_step_of_admitted_work_is_never_refused_for_load(llama_checkpoint):
    """A beam search's later steps (Request.continued) pass a full queue: the search was admitted at its first step."""
    path, _ = llama_checkpoint
    engine = build_engine(Config.flat(model=path, kv_cache_memory="4MiB", max_num_seqs=2, max_waiting=1))
    params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0)
    for i in range(3):
        engine.submit(engine.make_request([1, 2, 3, i], params))
    fresh = engine.make_request([4, 5, 6], params)
    with pytest.raises(CapacityError):
        engine.submit(fresh)
    later = engine.make_request([4, 5, 6, 7], params)
    later.continued = True
    engine.submit(later)
    done = {}
    while engine.has_unfinished():
        done.update({out.request_id: out for out in engine.step() if out.finished})
    assert done[later.request_id].num_output_tokens == 4
    assert engine.pool.num_free_pages == engine.pool.num_pages
