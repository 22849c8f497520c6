"""The multiplex executor on the GPU: each phase's kernels run on its partition's SMs; greedy outputs with prefill and
decode concurrent, partition switches, a preemption between layers and an abort mid-prefill equal serial execution
token for token; one row padded to the two-row graph on a split does too; no page is lost."""
from __future__ import annotations

import itertools

import pytest
import torch
from copy_model import periodic_prompt
from spies import stepper

from appliance.config import Config
from appliance.engine.engine import Engine
from appliance.engine.factory import build_engine
from appliance.engine.plan import PrefillWork, StepPlan
from appliance.engine.planners.base import Planner, admit_fcfs, chunk_end, reserve_all
from appliance.engine.request import SamplingParams
from appliance.engine.scheduler import Scheduler

pytest.importorskip("triton")
from smid import launch_probe, read_probe  # noqa: E402

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


class ShortFirstLayerwise(Planner):
    """Test planner: one layer per step for the shortest pending prompt (a short prompt preempts a long one at a
    layer boundary), every decoding request decodes, and the decode partition alternates between two sizes."""

    name = "test-short-first"

    def __init__(self, decode_sms=(32, 64)) -> None:
        self.sizes = itertools.cycle(decode_sms)
        self.preemptions = 0
        self._last = None

    def plan(self, sched: Scheduler) -> StepPlan:
        decode = reserve_all(sched, list(sched.decoding))
        admit_fcfs(sched, 100_000)
        pending = sched.pending_prefills()
        works = ()
        if pending:
            r, layer = min(pending, key=lambda p: p[0].num_tokens)
            if self._last not in (None, r.request_id) and self._last in {q.request_id for q, _ in pending}:
                self.preemptions += 1
            self._last = r.request_id
            works = (PrefillWork(r.request_id, r.num_computed_tokens, chunk_end(r, 4096), layer, layer + 1),)
        busy = bool(works) or sched.has_inflight()
        return StepPlan(decode=decode, prefill=works, decode_sms=next(self.sizes) if decode and busy else None)


def engine(path, **kw) -> Engine:
    return build_engine(Config.flat(model=path, device="cuda",
                                    num_gpu_blocks_override=1024, max_num_seqs=16, attention_backend="flashinfer",
                                    compile=True, **kw))


def test_multiplexed_outputs_equal_serial_with_switches_preemption_and_abort(copy_model):
    ref = engine(copy_model, policy="serial", multiplex=False)
    mux = engine(copy_model, policy="layerwise", multiplex=True)
    assert mux.executor.multiplexed and len(mux.partitions.splits) >= 2
    planner = ShortFirstLayerwise()
    mux.scheduler.planner = planner
    decoders = [periodic_prompt(s, 30 + s) for s in range(4)]
    long_prompt, short_prompt, doomed = periodic_prompt(10, 150), periodic_prompt(11, 40), periodic_prompt(12, 90)
    expected = ref.generate(decoders + [long_prompt, short_prompt], GREEDY)

    probes: list[tuple[str, int, int, torch.Tensor]] = []
    for name in ("decode", "prefill"):
        inner = getattr(mux.runner, name)

        def spy(*args, _inner=inner, _name=name, **kwargs):
            part = mux.executor.current
            probes.append((_name, part.decode_sms, part.prefill_sms, launch_probe()))
            return _inner(*args, **kwargs)

        setattr(mux.runner, name, spy)

    outputs: dict[str, list[int]] = {}
    steps = stepper(mux, outputs)

    ids = [mux.add_request(p, GREEDY) for p in decoders]
    steps(10)  # the decoders prefill (a layer a step), then decode
    doomed_id = mux.add_request(doomed, GREEDY)
    steps(1)  # its first layer is launched
    assert mux.scheduler.launched_layer(mux.scheduler.requests[doomed_id]) == 1
    assert mux.abort(doomed_id)  # mid-prefill
    long_id = mux.add_request(long_prompt, GREEDY)
    steps(1)  # the long prompt's first layer
    short_id = mux.add_request(short_prompt, GREEDY)
    steps()  # the short prompt preempts it at the layer boundary; then it resumes from its saved layer
    assert planner.preemptions >= 1
    assert mux.executor.switches >= 2
    assert mux.executor.layers_launched > 0
    assert mux.pool.num_free_pages == mux.pool.num_pages
    for rid, exp in zip(ids + [long_id, short_id], expected):
        assert outputs[rid] == exp.token_ids, rid
    assert doomed_id not in outputs or len(outputs[doomed_id]) == 0

    for part in mux.partitions.partitions:
        part.decode_stream.synchronize()
        part.prefill_stream.synchronize()
    split_sizes = {(p.decode_sms, p.prefill_sms) for p in mux.partitions.splits}
    checked = 0
    for name, decode_sms, prefill_sms, out in probes:
        if (decode_sms, prefill_sms) not in split_sizes:
            continue  # a phase alone on all SMs
        used = read_probe(out)
        assert len(used) == (decode_sms if name == "decode" else prefill_sms), (name, decode_sms, prefill_sms)
        checked += 1
    assert checked >= 4


def test_one_row_graph_choice_and_padded_rows_keep_outputs(copy_model):
    """Each split's one-row graph was timed against its two-row graph at capture and the faster kept; one row
    padded to two rows, decoding on every split partition beside a prefill, gives the same greedy tokens as one row
    alone, and frees every page."""
    ref = engine(copy_model, policy="serial", multiplex=False)
    mux = engine(copy_model, policy="layerwise", multiplex=True)
    names = {p.name for p in mux.partitions.partitions}
    assert set(mux.executor.one_row_graphs) == {p.name for p in mux.partitions.splits}
    assert mux.executor._graphs[mux.partitions.full.name].padded_size(1) == 1
    for name, choice in mux.executor.one_row_graphs.items():
        assert choice["one_row_ms"] > 0 and choice["two_row_ms"] > 0
        assert mux.executor._graphs[name].padded_size(1) == (2 if choice["padded"] else 1)
    assert mux.startup["one_row_padded"] == [n for n, c in mux.executor.one_row_graphs.items() if c["padded"]]
    for name in names:  # as where the single-token graph ran slower
        mux.executor._graphs[name].pad_one_row()
        assert mux.executor._graphs[name].padded_size(1) == 2
    mux.scheduler.planner = ShortFirstLayerwise([p.decode_sms for p in mux.partitions.splits])
    decoder = periodic_prompt(3, 37)
    fillers = [periodic_prompt(20 + i, 50) for i in range(16)]  # one prompt after another beside the decoding row
    first_only = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    expected = ref.generate([decoder] + fillers, [GREEDY] + [first_only] * len(fillers))
    replays = {p.name: mux.executor._graphs[p.name].replays for p in mux.partitions.splits}
    outputs: dict[str, list[int]] = {}
    steps = stepper(mux, outputs)
    ids = [mux.add_request(decoder, GREEDY)]
    steps(2)  # its prefill, a layer a step
    for prompt in fillers:
        ids.append(mux.add_request(prompt, first_only))
        steps(2)
    steps()
    assert [outputs[rid] for rid in ids] == [c.token_ids for c in expected]
    assert all(mux.executor._graphs[name].replays > n for name, n in replays.items()), replays
    assert mux.pool.num_free_pages == mux.pool.num_pages
