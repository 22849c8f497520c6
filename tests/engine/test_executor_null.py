"""The executor on the null partition (CPU, or multiplexing off): the same code path as on SM partitions, run
synchronously; its timeline is valid Chrome-trace JSON; multiplexing without a GPU is refused clearly."""
from __future__ import annotations

import json

import pytest

from appliance.config import Config
from appliance.engine.factory import build_engine
from appliance.engine.partitions import PartitionSet
from appliance.engine.request import SamplingParams
from appliance.engine.timeline import Timeline
from appliance.errors import ConfigError
from appliance.predictor.shapes import DecodeLoad, PrefillItem

GREEDY = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)


def test_null_partition_layerwise_equals_serial_and_records_a_timeline(llama_checkpoint, tmp_path):
    path, _ = llama_checkpoint
    prompts = [[3 + i * 7 % 200 for i in range(n)] for n in (12, 30, 5)]
    serial = build_engine(Config.flat(model=path, num_gpu_blocks_override=64)).generate(prompts, GREEDY)
    engine = build_engine(Config.flat(model=path, num_gpu_blocks_override=64, policy="layerwise", layers_per_step=1))
    assert not engine.executor.multiplexed and engine.partitions.full.is_null
    out = engine.generate(prompts, GREEDY)
    assert [c.token_ids for c in out] == [c.token_ids for c in serial]
    assert engine.executor.layers_launched >= engine.model.num_layers  # one layer a step, every layer once
    assert not engine.executor.has_inflight()
    engine.executor.timeline.save(tmp_path / "t.json")
    trace = json.loads((tmp_path / "t.json").read_text())
    names = {e["name"] for e in trace["traceEvents"]}
    assert {"decode", "prefill launch", "thread_name"} <= names
    assert all(e["ph"] in ("X", "i", "M") for e in trace["traceEvents"])


def test_timeline_keeps_its_last_seconds_and_is_bounded(tmp_path):
    timeline = Timeline(capacity=10)
    for i in range(30):
        timeline.span("decode", "full", i * 1.0, i * 1.0 + 0.5, batch=1)
    assert len(timeline) == 10
    timeline.save(tmp_path / "t.json", last_seconds=3)
    spans = [e for e in json.loads((tmp_path / "t.json").read_text())["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == 4  # starts at 26, 27, 28, 29 s are within 3 s of the last


def test_multiplexing_needs_a_gpu(llama_checkpoint):
    path, _ = llama_checkpoint
    with pytest.raises(ConfigError, match="CUDA"):
        build_engine(Config.flat(model=path, num_gpu_blocks_override=64, policy="layerwise", multiplex=True))
    assert PartitionSet.null().for_decode(64).is_null


def test_a_decode_step_beside_prefill_refines_the_mux_planners_guard(llama_checkpoint):
    from appliance.engine.executor import DecodeObservation
    from appliance.engine.plan import PrefillWork, StepPlan

    path, _ = llama_checkpoint
    engine = build_engine(Config.flat(model=path, num_gpu_blocks_override=64, policy="mux"))
    rid = engine.add_request([5, 6, 7, 8], GREEDY)
    guard = engine.predictor.guard
    plan = StepPlan(decode=(rid,))
    engine.executor.last_decode = DecodeObservation(32, 12.0, ())
    engine._observe(plan)  # alone: nothing to learn
    assert not guard.observations
    beside = (PrefillWork("other", 0, 3000, 0, 4),)
    engine.executor.last_decode = DecodeObservation(32, 12.0, beside)
    engine._observe(plan)
    (cell, window), = guard.observations.items()
    assert cell[0] == 32 and len(window) == 1 and window[0] >= 1.0


def test_prefill_layers_timed_beside_decode_refine_the_mux_planners_split_slowdown(llama_checkpoint):
    from appliance.engine.launched import PrefillObservation
    from appliance.engine.plan import PrefillWork, StepPlan

    path, _ = llama_checkpoint
    engine = build_engine(Config.flat(model=path, num_gpu_blocks_override=64, policy="mux"))
    split, sms = engine.predictor.split, engine.predictor.sm_count
    part = sms - engine.predictor.decode_partitions[0]  # a split's prefill SMs
    works = (PrefillWork("other", 0, 3000, 0, 4),)
    inflight = engine.executor.inflight
    for obs in (PrefillObservation(part, works, 30.0, True),    # on a partition, decode beside: learned
                PrefillObservation(part, works, 30.0, False),   # nothing ran beside it
                PrefillObservation(sms, works, 30.0, True)):    # on all SMs
        inflight.finished.append(obs)
        inflight.finished_seen += 1
    engine._observe(StepPlan())
    assert len(split.window) == 1 and split.window[0][2] == 30.0
    engine._observe(StepPlan())  # each launch is handed over once
    assert len(split.window) == 1


def test_a_mixed_step_refines_the_mux_planners_mixed_step_model(llama_checkpoint):
    from appliance.engine.plan import PrefillWork, StepPlan

    path, _ = llama_checkpoint
    engine = build_engine(Config.flat(model=path, num_gpu_blocks_override=64, policy="mux"))
    rid = engine.add_request([5, 6, 7, 8], GREEDY)
    mixed = engine.predictor.mixed
    works = (PrefillWork("other", 0, 1500, 0, engine.predictor.num_layers),)
    expected = engine.predictor.mixed_ms([PrefillItem(1500, 0)], DecodeLoad(1, 4)) * 1.2
    engine.executor.last_mixed_ms = expected
    engine._observe(StepPlan(decode=(rid,), prefill=works))  # not a mixed step: nothing to learn
    assert not mixed.window
    engine._observe(StepPlan(decode=(rid,), prefill=works, mixed=True))
    assert len(mixed.window) == 1 and mixed.window[0][2] == expected


def test_prefill_layers_after_decode_refine_the_mux_planners_all_sm_prefill(llama_checkpoint):
    from appliance.engine.plan import PrefillWork, StepPlan

    path, _ = llama_checkpoint
    engine = build_engine(Config.flat(model=path, num_gpu_blocks_override=64, policy="mux"))
    rid = engine.add_request([5, 6, 7, 8], GREEDY)
    full = engine.predictor.full
    works = (PrefillWork("other", 0, 1500, 4, 8),)
    engine.executor.last_after_ms = 7.5  # (the executor times them on a GPU only)
    engine._observe(StepPlan(decode=(rid,), prefill=works))  # on the split: not these layers
    assert not full.window
    engine._observe(StepPlan(decode=(rid,), prefill=works, prefill_after_decode=True))
    expected = engine.predictor.prefill_solo_ms([PrefillItem(1500, 0)], None, 4)
    assert len(full.window) == 1 and full.window[0][0] == pytest.approx(expected) and full.window[0][2] == 7.5


def test_prefill_padded_to_gemm_buckets_computes_the_same_tokens(llama_checkpoint, monkeypatch):
    from appliance.predictor.gemm_table import GemmTable

    path, _ = llama_checkpoint
    prompts = [[3 + i * 7 % 200 for i in range(n)] for n in (12, 30, 5)]
    serial = build_engine(Config.flat(model=path, num_gpu_blocks_override=64)).generate(prompts, GREEDY)
    engine = build_engine(Config.flat(model=path, num_gpu_blocks_override=64, policy="layerwise", layers_per_step=1))
    # 32 rows cost more than 64: 13..64 tokens run on 64 rows; 65..96 on 96; 1..12 on 12 (cheaper than any bucket)
    engine.executor.pad_prefills(GemmTable((12, 32, 64, 96), {7: (0.1, 2.0, 1.0, 1.5)}), max_rows=64, null_sms=7)
    seen = []
    forward_layers = engine.model.forward_layers

    def spy(positions, hidden, residual, start, end):
        seen.append((hidden.shape[0], positions.shape[0], None if residual is None else residual.shape[0]))
        return forward_layers(positions, hidden, residual, start, end)

    monkeypatch.setattr(engine.model, "forward_layers", spy)
    out = engine.generate(prompts, GREEDY)
    assert [c.token_ids for c in out] == [c.token_ids for c in serial]
    prefill_rows = {rows for rows, positions, _ in seen if rows > len(prompts)}
    assert prefill_rows == {64}  # the 47 prompt tokens (or a part of them) ran padded to 64 rows, layer by layer
    assert all(rows == positions and residual in (None, rows) for rows, positions, residual in seen)
    assert engine.pool.num_free_pages == engine.pool.num_pages and not engine.scheduler.requests
    pad = engine.executor.pad_rows(0)
    assert [pad(n) for n in (5, 12, 13, 64, 65, 200)] == [12, 12, 64, 64, 65, 200]  # past max_rows: not padded
    assert engine.executor.pad_rows(8) is None  # a partition the table does not have


def test_kernel_warm_up_writes_only_the_scratch_page_and_keeps_no_state(llama_checkpoint):
    from appliance.predictor.gemm_table import GemmTable

    path, _ = llama_checkpoint
    prompts = [[3 + i * 5 % 200 for i in range(n)] for n in (9, 21)]
    expected = build_engine(Config.flat(model=path, num_gpu_blocks_override=64)).generate(prompts, GREEDY)
    engine = build_engine(Config.flat(model=path, num_gpu_blocks_override=64))
    runner, kv = engine.executor.runner, engine.executor.runner.kv_cache
    kv.data[:, :, :kv.scratch_page].fill_(1.5)
    runner.warm_kernels([40, 70], 5)  # one layer of 40 and of 70 rows, 1 to 5 logits rows
    assert bool((kv.data[:, :, :kv.scratch_page] == 1.5).all())
    assert not runner._partials
    assert [c.token_ids for c in engine.generate(prompts, GREEDY)] == [c.token_ids for c in expected]
    # the row counts warmed: the table's padding targets on that SM count up to the largest launch
    table = GemmTable((32, 64, 96, 128), {20: (1.0, 1.5, 1.4, 2.0)})
    engine.executor.pad_prefills(table, 100, null_sms=20)
    assert engine.executor._eager_buckets(20) == (32, 96)  # 64 pads to 96 (cheaper); 128 exceeds 100 rows
    assert engine.executor._eager_buckets(36) == (32, 64, 96)  # a count the table lacks: every bucket
