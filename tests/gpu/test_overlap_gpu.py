"""The overlapped step loop on CUDA: with decode CUDA graphs (flashinfer, torch.compile) and with SM partitions (green
contexts, prefill layers beside decode, decode switching partitions), the overlapped loop's outputs equal the
synchronous loop's token for token — greedy and seeded, stop tokens, max_tokens ending at every step, aborts at every
step, preemption under a small KV cache, long prompts in passes — and no page is left behind; the next step's
attention plan is staged in two pinned buffers used in turn; prefill layers run after the decode rows in the step's
own stream (temporal steps) as correctly as beside them."""
from __future__ import annotations

import itertools

import pytest
from copy_model import PERIOD, VOCAB, periodic_prompt
from latency_tables import SlowTable
from spies import step_through

from appliance.attention.triton_decode import MAX_BATCH
from appliance.config import Config
from appliance.engine.engine import Engine
from appliance.engine.factory import build_engine
from appliance.engine.plan import PrefillWork, StepPlan
from appliance.engine.planners.base import Planner, admit_fcfs, chunk_end, reserve_all
from appliance.engine.planners.mux import MuxOptions, MuxPlanner
from appliance.engine.request import Request, SamplingParams, ThinkingLimit
from appliance.engine.scheduler import Scheduler
from appliance.predictor.contention import ContentionGuard
from appliance.predictor.host import HostModel
from appliance.predictor.predictor import Predictor


class AlternatingLayerwise(Planner):
    """Test planner: every decoding request decodes, each pending prompt advances one layer a step, and the decode
    partition alternates between two sizes while prefill runs (so consecutive decode steps run on different streams)."""

    name = "test-alternating"

    def __init__(self, decode_sms=(32, 64)) -> None:
        self.sizes = itertools.cycle(decode_sms)

    def plan(self, sched: Scheduler) -> StepPlan:
        decode = reserve_all(sched, list(sched.decoding))
        admit_fcfs(sched, 100_000)
        works = tuple(PrefillWork(r.request_id, r.num_computed_tokens, chunk_end(r, 4096), layer, layer + 1)
                      for r, layer in sched.pending_prefills() if r.request_id not in sched.inflight)
        busy = bool(works) or sched.has_inflight()
        return StepPlan(decode=decode, prefill=works, decode_sms=next(self.sizes) if decode and busy else None)


class AlternatingTemporal(AlternatingLayerwise):
    """Test planner: each pending prompt advances one layer a step, alternately after the decode rows in the step's
    own stream on all SMs (`prefill_after_decode`, mux's temporal steps) and beside them on a 32-SM split, so a
    prompt's activations pass between streams both ways."""

    name = "test-alternating-temporal"

    def __init__(self) -> None:
        self.turns = itertools.cycle((True, False))

    def plan(self, sched: Scheduler) -> StepPlan:
        decode = reserve_all(sched, list(sched.decoding))
        admit_fcfs(sched, 100_000)
        works = tuple(PrefillWork(r.request_id, r.num_computed_tokens, chunk_end(r, 4096), layer, layer + 1)
                      for r, layer in sched.pending_prefills() if r.request_id not in sched.inflight)
        if next(self.turns):
            return StepPlan(decode=decode, prefill=works, prefill_after_decode=True)
        busy = bool(works) or sched.has_inflight()
        return StepPlan(decode=decode, prefill=works, decode_sms=32 if decode and busy else None)


def build(path, **kw) -> Engine:
    # no prefix cache: the second run of a comparison computes its prompts as the first did
    kw = {"num_gpu_blocks_override": 512, "max_num_seqs": 32, "compile": True, "enable_prefix_caching": False, **kw}
    return build_engine(Config.flat(model=path, device="cuda", attention_backend="flashinfer", cuda_graph=True, **kw))


@pytest.fixture(scope="module")
def fast(copy_model) -> Engine:
    return build(copy_model)


@pytest.fixture(scope="module")
def multiplexed(copy_model) -> Engine:
    engine = build(copy_model, policy="layerwise", multiplex=True, max_num_seqs=16)
    assert engine.executor.multiplexed and len(engine.partitions.splits) >= 2
    engine.scheduler.planner = AlternatingLayerwise()
    return engine


def stop_after(seed: int, length: int, n: int) -> int:
    """A token that ends the greedy continuation of periodic_prompt(seed, length) at its n-th token or earlier."""
    return periodic_prompt(seed, length + n)[length + n - 1]


THINK_END = tuple(t for t in range(3, VOCAB) if t not in periodic_prompt(24, 36))[:2]  # tokens the prompt lacks
ABORTED = (3, 12)  # the requests `compare` aborts (in order of creation: a greedy one and the stop-token one)


def workload(engine: Engine) -> dict[int, list[Request]]:
    """max_tokens ending at every step from 1 to 12, stop tokens, seeded sampling, logprobs, a think block's budget,
    penalties (counted on the device); staggered arrivals (requests 0-11 greedy, 12 stopped by a token, 13 seeded, 14
    with logprobs, 15 longer, 16 its think block ended after 3 tokens, 17 seeded and penalised)."""
    greedy = [engine.make_request(periodic_prompt(s, 30 + 3 * s),
                                  SamplingParams(max_tokens=s, temperature=0, ignore_eos=True)) for s in range(1, 13)]
    others = [
        engine.make_request(periodic_prompt(20, 40), SamplingParams(max_tokens=20, temperature=0,
                                                                     stop_token_ids=[stop_after(20, 40, 5)])),
        engine.make_request(periodic_prompt(21, 2 * PERIOD + 3), SamplingParams(max_tokens=16, temperature=1.0,
                                                                                seed=7, ignore_eos=True)),
        engine.make_request(periodic_prompt(22, 33), SamplingParams(max_tokens=10, temperature=0, logprobs=2,
                                                                    ignore_eos=True)),
        engine.make_request(periodic_prompt(23, 50), SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)),
        engine.make_request(periodic_prompt(24, 36), SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                                    thinking=ThinkingLimit(3, (1,), THINK_END, True))),
        engine.make_request(periodic_prompt(25, 2 * PERIOD + 5), SamplingParams(
            max_tokens=14, temperature=0.8, seed=9, ignore_eos=True, repetition_penalty=1.3, frequency_penalty=0.5)),
    ]
    return {0: greedy[:6] + others[:2], 2: greedy[6:], 5: others[2:]}


def drive(engine: Engine, overlap: bool, arrivals: dict[int, list[Request]],
          aborts: dict[int, list[str]] | None = None) -> dict[str, list[tuple]]:
    """Step the engine with the loop overlapped or not, submitting `arrivals[k]` and aborting `aborts[k]` before step
    k; every request's outputs (token ids, finished, reason, log-probability token ids)."""
    engine.async_scheduling = overlap
    outs = step_through(engine, arrivals, aborts, lambda o: (
        tuple(o.new_token_ids), o.finished, o.finish_reason,
        tuple(lp.token_id for lp in o.logprobs) if o.logprobs else None))
    assert not engine.scheduler.requests and engine._launched is None
    assert engine.pool.num_free_pages == engine.pool.num_pages
    assert not engine.runner.batches._mirrors and not engine.executor.has_inflight()
    assert not engine.runner.penalties._slot  # every penalised request's row given back
    return outs


def by_index(outs: dict[str, list[tuple]], engine_first: int) -> dict[int, list[tuple]]:
    """Outputs keyed by submission order (request ids count on across runs of one engine)."""
    return {int(rid.split("-")[1]) - engine_first: v for rid, v in outs.items()}


def compare(engine: Engine, aborts_at: int | None = None) -> tuple[dict, dict]:
    results = []
    for overlap in (False, True):
        first = int(engine.next_request_id().split("-")[1]) + 1
        arrivals = workload(engine)
        made = sorted((r for rs in arrivals.values() for r in rs), key=lambda r: int(r.request_id.split("-")[1]))
        aborts = {aborts_at: [made[i].request_id for i in ABORTED]} if aborts_at is not None else None
        seen = []
        collect = engine.executor.collect
        engine.executor.collect = lambda step: seen.append(step.overlapped) or collect(step)
        try:
            results.append(by_index(drive(engine, overlap, arrivals, aborts), first))
        finally:
            del engine.executor.collect
        assert any(seen) == overlap
    return results[0], results[1]


def test_overlapped_equals_synchronous_with_cuda_graphs(fast):
    replays = fast.runner.graphs.replays
    sync, overlapped = compare(fast)
    assert overlapped == sync
    assert fast.runner.graphs.replays > replays
    lengths = sorted(sum(len(o[0]) for o in outs) for outs in sync.values())
    assert set(range(1, 13)) <= set(lengths)
    assert sync[12][-1][2] == "stop" and sum(len(o[0]) for o in sync[12]) <= 5  # the stop token
    assert [t for o in sync[16] for t in o[0]][3:5] == list(THINK_END)  # the think block's end, forced


def test_aborts_at_every_step_with_cuda_graphs(fast):
    """Two requests aborted before each engine step in turn: the others are unchanged, the aborted ones got a prefix
    of their output."""
    full, _ = compare(fast)
    for k in range(16):
        sync, overlapped = compare(fast, aborts_at=k)
        for got in (sync, overlapped):
            assert {i: v for i, v in got.items() if i not in ABORTED} == \
                {i: v for i, v in full.items() if i not in ABORTED}, k
            for i in ABORTED:
                tokens = [t for o in got.get(i, []) for t in o[0]]
                assert tokens == [t for o in full[i] for t in o[0]][:len(tokens)], (k, i)


def test_overlapped_equals_synchronous_on_sm_partitions(multiplexed):
    switches = multiplexed.executor.switches
    sync, overlapped = compare(multiplexed)
    assert overlapped == sync
    assert multiplexed.executor.switches > switches and multiplexed.executor.layers_launched > 0
    for k in (1, 3, 6):
        sync, overlapped = compare(multiplexed, aborts_at=k)
        assert {i: v for i, v in overlapped.items() if i not in ABORTED} == \
            {i: v for i, v in sync.items() if i not in ABORTED}


def test_prefill_after_decode_alternating_with_the_split(copy_model):
    """Prefill layers alternately after the decode rows in the step's stream and beside them on a split: the greedy
    outputs continue their periodic prompts, overlapped or not, and equal each other; the layers after the decode
    rows are timed on the device."""
    engine = build(copy_model, policy="layerwise", multiplex=True, max_num_seqs=16)
    engine.scheduler.planner = AlternatingTemporal()
    after = []
    inner = engine.executor.run
    engine.executor.run = lambda plan, *a, **k: (after.append(plan.prefill_after_decode and bool(plan.prefill)),
                                                 inner(plan, *a, **k))[1]
    timed, collect = [], engine.executor.collect

    def collecting(step):  # the device time of the layers run after the decode rows, as the planner is handed it
        tokens = collect(step)
        timed.append(engine.executor.last_after_ms)
        return tokens

    engine.executor.collect = collecting
    sync, overlapped = compare(engine)
    assert overlapped == sync and any(after) and engine.executor.layers_launched > 0
    assert any(ms is not None and ms > 0 for ms in timed)
    for s in range(1, 13):  # the greedy requests: s tokens after a periodic prompt of 30 + 3s
        tokens = [t for o in sync[s - 1] for t in o[0]]
        assert tokens == periodic_prompt(s, 30 + 4 * s)[30 + 3 * s:], s


def test_overlapped_equals_synchronous_under_the_mux_policy(copy_model):
    """The mux planner itself (the roofline prior, SM partitions by default), staggered arrivals, on and off."""
    engine = build(copy_model, policy="mux", max_num_seqs=16)
    sync, overlapped = compare(engine)
    assert overlapped == sync


def test_mux_prefills_long_prompts_in_passes(copy_model):
    """Prompts longer than --max-num-batched-tokens prefill in passes of that many tokens (every layer each), the
    next launched behind the last without waiting for it; greedy continuations stay exact, overlapped or not."""
    engine = build(copy_model, policy="mux", max_num_seqs=16, max_num_batched_tokens=16)
    parts = engine.partitions
    engine.scheduler.planner = MuxPlanner(engine.contract, Predictor(
        SlowTable(), ContentionGuard(default=1.0), engine.model.config.num_layers, parts.total_sms,
        tuple(p.decode_sms for p in parts.splits), host=HostModel(0.0, 0.0, 0.0, 0.0)),
        MuxOptions(max_prefill_tokens=16, chunk_tokens=16, control=False))
    plans = []
    inner = engine.scheduler.schedule
    engine.scheduler.schedule = lambda: plans.append(inner()) or plans[-1]
    sync, overlapped = compare(engine)
    assert overlapped == sync
    for s in range(1, 13):  # the greedy requests: s tokens after a periodic prompt of 30 + 3s
        tokens = [t for o in sync[s - 1] for t in o[0]]
        assert tokens == periodic_prompt(s, 30 + 4 * s)[30 + 3 * s:], s
    works = [w for p in plans for w in p.prefill]
    assert all(w.num_tokens <= 16 for w in works) and any(w.token_start > 0 and w.layer_start == 0 for w in works)
    assert engine.pool.num_free_pages == engine.pool.num_pages


def test_preemption_under_a_small_kv_cache(copy_model):
    """Twenty pages for eighteen requests: preemption, also of requests whose latest token is still on the device.
    Under serial (mux, the default on CUDA, admits within the free pages and never preempts this workload)."""
    engine = build(copy_model, policy="serial", num_gpu_blocks_override=20, compile=False)
    pending = []
    inner = engine.scheduler.preempt
    engine.scheduler.preempt = lambda r: (pending.append(r.num_pending), inner(r))[1]
    sync, overlapped = compare(engine)
    assert overlapped == sync
    assert any(pending)


def test_plans_take_pinned_buffers_in_turn(fast, copy_model):
    """muxd's Triton decode graphs (the default) stage their plans through pinned rings of their own, and with
    --decode-kernel flashinfer the flashinfer decode graphs of one stream share one staging ring; the overlapped loop
    used each buffer of the ring it planned through."""
    prompt = periodic_prompt(30, 40)

    def requests(engine: Engine, rows: int) -> dict[int, list[Request]]:
        return {0: [engine.make_request(prompt, SamplingParams(max_tokens=8, temperature=0)) for _ in range(rows)]}

    backends = {size: backend for size, (_, backend) in fast.runner.graphs._graphs.items()}
    assert all(b.triton is not None for b in backends.values())
    for rows in (1, MAX_BATCH + 1):  # the split-KV kernel, then the balanced one
        drive(fast, True, requests(fast, rows))
        ring = backends[min(s for s in backends if s >= rows)].triton._staging.ring
        assert all(e is not None for e in ring.events) and all(b.is_pinned() for b in ring.items)
    engine = build(copy_model, decode_kernel="flashinfer")
    shared = [backend for _, backend in engine.runner.graphs._graphs.values()]
    assert shared and all(b.triton is None for b in shared)
    assert len({id(b.staging) for b in shared}) == 1
    staging = shared[0].staging
    assert all(b.is_pinned() for b in staging.buffers)
    for backend in shared:
        assert backend.decode._pin_memory_int_workspace_buffer.data_ptr() in {b.data_ptr() for b in staging.buffers}
    drive(engine, True, requests(engine, 3))
    assert len(staging.ring.events) >= 2 and all(e is not None for e in staging.ring.events)
    assert all(b is not None and b.is_pinned() for b in staging.buffers)
