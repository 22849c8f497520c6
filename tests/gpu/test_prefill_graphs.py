"""Piecewise prefill graphs on the GPU: greedy outputs with prefills replayed as graphs (whole prompts, cached prefixes,
one layer per step on SM partitions, chunked prefill's mixed steps, mux's mixed chunks beside partitioned decode) equal
the eager engine's token for token; prompts longer than the largest graph run eagerly; no page is lost."""
from __future__ import annotations

import pytest
from copy_model import periodic_prompt

from appliance.config import Config
from appliance.engine.engine import Engine
from appliance.engine.factory import build_engine
from appliance.engine.request import SamplingParams
from appliance.engine.steplog import StepLog

pytest.importorskip("triton")

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def engine(path, **kw) -> Engine:
    return build_engine(Config.flat(model=path, device="cuda",
                                    num_gpu_blocks_override=1024, max_num_seqs=16, attention_backend="flashinfer",
                                    compile=True, **kw))


def test_prefill_graphs_equal_eager_whole_prompts_prefixes_and_layer_steps(copy_model):
    eager = engine(copy_model, policy="serial", multiplex=False, prefill_graph_rows=0)
    # the serial planner prefills the waiting prompts together: 871 tokens, then 185 new ones over cached prefixes
    graphs = engine(copy_model, policy="serial", multiplex=False, prefill_graph_rows=1024)
    layered = engine(copy_model, policy="layerwise", multiplex=True, prefill_graph_rows=1024)
    assert eager.executor.prefill_graph_launches == 0 and not eager.executor._prefill_graphs
    assert layered.executor.multiplexed
    assert set(layered.executor._prefill_graphs) == {p.name for p in layered.partitions.partitions}
    prompts = [periodic_prompt(s, n) for s, n in ((1, 20), (2, 70), (3, 131), (4, 250), (5, 400))]
    # the same prompts again, extended: their prefixes are cached, the new tokens prefill over them
    extended = [p + periodic_prompt(10 + i, 37) for i, p in enumerate(prompts)]
    for prompts_now in (prompts, extended):
        expected = [c.token_ids for c in eager.generate(prompts_now, GREEDY)]
        for e in (graphs, layered):
            before = e.executor.prefill_graph_launches
            assert [c.token_ids for c in e.generate(prompts_now, GREEDY)] == expected
            assert e.executor.prefill_graph_launches > before
    cached = graphs.generate([extended[0]], GREEDY)[0]
    assert cached.num_cached_tokens > 0
    for e in (eager, graphs, layered):
        assert e.pool.num_free_pages == e.pool.num_pages


def test_prefill_graph_sizes_follow_the_rows_and_longer_prompts_run_eagerly(copy_model):
    e = engine(copy_model, policy="serial", multiplex=False, prefill_graph_rows=100)
    graphs = e.executor._prefill_graphs["null"]
    assert graphs.sizes == [32, 64, 96]
    pad = e.executor.pad_rows(0)
    assert [pad(n) for n in (1, 32, 33, 96, 97, 300)] == [32, 32, 64, 96, 97, 300]
    before = graphs.launches
    long = periodic_prompt(7, 300)
    ref = engine(copy_model, policy="serial", multiplex=False, prefill_graph_rows=0)
    assert e.generate([long], GREEDY)[0].token_ids == ref.generate([long], GREEDY)[0].token_ids
    assert graphs.launches == before  # 300 tokens: no graph holds them


def test_chunked_mixed_steps_replay_the_graphs_and_equal_eager(copy_model):
    eager = engine(copy_model, policy="serial", multiplex=False, prefill_graph_rows=0)
    # 64-token chunks beside the decode rows of the prompts already started: mixed steps of up to 64 + 16 rows
    chunked = engine(copy_model, policy="chunked", chunk_budget=64, multiplex=False, prefill_graph_rows=1024)
    prompts = [periodic_prompt(s, n) for s, n in ((21, 30), (22, 90), (23, 150), (24, 260))]
    expected = [c.token_ids for c in eager.generate(prompts, GREEDY)]
    graphs = chunked.executor._prefill_graphs["null"]
    before = graphs.launches
    log = StepLog(chunked).attach()
    assert [c.token_ids for c in chunked.generate(prompts, GREEDY)] == expected
    log.detach()
    assert graphs.launches > before
    mixed = [s for s in log.steps if s["mixed"]]
    assert mixed and all(s["prefill_graphs"] for s in mixed)  # the step log says each mixed forward replayed
    for e in (eager, chunked):
        assert e.pool.num_free_pages == e.pool.num_pages


class _ChunkTable:
    """Predictor table that makes mux take 17-token mixed chunks beside decode (the split is slow, a whole prompt
    misses the 50 ms TBT, 5 + 2 ms a token fits 0.8 x 50 ms up to 17 tokens)."""

    def prefill_ms(self, items, sms):
        return 10.0 * sum(i.new for i in items)

    def decode_ms(self, load, sms):
        return {16: 80.0, 32: 45.0}.get(sms, 20.0) if load.batch_size else 0.0

    def mixed_ms(self, items, load, sms):
        return 5.0 + 2.0 * sum(i.new for i in items)


def test_mux_mixed_chunks_on_partitions_equal_eager(copy_model):
    from appliance.engine.planners.mux import MuxOptions, MuxPlanner
    from appliance.predictor.contention import ContentionGuard
    from appliance.predictor.predictor import Predictor

    eager = engine(copy_model, policy="serial", multiplex=False, prefill_graph_rows=0)
    mux = engine(copy_model, policy="mux", multiplex=True, prefill_graph_rows=1024)
    assert mux.executor.multiplexed
    layers = mux.model.config.num_layers
    splits = tuple(p.decode_sms for p in mux.partitions.splits)
    planner = MuxPlanner(mux.contract, Predictor(_ChunkTable(), ContentionGuard(default=1.0), layers,
                                                 mux.partitions.total_sms, splits), MuxOptions(mixed_chunks=True))
    mux.scheduler.planner = planner
    prompts = [periodic_prompt(s, n) for s, n in ((31, 40), (32, 25), (33, 60), (34, 90), (35, 33))]
    expected = [c.token_ids for c in eager.generate(prompts, GREEDY)]
    reqs = [mux.make_request(p, GREEDY) for p in prompts]
    for r in reqs[:2]:  # two first, the rest once they decode: their prefills meet running decodes
        mux.submit(r)
    for _ in range(4):
        mux.step()
    for r in reqs[2:]:
        mux.submit(r)
    while mux.has_unfinished():
        mux.step()
    assert [r.output_token_ids for r in reqs] == expected
    assert planner.stats.chunk_steps > 0
    assert mux.pool.num_free_pages == mux.pool.num_pages
