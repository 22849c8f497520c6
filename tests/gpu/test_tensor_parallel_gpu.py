"""Tensor parallelism on two GPUs (NCCL): two ranks generate greedily what one GPU does, token for token, on the fast
path (flashinfer, torch.compile, decode graphs with the collectives captured in them) for a model whose KV heads the
ranks split and one whose single KV head both hold; under multiplexing too (prefill layers beside decode on SM
partitions, partition switches, a short prompt preempting a long one between layers, an abort mid-prefill); every
page comes back; and the collectives of each phase run on that phase's partition stream (so on its SMs alone).
Skipped on a machine of fewer than two GPUs."""
from __future__ import annotations

import json

import pytest
import torch
from copy_model import periodic_prompt, train_copy_model

from appliance.config import Config
from appliance.engine.engine import Engine
from appliance.engine.factory import build_engine
from appliance.engine.request import SamplingParams

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def split_kv_model(tmp_path_factory):
    """The copy model with 4 query heads over 2 KV heads: each of two ranks holds one KV head."""
    return train_copy_model(tmp_path_factory.mktemp("copy-model-4-2"), heads=4, kv_heads=2)


def engine(path, tp: int, **kw) -> Engine:
    settings = dict(model=path, device="cuda", tensor_parallel_size=tp, num_gpu_blocks_override=512,
                    max_num_seqs=16, attention_backend="flashinfer", compile=True, cuda_graph=True, dist_timeout=120)
    return build_engine(Config.flat(**{**settings, **kw}))


def _outputs(e: Engine, prompts: list[list[int]]) -> list[list[int]]:
    try:
        out = [c.token_ids for c in e.generate(prompts, GREEDY)]
        assert e.pool.num_free_pages == e.pool.num_pages
        return out
    finally:
        e.close()


@pytest.mark.parametrize("which", ["replicated-kv", "split-kv"])
def test_two_gpus_decode_as_one_on_the_fast_path(copy_model, split_kv_model, which):
    path = copy_model if which == "replicated-kv" else split_kv_model
    prompts = [periodic_prompt(seed, 30 + 9 * seed) for seed in range(11)]  # 11 rows: a padded graph of 16
    one = _outputs(engine(path, 1, policy="serial"), prompts)
    two = engine(path, 2, policy="serial")
    assert two.runner.graphs is not None
    assert _outputs(two, prompts) == one
    for p, out in zip(prompts, one):  # and the model is right: the continuation repeats the period
        full = p + out
        assert full[24:] == full[:-24]


def test_two_gpus_multiplexed_with_switches_preemption_and_abort(split_kv_model):
    from spies import stepper
    from test_multiplex import ShortFirstLayerwise

    decoders = [periodic_prompt(s, 30 + s) for s in range(4)]
    long_prompt, short_prompt, doomed = periodic_prompt(10, 150), periodic_prompt(11, 40), periodic_prompt(12, 90)
    expected = _outputs(engine(split_kv_model, 1, policy="serial", multiplex=False), decoders + [long_prompt,
                                                                                                   short_prompt])
    mux = engine(split_kv_model, 2, policy="layerwise", multiplex=True)
    try:
        assert mux.executor.multiplexed
        planner = mux.scheduler.planner = ShortFirstLayerwise()
        outputs: dict[str, list[int]] = {}
        steps = stepper(mux, outputs)

        ids = [mux.add_request(p, GREEDY) for p in decoders]
        steps(10)
        doomed_id = mux.add_request(doomed, GREEDY)
        steps(1)
        assert mux.abort(doomed_id)  # mid-prefill: the other rank drops it with the next step
        long_id = mux.add_request(long_prompt, GREEDY)
        steps(1)
        short_id = mux.add_request(short_prompt, GREEDY)
        steps()
        assert planner.preemptions >= 1 and mux.executor.switches >= 2
        assert [outputs[rid] for rid in ids + [long_id, short_id]] == [list(t) for t in expected]
        assert mux.pool.num_free_pages == mux.pool.num_pages
    finally:
        mux.close()


def _stream_id(stream: torch.cuda.Stream) -> int:
    from cuda.bindings import runtime

    err, sid = runtime.cudaStreamGetId(stream.cuda_stream)
    assert int(err) == 0, err
    return int(sid)


def test_each_phase_collectives_run_on_its_partition_stream(split_kv_model, tmp_path):
    """Under the profiler, one eager step of decode rows on a 32-SM split with a prefill layer beside them: every
    NCCL kernel of rank 0 ran on the stream of its phase's partition (a green context's stream: its SMs alone)."""
    pytest.importorskip("cuda.bindings")
    from test_multiplex import ShortFirstLayerwise

    mux = engine(split_kv_model, 2, policy="layerwise", multiplex=True, cuda_graph=False)
    try:
        mux.scheduler.planner = ShortFirstLayerwise(decode_sms=(32,))
        decoders = [mux.add_request(periodic_prompt(s, 40), GREEDY) for s in range(2)]
        while any(mux.scheduler.requests[r].num_computed_tokens < 40 for r in decoders):
            mux.step()
        mux.add_request(periodic_prompt(7, 120), GREEDY)
        split = mux.partitions.for_decode(32)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            mux.step()  # the decode rows on the split's decode stream, the prompt's first layer on its prefill stream
            split.decode_stream.synchronize()
            split.prefill_stream.synchronize()
        trace = tmp_path / "trace.json"
        prof.export_chrome_trace(str(trace))
        kernels = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("cat") == "kernel"]
        nccl = {e["args"]["stream"] for e in kernels if "nccl" in e["name"].lower()}
        assert nccl == {_stream_id(split.decode_stream), _stream_id(split.prefill_stream)}, (
            nccl, _stream_id(split.decode_stream), _stream_id(split.prefill_stream))
        while mux.has_unfinished():
            mux.step()
        assert mux.pool.num_free_pages == mux.pool.num_pages
    finally:
        mux.close()
