"""The mux dispatcher on hand-made predictor tables: smallest feasible decode partition, layer count, aggregated
fallback, adaptive mixed chunks, reordering that breaks no TTFT, preemption only when the preempted request keeps its
TTFT (between layers or between chunks), shedding."""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from appliance.engine.kv_cache import PagePool
from appliance.engine.plan import PrefillWork, StepPlan
from appliance.engine.planners.mux import MuxOptions, MuxPlanner
from appliance.engine.request import Request, RequestStatus, SamplingParams
from appliance.engine.scheduler import Scheduler
from appliance.predictor.contention import ContentionGuard
from appliance.predictor.host import MIN_LAUNCHES, HostModel
from appliance.predictor.predictor import Predictor
from appliance.slo.contract import parse_contract

LAYERS, SMS = 32, 132

NO_HOST = HostModel(0.0, 0.0, 0.0, 0.0)  # these rules are checked on device times alone


@dataclass
class Table:
    """A LatencyModel from tables: prefill costs `per_token[sms]` ms per new token; decode costs `decode[sms]` ms
    (all SMs: decode[132]); a mixed step costs `mixed` ms."""

    per_token: dict[int, float] = field(default_factory=lambda: {132: 0.02, 116: 0.025, 100: 0.03, 84: 0.04})
    decode: dict[int, float] = field(default_factory=lambda: {16: 80.0, 32: 45.0, 48: 30.0, 132: 20.0})
    mixed: float = 1000.0

    def prefill_ms(self, items, sms):
        return sum(i.new for i in items) * self.per_token[sms]

    def decode_ms(self, load, sms):
        return self.decode[sms] if load.batch_size else 0.0

    def mixed_ms(self, items, load, sms):
        return self.mixed


CONTRACT = """\
name: t
targets:
  ttft: {ms: 1000}
  tbt: {ms: 50}
overload: {mode: shed}
"""


class Rig:
    def __init__(self, table: Table | None = None, guard: ContentionGuard | None = None, contract: str = CONTRACT,
                 **options) -> None:
        self.table = table or Table()
        self.predictor = Predictor(self.table, guard or ContentionGuard(default=1.0), LAYERS, SMS, (16, 32, 48),
                                   host=NO_HOST)
        # open loop unless a test asks for control: these tests check the plan rules against the stated target;
        # the split's rules alone unless a test asks for temporal steps
        options.setdefault("control", False)
        options.setdefault("temporal", False)
        self.planner = MuxPlanner(parse_contract(contract), self.predictor, MuxOptions(**options))
        self.sched = Scheduler(PagePool(4096, 16), LAYERS, self.planner, max_num_seqs=64)
        self.now = 0.0
        self.sched.clock = lambda: self.now
        self.ids = itertools.count()

    def request(self, tokens: int, arrival: float | None = None) -> Request:
        i = next(self.ids)
        r = Request(f"r{i}", [i * 100_000 + t for t in range(tokens)], SamplingParams(max_tokens=100, ignore_eos=True),
                    arrival_time=self.now if arrival is None else arrival)
        self.sched.add(r)
        return r

    def decoding(self, count: int, tokens: int = 1000) -> list[Request]:
        """Requests already past their prefill (through the scheduler's own mechanisms)."""
        out = []
        for _ in range(count):
            r = self.request(tokens)
            assert self.sched.admit(r)
            work = PrefillWork(r.request_id, 0, r.num_tokens, 0, LAYERS)
            self.sched.update(StepPlan(prefill=(work,)), {r.request_id: 0})
            assert r.status is RequestStatus.DECODING
            out.append(r)
        return out

    def plan(self) -> StepPlan:
        return self.sched.schedule()

    def finish(self, plan: StepPlan) -> None:
        """Complete a plan synchronously (as the CPU runner does)."""
        self.sched.update(plan, {rid: 0 for rid in plan.decode} | {w.request_id: 0 for w in plan.prefill})


def test_smallest_partition_that_meets_tbt():
    rig = Rig()
    rig.decoding(4)
    rig.request(10_000)
    plan = rig.plan()
    assert (plan.decode_sms, plan.prefill_sms) == (32, 100)  # 16 SMs: 80 ms > 50; 32 SMs: 45 ms
    assert len(plan.decode) == 4 and not plan.mixed


def test_contention_guard_moves_to_a_larger_partition():
    guard = ContentionGuard(default=1.2)  # 45 ms * 1.2 = 54 ms misses on 32 SMs; 30 * 1.2 = 36 ms on 48
    rig = Rig(guard=guard)
    rig.decoding(4)
    rig.request(10_000)
    assert rig.plan().decode_sms == 48


def test_layer_count_fills_one_decode_step():
    rig = Rig()
    rig.decoding(2)
    r = rig.request(10_000)
    plan = rig.plan()
    # T_decode = 45 ms on 32 SMs, T_prefill = 10,000 tokens * 0.03 ms on 100 SMs = 300 ms: ceil(45 * 32 / 300) = 5
    assert [(w.request_id, w.layer_start, w.layer_end) for w in plan.prefill] == [(r.request_id, 0, 5)]
    assert (plan.prefill[0].token_start, plan.prefill[0].token_end) == (0, 10_000)
    rig.finish(plan)
    assert r.prefill_layer == 5
    nxt = rig.plan()
    assert [(w.layer_start, w.layer_end) for w in nxt.prefill] == [(5, 10)]


def test_inflight_layers_are_not_launched_twice():
    rig = Rig()
    rig.decoding(2)
    r = rig.request(10_000)
    first = rig.plan()  # launched, not completed: an asynchronous executor still runs it
    assert rig.sched.launched_layer(r) == 5 and r.prefill_layer == 0
    second = rig.plan()
    assert [(w.layer_start, w.layer_end) for w in second.prefill] == [(5, 10)]  # queued behind the first chunk
    third = rig.plan()
    assert [(w.layer_start, w.layer_end) for w in third.prefill] == [(10, 15)]
    # 15 layers of 300 ms / 32 queued: 141 ms, three decode steps of 45 ms: decode only, on its partition
    fourth = rig.plan()
    assert fourth.prefill == () and fourth.decode_sms == 32
    for work in first.prefill + second.prefill + third.prefill:
        rig.sched.complete_prefill(work, None)
    assert r.prefill_layer == 15 and not rig.sched.has_inflight()


def test_chunks_cut_short_by_the_host_queue_deeper():
    """The queue on the prefill stream is measured in predicted time, not in chunks: when the host can launch only
    two layers beside a step, more (shorter) chunks queue, up to about the same three decode steps of prefill."""
    rig = Rig()
    rig.predictor.host = HostModel(0.0, 0.0, 0.0, 25.0)  # 50 ms of launch room a step: two layers of 25 ms
    rig.decoding(2)
    r = rig.request(10_000)
    launched = []
    for _ in range(20):
        plan = rig.plan()
        if not plan.prefill:
            break
        launched.append((plan.prefill[0].layer_start, plan.prefill[0].layer_end))
    # 2 layers = 18.75 ms of prefill: chunks queue until 16 layers (150 ms) reach 3 x 45 ms
    assert launched == [(i, i + 2) for i in range(0, 16, 2)]
    assert rig.sched.launched_layer(r) == 16 and r.prefill_layer == 0


def test_launches_measured_slow_shorten_the_layer_ranges():
    """The host's per-layer launch time is learned from the launches the engine measures: once they run at 20 ms a
    layer (a busy host) instead of the profiled 1 ms, a step launches only the two layers its launch room holds."""
    rig = Rig()
    rig.predictor.host = HostModel(0.0, 0.0, 0.0, 1.0)
    rig.decoding(2)
    r = rig.request(10_000)
    first = rig.plan().prefill[0]
    assert first.layer_end - first.layer_start > 2  # as the device allows: the profiled host launches them in time
    for _ in range(MIN_LAUNCHES):
        rig.planner.observe_launch(1, 2, 2 * 20.0)
    rig.planner.observe_launch(1, 4, 4 * 20.0)  # over MAX_HOST_MS in all: a compile or a CPU engine, not counted
    assert rig.predictor.host.per_layer_ms == 20.0 and rig.planner.snapshot()["host"]["launches"] == MIN_LAUNCHES
    plan = rig.plan()
    assert [(w.request_id, w.layer_end - w.layer_start) for w in plan.prefill] == [(r.request_id, 2)]


def test_aggregated_when_one_mixed_step_meets_tbt():
    rig = Rig(table=Table(mixed=40.0))
    rig.decoding(3)
    r = rig.request(500)
    plan = rig.plan()
    assert plan.mixed and plan.decode_sms is None and plan.prefill_sms is None
    assert [(w.request_id, w.layer_start, w.layer_end) for w in plan.prefill] == [(r.request_id, 0, LAYERS)]
    rig.finish(plan)
    assert r.status is RequestStatus.DECODING


def test_no_decode_runs_prefill_on_all_sms_in_tbt_sized_chunks():
    rig = Rig()
    rig.request(10_000)
    plan = rig.plan()
    # 10,000 tokens * 0.02 ms on 132 SMs = 200 ms for 32 layers: 8 layers fit in 50 ms
    assert plan.decode == () and plan.decode_sms is None and plan.prefill_sms is None
    assert [(w.layer_start, w.layer_end) for w in plan.prefill] == [(0, 8)]


def test_no_decode_queues_one_chunk_on_all_sms_behind_the_running_one():
    """Prefill launched on every SM holds them all until it ends (a decode partition cannot take SMs from it): at
    most one chunk queues behind the one running, then empty plans wait for the oldest launch."""
    rig = Rig()
    r = rig.request(10_000)
    first, second, third = rig.plan(), rig.plan(), rig.plan()
    assert [(w.layer_start, w.layer_end) for w in first.prefill + second.prefill] == [(0, 8), (8, 16)]
    assert third.empty and rig.sched.launched_layer(r) == 16  # 2 x 50 ms queued: nothing more
    rig.sched.complete_prefill(first.prefill[0], None)  # the oldest ends: one more chunk may queue
    assert [(w.layer_start, w.layer_end) for w in rig.plan().prefill] == [(16, 24)]
    assert rig.plan().empty


def test_nothing_queues_on_all_sms_behind_the_launch_that_ends_a_prompt():
    """A prompt whose last layers are in flight decodes next: its first decode step must not wait behind the next
    prompt's layers on every SM (that wait would be its first gap between tokens)."""
    rig = Rig()
    a = rig.request(1_000)  # 20 ms for all 32 layers: one launch ends it
    first = rig.plan()
    assert [(w.request_id, w.layer_start, w.layer_end) for w in first.prefill] == [(a.request_id, 0, LAYERS)]
    b = rig.request(10_000)
    assert rig.plan().empty  # a's prompt ends in flight: b waits
    rig.sched.complete_prefill(first.prefill[0], 7)
    assert a.status is RequestStatus.DECODING
    plan = rig.plan()  # a decodes now, b beside it on the split
    assert plan.decode == (a.request_id,) and plan.decode_sms is not None
    assert [w.request_id for w in plan.prefill] == [b.request_id]


def test_a_prompt_joins_the_batch_unless_that_makes_more_prompts_late():
    """Every member's first token comes when the whole batch has run: a 1,000-token prompt (20 ms, due in 120 ms)
    batched with a 7,000-token one (140 ms) would miss; alone first it makes it, and the long one after it (done at
    160 ms, due at 240) too. Prompts that make no prompt late prefill together."""
    contract = CONTRACT.replace("ttft: {ms: 1000}", "ttft: {ms: 100, per_1k_tokens_ms: 20}")
    rig = Rig(contract=contract)
    short, long_ = rig.request(1_000), rig.request(7_000)
    plan = rig.plan()
    assert {w.request_id for w in plan.prefill} == {short.request_id}
    assert long_.status is RequestStatus.WAITING
    while short.status is not RequestStatus.DECODING:
        rig.finish(plan)
        plan = rig.plan()
    assert {w.request_id for w in plan.prefill} == {long_.request_id}

    rig = Rig(contract=contract)
    a, b = rig.request(1_000), rig.request(1_000)  # 40 ms together, both due in 120 ms
    assert {w.request_id for w in rig.plan().prefill} == {a.request_id, b.request_id}


def test_reorders_shortest_first_when_no_ttft_breaks():
    rig = Rig(max_prefill_tokens=1)  # one prompt per batch, so the order shows
    rig.decoding(1)
    long_ = rig.request(20_000)  # 20,000 * 0.02 = 400 ms on all 132 SMs (no split chosen yet); deadline at 1 s
    short = rig.request(1_000)   # 20 ms
    plan = rig.plan()
    assert [w.request_id for w in plan.prefill] == [short.request_id]
    assert long_.status is RequestStatus.WAITING


def test_when_both_cannot_make_it_the_long_one_goes_last():
    """920 + 100 ms against deadlines of 1,000: one of them is late whichever goes first (in arrival order, the short
    one); the fewest-late rule keeps the short one's deadline and serves the long one after it."""
    rig = Rig(max_prefill_tokens=1)
    rig.decoding(1)
    rig.request(46_000)          # 920 ms of its 1,000 ms
    short = rig.request(5_000)   # 100 ms
    plan = rig.plan()
    assert [w.request_id for w in plan.prefill] == [short.request_id]


def test_reorder_off_keeps_arrival_order():
    rig = Rig(max_prefill_tokens=1, reorder=False)
    rig.decoding(1)
    long_ = rig.request(20_000)
    rig.request(1_000)
    assert [w.request_id for w in rig.plan().prefill] == [long_.request_id]


def long_contract(ms: float) -> str:
    return CONTRACT.replace("ttft: {ms: 1000}", f"ttft: {{ms: {ms}}}")


def start_long_prefill(rig: Rig, tokens: int) -> Request:
    rig.decoding(1)
    long_ = rig.request(tokens)
    rig.finish(rig.plan())  # its first layers ran
    assert 0 < long_.prefill_layer < LAYERS
    return long_


def test_short_prompt_preempts_a_long_one_that_keeps_its_ttft():
    rig = Rig(contract=long_contract(3000))
    long_ = start_long_prefill(rig, 60_000)  # 1.8 s on 100 SMs, deadline 3 s
    rig.now = 0.1
    rig.request(1_000)  # 1.6 s behind the long one still makes its 3 s target: nothing to preempt for
    rig.finish(rig.plan())
    assert rig.planner.stats.pauses == 0

    rig = Rig(contract=long_contract(3000).replace("overload: {mode: shed}", """\
classes:
  bulk: {priority: 0}
  chat: {priority: 0, targets: {ttft: {ms: 200}}}
default_class: bulk
overload: {mode: queue}"""))
    long_ = start_long_prefill(rig, 60_000)
    layer = long_.prefill_layer
    rig.now = 0.1
    short = rig.request(3_000)
    short.slo_class = "chat"  # 200 ms target: behind the long one (1.6 s left) it misses; first, 90 ms
    plan = rig.plan()
    assert rig.planner.stats.pauses == 1
    assert [w.request_id for w in plan.prefill] == [short.request_id]
    assert rig.planner.batches.paused == [long_.request_id] and long_.prefill_layer == layer
    rig.finish(plan)
    assert short.status is RequestStatus.PREFILLING  # 16 of its 32 layers ran
    # no recursion: another urgent prompt does not preempt the preempting one
    other = rig.request(1_000)
    other.slo_class = "chat"
    rig.finish(rig.plan())
    assert rig.planner.stats.pauses == 1 and other.status is RequestStatus.WAITING
    assert short.status is RequestStatus.DECODING
    # the short one done, the long one is the running batch again at its saved layer, and may be preempted anew
    plan = rig.plan()
    assert rig.planner.stats.pauses == 2 and [w.request_id for w in plan.prefill] == [other.request_id]
    assert rig.planner.batches.paused == [long_.request_id] and long_.prefill_layer == layer
    rig.finish(plan)
    plan = rig.plan()
    assert [(w.request_id, w.layer_start) for w in plan.prefill] == [(long_.request_id, layer)]


def test_a_prompt_just_inside_its_deadline_behind_the_batch_pauses_it():
    """"Would miss behind the batch" is judged with the predicted prefill times `pause_margin` longer: a prompt
    predicted to finish just inside its deadline behind a long batch pauses it (the batch spares the time), one
    with room beyond the margin waits its turn, and without the margin neither pauses."""
    def pauses(target_ms: float, margin: float) -> int:
        rig = Rig(contract=long_contract(3000).replace("overload: {mode: shed}", f"""\
classes:
  bulk: {{priority: 0}}
  chat: {{priority: 0, targets: {{ttft: {{ms: {target_ms}}}}}}}
default_class: bulk"""), pause_margin=margin)
        start_long_prefill(rig, 60_000)  # 1.74 s of work left at 0.1 s, deadline 3 s
        rig.now = 0.1
        short = rig.request(1_000)  # about 30 ms: behind the long one, done at about 1.87 s
        short.slo_class = "chat"
        rig.plan()
        return rig.planner.stats.pauses

    assert pauses(1900, 0.2) == 1  # due at 2.0 s: 1.87 s predicted, 2.22 s with the margin
    assert pauses(1900, 0.0) == 0
    assert pauses(2400, 0.2) == 0  # due at 2.5 s: inside even with the margin


def test_no_preemption_when_the_long_one_would_miss():
    rig = Rig(contract=long_contract(1850).replace("overload: {mode: shed}", """\
classes:
  bulk: {priority: 0}
  chat: {priority: 0, targets: {ttft: {ms: 200}}}
default_class: bulk"""))
    start_long_prefill(rig, 60_000)  # 1.74 s of work left at 0.1 s, deadline 1.85 s: it cannot spare 30 ms
    rig.now = 0.1
    short = rig.request(1_000)
    short.slo_class = "chat"
    rig.plan()
    assert rig.planner.stats.pauses == 0 and short.status is RequestStatus.WAITING


def test_a_long_one_late_anyway_is_paused_for_a_short_one_that_makes_it():
    """A batch member that misses its TTFT whether or not it pauses does not stand in the way: pausing it saves the
    short prompt and costs nothing the contract counts."""
    rig = Rig(contract=long_contract(1500).replace("overload: {mode: shed}", """\
classes:
  bulk: {priority: 0}
  chat: {priority: 0, targets: {ttft: {ms: 200}}}
default_class: bulk"""))
    long_ = start_long_prefill(rig, 60_000)  # 1.74 s of work left at 0.1 s, deadline 1.5 s: late either way
    rig.now = 0.1
    short = rig.request(1_000)
    short.slo_class = "chat"
    plan = rig.plan()
    assert rig.planner.stats.pauses == 1 and [w.request_id for w in plan.prefill] == [short.request_id]
    assert rig.planner.batches.paused == [long_.request_id]


def test_a_long_one_late_only_by_a_tight_plan_is_not_paused():
    """Late by the plan is not late by the contract: with the TTFT controller planning at half the targets, a long
    member that would make its own contract deadline is not given up to pause it (judged by the halved deadline, it
    would be late either way)."""
    rig = Rig(contract=long_contract(2500).replace("overload: {mode: shed}", """\
classes:
  bulk: {priority: 0}
  chat: {priority: 0, targets: {ttft: {ms: 200}}}
default_class: bulk"""))
    rig.planner.control("bulk").ttft.headroom = 0.5
    long_ = start_long_prefill(rig, 60_000)  # done at about 1.84 s: within its 2.5 s, past the planned 1.25 s
    rig.now = 0.1
    short = rig.request(1_000)
    short.slo_class = "chat"
    plan = rig.plan()
    assert rig.planner.stats.pauses == 0 and not rig.planner.batches.paused
    assert short.request_id not in [w.request_id for w in plan.prefill] and long_.prefill_layer < LAYERS


def test_sheds_when_the_queue_makes_ttft_impossible():
    rig = Rig()
    rig.decoding(1)
    first = rig.request(20_000)  # 600 ms on 100 SMs (the prefill partition of the last plan)
    rig.plan()
    assert rig.planner.admission_check(rig.sched, Request("x", list(range(1000)), SamplingParams())) is None
    rig.request(10_000)  # 300 ms more ahead
    late = Request("y", list(range(5_000)), SamplingParams(), arrival_time=rig.now)
    retry = rig.planner.admission_check(rig.sched, late)  # first (600) + 300 + own 150 > 1,000 ms
    assert retry is not None and retry >= 1 and rig.planner.stats.shed == 1
    assert first.status is RequestStatus.PREFILLING
    # a prompt that misses even on an idle GPU is served late rather than refused forever
    huge = Request("z", list(range(40_000)), SamplingParams(), arrival_time=rig.now)
    assert rig.planner.admission_check(rig.sched, huge) is None


def test_admission_counts_every_pass_the_running_prompt_has_left():
    """The wait a new prompt would have behind a prompt in passes is the rest of its current pass and every later
    pass: 5 layers into the first of six passes, 1.75 s; the new prompt's own 1.8 s then ends at 3.65 s, past its
    3.6 s deadline, so it is shed. (Counting the layers run against the whole prompt, 1.52 s: admitted, and late.)"""
    rig = Rig(contract=long_contract(3500), max_prefill_tokens=10_000, chunk_tokens=10_000)
    long_ = start_long_prefill(rig, 60_000)
    assert long_.prefill_layer == 5
    rig.now = 0.1
    late = Request("y", list(range(60_000)), SamplingParams(), arrival_time=rig.now)
    assert math.isclose(rig.planner.batches.wait_before(rig.sched, late, 1.8), 10_000 * 0.03 * 27 / 32 / 1e3 + 1.5)
    assert rig.planner.admission_check(rig.sched, late) is not None and rig.planner.stats.shed == 1


def test_admission_counts_the_preemption_a_short_prompt_would_get():
    """A short prompt that would miss behind a long running prefill preempts it at a layer boundary (the long one
    still makes its own deadline), so admission does not shed it; a prompt that could wait does not count on it."""
    rig = Rig(contract=CONTRACT.replace("ttft: {ms: 1000}", "ttft: {ms: 500, per_1k_tokens_ms: 100}"))
    rig.decoding(1)
    long = rig.request(20_000)  # 600 ms on 100 SMs; deadline 2.5 s
    rig.plan()
    assert rig.sched.launched_layer(long) > 0
    rig.now = 0.1
    short = Request("s", list(range(1000)), SamplingParams(), arrival_time=rig.now)  # 30 ms; deadline 0.7 s
    assert rig.planner.admission_check(rig.sched, short) is None and rig.planner.stats.shed == 0
    rig.sched.add(short)
    rig.plan()
    assert rig.planner.stats.pauses == 1 and rig.planner.batches.batch == ["s"]  # as admission expected
    # without preemption it would wait the whole 600 ms and miss: shed
    rig2 = Rig(contract=CONTRACT.replace("ttft: {ms: 1000}", "ttft: {ms: 500, per_1k_tokens_ms: 100}"),
               prefill_pause=False)
    rig2.decoding(1)
    rig2.request(20_000)
    rig2.plan()
    rig2.now = 0.1
    late = Request("s", list(range(1000)), SamplingParams(), arrival_time=rig2.now)
    assert rig2.planner.admission_check(rig2.sched, late) is not None


def test_queue_mode_never_sheds():
    rig = Rig(contract=CONTRACT.replace("mode: shed", "mode: queue"))
    rig.decoding(1)
    for _ in range(5):
        rig.request(20_000)
    rig.plan()
    assert rig.planner.admission_check(rig.sched, Request("y", list(range(5_000)), SamplingParams())) is None


def test_decode_alone_on_all_sms_when_no_split_holds_tbt():
    table = Table(decode={16: 200.0, 32: 120.0, 48: 60.0, 132: 40.0})
    rig = Rig(table=table)
    rig.decoding(8)
    rig.request(10_000)
    plan = rig.plan()
    assert plan.prefill == () and plan.decode_sms is None and len(plan.decode) == 8
    assert math.isclose(rig.predictor.decode_ms(rig.planner._load(rig.sched, plan.decode)), 40.0)


def test_nobody_passes_a_request_recomputing_after_preemption():
    rig = Rig(max_prefill_tokens=1)
    rig.decoding(1)
    stalled = rig.request(20_000)
    stalled.output_token_ids.extend([0] * 3)  # it had decoded three tokens before losing its pages
    short = rig.request(1_000)
    plan = rig.plan()
    assert [w.request_id for w in plan.prefill] == [stalled.request_id] and short.status is RequestStatus.WAITING


@dataclass
class ChunkTable(Table):
    """A mixed step costs `mixed_base` ms plus `mixed_per_token` ms per new token."""

    mixed_base: float = 10.0
    mixed_per_token: float = 0.02

    def mixed_ms(self, items, load, sms):
        return self.mixed_base + self.mixed_per_token * sum(i.new for i in items)


def test_mixed_chunks_when_they_prefill_faster_than_the_split():
    # the split: decode on 32 SMs (45 ms), prefill on 100 SMs at 0.03 ms a token (33 tokens/ms); a mixed step
    # planned to 0.8 x 50 ms holds 10 + 0.02 n <= 40: 1,500 tokens in 40 ms (37.5 tokens/ms)
    rig = Rig(table=ChunkTable(), mixed_chunks=True)
    rig.decoding(3)
    r = rig.request(10_000)
    plan = rig.plan()
    assert plan.mixed and len(plan.decode) == 3 and plan.decode_sms is None
    assert [(w.request_id, w.token_start, w.token_end, w.layer_start, w.layer_end) for w in plan.prefill] == [
        (r.request_id, 0, 1_500, 0, LAYERS)]
    assert rig.planner.stats.chunk_steps == 1 and rig.planner.stats.last_mode == "chunk"
    rig.finish(plan)
    assert r.status is RequestStatus.PREFILLING and r.num_computed_tokens == 1_500
    nxt = rig.plan()
    assert [(w.token_start, w.token_end) for w in nxt.prefill] == [(1_500, 3_000)]
    # the same chunk at 0.03 ms a token (1,000 tokens in 40 ms, 25 tokens/ms) is slower than the split
    rig = Rig(table=ChunkTable(mixed_per_token=0.03), mixed_chunks=True)
    rig.decoding(3)
    rig.request(10_000)
    plan = rig.plan()
    assert not plan.mixed and plan.decode_sms == 32 and rig.planner.stats.chunk_steps == 0
    # off by default
    rig = Rig(table=ChunkTable())
    rig.decoding(3)
    rig.request(10_000)
    assert not rig.plan().mixed


def test_a_short_prompt_preempts_a_chunked_one_between_chunks():
    rig = Rig(table=ChunkTable(), mixed_chunks=True, contract=long_contract(3000).replace(
        "overload: {mode: shed}", """classes:
  bulk: {priority: 0}
  chat: {priority: 0, targets: {ttft: {ms: 200}}}
default_class: bulk
overload: {mode: queue}"""))
    rig.decoding(1)
    long_ = rig.request(60_000)
    rig.finish(rig.plan())
    assert long_.num_computed_tokens == 1_500 and long_.prefill_layer == 0
    rig.now = 0.1
    short = rig.request(3_000)
    short.slo_class = "chat"  # 200 ms: behind the long one's 58,500 tokens (1.17 s on all SMs) it misses
    plan = rig.plan()
    assert rig.planner.stats.pauses == 1 and rig.planner.batches.paused == [long_.request_id]
    assert [w.request_id for w in plan.prefill] == [short.request_id]
    while short.status is not RequestStatus.DECODING:
        rig.finish(plan)
        plan = rig.plan()
    # the long one resumes from the tokens it had computed
    assert [(w.request_id, w.token_start) for w in plan.prefill] == [(long_.request_id, 1_500)]


def test_mixed_chunks_take_tokens_earliest_deadline_first():
    rig = Rig(table=ChunkTable(), mixed_chunks=True, contract=CONTRACT.replace("overload: {mode: shed}", """\
classes:
  bulk: {priority: 0}
  chat: {priority: 0, targets: {ttft: {ms: 250}}}
default_class: bulk
overload: {mode: queue}"""))
    rig.decoding(3)
    long_ = rig.request(10_000)  # due at 1 s
    rig.finish(rig.plan())
    assert long_.num_computed_tokens == 1_500
    rig.now = 0.05
    short = rig.request(300)
    short.slo_class = "chat"  # due at 0.3 s; behind the long one's 8,500 tokens (0.17 s) it still makes it,
    # also with the pause's margin on the predicted times
    plan = rig.plan()
    assert rig.planner.stats.pauses == 0
    assert [(w.request_id, w.token_start, w.token_end) for w in plan.prefill] == [
        (short.request_id, 0, 300), (long_.request_id, 1_500, 2_700)]
    rig.finish(plan)
    assert short.status is RequestStatus.DECODING and long_.num_computed_tokens == 2_700


def test_temporal_when_layers_on_all_sms_go_faster_than_the_split():
    """--temporal-prefill: decode on all SMs (20 ms), then as many layers on all SMs (10,000 tokens x 0.02 ms / 32
    layers = 6.25 ms each) as the 50 ms target holds: 4 layers in a 45 ms gap, 0.089 layers/ms. The split (decode on
    32 SMs, the batch on 100 in 300 ms: 0.107 layers/ms) is faster; with the batch at 0.06 ms a token beside decode
    (600 ms: 0.053 layers/ms) the temporal step is."""
    rig = Rig(temporal=True)
    rig.decoding(2)
    r = rig.request(10_000)
    plan = rig.plan()
    assert plan.decode_sms == 32 and rig.planner.stats.temporal_steps == 0  # the split is faster
    rig = Rig(Table(per_token={132: 0.02, 116: 0.06, 100: 0.06, 84: 0.06}), temporal=True)
    rig.decoding(2)
    r = rig.request(10_000)
    plan = rig.plan()
    assert plan.decode_sms is None and plan.prefill_sms is None and not plan.mixed and len(plan.decode) == 2
    assert [(w.request_id, w.layer_start, w.layer_end) for w in plan.prefill] == [(r.request_id, 0, 4)]
    assert rig.planner.stats.temporal_steps == 1 and rig.planner.stats.last_mode == "temporal"
    rig.finish(plan)
    assert [(w.layer_start, w.layer_end) for w in rig.plan().prefill] == [(4, 8)]


def test_temporal_runs_the_last_layers_the_split_would_spend_a_whole_decode_step_on():
    """The split runs the whole batch at 0.107 layers/ms (10,000 tokens on 100 SMs in 300 ms) where temporal steps
    run 0.089 (4 layers of 6.25 ms after a 20-ms decode step): the split is faster. With 2 layers left, though, the
    split's step still lasts its 45-ms decode step on 32 SMs (0.044 layers/ms, the next batch waiting for the next
    step), where a temporal step runs them in a 32.5-ms gap (0.062 layers/ms)."""
    rig = Rig(temporal=True)
    rig.decoding(2)
    r = rig.request(10_000)
    load = rig.planner._load(rig.sched, tuple(x.request_id for x in rig.sched.decoding))
    items = [rig.planner._dl(rig.sched).item(r)]
    assert rig.planner._temporal_layers(load, 0, items, 50.0) == 0
    assert rig.planner._temporal_layers(load, 26, items, 50.0) == 0  # 6 left: 4.8 layers in 45 ms on the split
    assert rig.planner._temporal_layers(load, 28, items, 50.0) == 4  # 4 left: 4 layers in 45 ms either way (a tie)
    assert rig.planner._temporal_layers(load, 30, items, 50.0) == 2


def test_the_split_s_step_includes_the_host_launching_its_layers():
    """A 1,000-token prompt beside 2 decode rows. On the device the split is faster: its 32 layers on 100 SMs
    (21 ms) run within one 25-ms decode step on 32 SMs (1.28 layers/ms), where a temporal step takes 40 ms (20 ms of
    decode, 20 ms of layers: 0.8 layers/ms). With the host launching a layer in 1.5 ms (overlapped loop), the split's
    step lasts the 48 ms the host takes to launch its 32 layers, as long as the temporal step's gap: the two advance
    alike, and the tie goes to the temporal step."""
    table = Table(per_token={132: 0.02, 116: 0.021, 100: 0.021, 84: 0.021}, decode={16: 80.0, 32: 25.0, 48: 22.0,
                                                                                        132: 20.0})
    rig = Rig(table, temporal=True)
    rig.decoding(2)
    r = rig.request(1_000)
    load = rig.planner._load(rig.sched, tuple(x.request_id for x in rig.sched.decoding))
    items = [rig.planner._dl(rig.sched).item(r)]
    assert rig.planner._temporal_layers(load, 0, items, 50.0) == 0  # no host: the split
    rig.predictor.host = HostModel(0.0, 0.0, 0.0, 1.5, overlapped=True)
    assert rig.planner._temporal_layers(load, 0, items, 50.0) == 32
    rig.predictor.host = HostModel(0.0, 0.0, 0.0, 0.5, overlapped=True)  # the host keeps up with the split: 16 ms
    assert rig.planner._temporal_layers(load, 0, items, 50.0) == 0


def test_temporal_waits_for_prefill_in_flight_on_a_partition():
    """Layers still running on the prefill partition keep decode on the split, and the split's queue is not topped
    up while temporal steps would advance the batch faster (topped up, it would never drain): decode runs alone
    beside it, and temporal steps start once the stream drained."""
    rig = Rig(Table(per_token={132: 0.02, 116: 0.06, 100: 0.06, 84: 0.06}), temporal=True)
    rig.planner.options.temporal = False
    rig.decoding(2)
    rig.request(10_000)
    first = rig.plan()  # on the split, not completed
    assert first.decode_sms == 32 and first.prefill
    rig.planner.options.temporal = True
    second = rig.plan()
    assert second.decode_sms == 32 and not second.prefill and len(second.decode) == 2
    assert rig.planner.stats.temporal_steps == 0 and rig.planner.stats.drain_steps == 1
    for work in first.prefill:
        rig.sched.complete_prefill(work, None)
    assert not rig.sched.has_inflight()
    assert rig.plan().decode_sms is None and rig.planner.stats.temporal_steps == 1


def test_temporal_tops_up_the_split_where_the_split_is_faster():
    """Where the split advances the batch faster than temporal steps would, prefill in flight is topped up as
    without --temporal-prefill."""
    rig = Rig(temporal=True)
    rig.decoding(2)
    rig.request(10_000)
    first = rig.plan()
    assert first.decode_sms == 32 and first.prefill
    second = rig.plan()
    assert second.decode_sms == 32 and second.prefill and rig.planner.stats.drain_steps == 0


def test_when_not_every_deadline_can_be_met_the_fewest_requests_go_last():
    """Arrival order A, B, C would finish B and C late (two misses); moving A, the longest, behind them leaves one."""
    from appliance.engine.planners.deadlines import reorder

    a, b, c = object(), object(), object()
    cost = {id(a): 0.5, id(b): 0.3, id(c): 0.3}
    due = {id(a): 0.6, id(b): 0.7, id(c): 1.0}
    order = reorder([a, b, c], 0.0, lambda r: cost[id(r)], lambda r: due[id(r)], lambda r: 0)
    assert order == [b, c, a]
    # all three on time in arrival order: no one is moved (the shortest-first jumps alone decide)
    due[id(a)], due[id(b)], due[id(c)] = 0.6, 0.9, 1.2
    assert reorder([a, b, c], 0.0, lambda r: cost[id(r)], lambda r: due[id(r)], lambda r: 0) == [a, b, c]
    # a preempted request (deadline -inf) is never moved back
    due[id(a)], due[id(b)], due[id(c)] = float("-inf"), 0.7, 1.0
    assert reorder([a, b, c], 0.0, lambda r: cost[id(r)], lambda r: due[id(r)], lambda r: 0)[0] is a


def test_requests_late_only_by_the_planned_deadline_are_not_moved_back():
    """Planned deadlines (the controller's headroom x the target) can be tighter than the contract's: who goes last
    is judged by the contract's (`due`). Planned, B misses behind A and A would move back; by the contract both
    make it in arrival order, and B may not pass A (A would miss its planned deadline behind B)."""
    from appliance.engine.planners.deadlines import reorder

    a, b = object(), object()
    cost = {id(a): 0.5, id(b): 0.3}
    planned = {id(a): 0.5, id(b): 0.7}
    contract = {id(a): 1.0, id(b): 1.4}
    args = ([a, b], 0.0, lambda r: cost[id(r)], lambda r: planned[id(r)], lambda r: 0)
    assert reorder(*args) == [b, a]
    assert reorder(*args, due=lambda r: contract[id(r)]) == [a, b]


def test_prompts_join_only_while_every_running_request_keeps_room_to_grow():
    """Each admitted prompt's own growth counts against the next one: a pool of 300 pages, two decoding requests
    holding 63 pages each and needing 6 more; a 1,000-token prompt fits, then one of 1,410 tokens would leave 16 pages
    free against the 18 the running requests (the first prompt's 6 now among them) may still take."""
    rig = Rig()
    rig.sched = Scheduler(PagePool(300, 16), LAYERS, rig.planner, max_num_seqs=64)
    rig.sched.clock = lambda: rig.now
    rig.decoding(2)
    short, middle, long = rig.request(1000), rig.request(1410), rig.request(2500)
    calls = []
    growth = rig.planner.batches.growth
    rig.planner.batches.growth = lambda sched, q: calls.append(q) or growth(sched, q)
    rig.plan()
    assert short.status is RequestStatus.PREFILLING
    assert middle.status is RequestStatus.WAITING and long.status is RequestStatus.WAITING
    assert rig.sched.pool.num_free_pages >= rig.planner.batches.reserve(rig.sched)
    # the running requests' growth summed once for the whole queue (it was summed again for every prompt checked)
    del calls[:]
    rig.planner.batches.start(rig.sched, rig.now)
    assert len(calls) <= len(rig.sched.decoding) + len(rig.sched.prefilling) + 1


def test_a_long_one_in_passes_counts_every_pass_left():
    """Layers run so far are of the current pass only: a long prompt 5 layers into the first of six passes has
    five passes left besides, and is late either way here (1.85 s of work against its 1.65 s), so a short prompt
    that makes its own TTFT when run first pauses it. Counting the layers run against the whole prompt would leave
    1.52 s, "on time without the pause", and keep the short one waiting until it was late too."""
    rig = Rig(contract=long_contract(1650).replace("overload: {mode: shed}", """\
classes:
  bulk: {priority: 0}
  chat: {priority: 0, targets: {ttft: {ms: 200}}}
default_class: bulk"""), max_prefill_tokens=10_000, chunk_tokens=10_000)
    long_ = start_long_prefill(rig, 60_000)
    assert long_.prefill_layer == 5 and long_.num_computed_tokens == 0
    current, later = rig.planner.batches.left_ms(rig.sched, [long_], 100)
    assert math.isclose(current, 10_000 * 0.03 * 27 / 32) and math.isclose(later, 50_000 * 0.03)
    rig.now = 0.1
    short = rig.request(3_000)  # 90 ms on 100 SMs
    short.slo_class = "chat"
    plan = rig.plan()
    assert rig.planner.stats.pauses == 1 and [w.request_id for w in plan.prefill] == [short.request_id]
    assert rig.planner.batches.paused == [long_.request_id]


def run_prefill_through(rig: Rig, r: Request) -> list[tuple[int, int]]:
    """Plan and complete steps until `r` decodes; the token ranges of its passes, in order."""
    passes: list[tuple[int, int]] = []
    for _ in range(200):
        if r.status is RequestStatus.DECODING:
            return passes
        plan = rig.plan()
        for w in plan.prefill:
            if w.request_id == r.request_id and (w.token_start, w.token_end) not in passes:
                passes.append((w.token_start, w.token_end))
        rig.finish(plan)
    raise AssertionError(f"{r.request_id} still prefilling: {passes}")


def test_a_long_prompt_prefills_in_passes_of_chunk_tokens():
    """Activations grow with a pass's tokens and the engine sizes their memory for max_num_batched_tokens: a longer
    prompt prefills in passes of that many (every layer each), and decodes once the last one ends."""
    rig = Rig(max_prefill_tokens=8_192, chunk_tokens=8_192)
    rig.decoding(2)
    r = rig.request(20_000)
    first = rig.plan()
    assert {(w.token_start, w.token_end) for w in first.prefill} == {(0, 8_192)}
    # the predictor plans the pass it runs: 8,192 tokens at 0.03 ms on 100 SMs = 246 ms, ceil(45 * 32 / 246) = 6
    assert [(w.layer_start, w.layer_end) for w in first.prefill] == [(0, 6)]
    rig.finish(first)
    assert run_prefill_through(rig, r) == [(0, 8_192), (8_192, 16_384), (16_384, 20_000)]
    assert r.num_computed_tokens == 20_000 and len(r.output_token_ids) == 1


def test_passes_cut_every_plan_kind():
    """No decode (all SMs), temporal steps and the aggregated mixed step cut the prompt alike."""
    rig = Rig(chunk_tokens=1_000)
    r = rig.request(2_500)
    assert run_prefill_through(rig, r) == [(0, 1_000), (1_000, 2_000), (2_000, 2_500)]
    rig = Rig(chunk_tokens=1_000, temporal=True)
    rig.decoding(1)
    r = rig.request(2_500)
    assert run_prefill_through(rig, r) == [(0, 1_000), (1_000, 2_000), (2_000, 2_500)]
    rig = Rig(table=Table(mixed=1.0), chunk_tokens=1_000)  # the whole prompt fits a mixed step: it still passes in 3
    rig.decoding(1)
    r = rig.request(2_500)
    assert run_prefill_through(rig, r) == [(0, 1_000), (1_000, 2_000), (2_000, 2_500)]


def test_no_cap_prefills_the_whole_prompt_in_one_pass():
    rig = Rig()
    rig.decoding(1)
    r = rig.request(20_000)
    assert run_prefill_through(rig, r) == [(0, 20_000)]


def test_prompts_between_passes_rejoin_within_the_budget():
    """Prompts left between passes (here: two that ran a mixed chunk each) rejoin a batch only while their tokens fit
    the batch's budget; the one left out follows in the next batch."""
    rig = Rig(max_prefill_tokens=5_000, chunk_tokens=5_000)
    rig.decoding(1)
    a, b = rig.request(4_000), rig.request(4_000)
    for r in (a, b):  # a mixed chunk of 500 tokens each, done
        assert rig.sched.admit(r)
        rig.sched.update(StepPlan(prefill=(PrefillWork(r.request_id, 0, 500, 0, LAYERS),)), {})
        assert r.num_computed_tokens == 500 and r.status is RequestStatus.PREFILLING
    plan = rig.plan()
    assert {w.request_id for w in plan.prefill} == {a.request_id}  # 3,500 + 3,500 > 5,000
    assert run_prefill_through(rig, a) == [(500, 4_000)]
    assert run_prefill_through(rig, b) == [(500, 4_000)]


def test_the_next_pass_launches_behind_the_last_without_waiting_for_it():
    """The executor orders a pass's layers after the last pass's on the GPU: the planner launches the next pass as
    soon as the last has every layer launched, and the scheduler completes them in order."""
    rig = Rig(max_prefill_tokens=1_000, chunk_tokens=1_000)
    r = rig.request(2_500)
    launched = []
    for _ in range(LAYERS * 3):
        plan = rig.plan()  # nothing completes: every launch stays in flight
        launched += [(w.token_start, w.token_end, w.layer_start, w.layer_end) for w in plan.prefill]
        if launched and launched[-1][1] == 2_500 and launched[-1][3] == LAYERS:
            break
    passes = [(a, b) for a, b, start, _ in launched if start == 0]
    assert passes == [(0, 1_000), (1_000, 2_000), (2_000, 2_500)]
    for (a, b, s1, e1), (c, d, s2, e2) in zip(launched, launched[1:]):  # each pass's layers in order, then the next
        assert (c, d, s2) == ((a, b, e1) if e1 < LAYERS else (b, min(b + 1_000, 2_500), 0))
    assert r.num_computed_tokens == 0 and rig.sched.pass_layer(r) == LAYERS and rig.sched.pass_start(r) == 2_500
    for a, b, start, end in launched:  # the executor completes them in launch order
        rig.sched.complete_prefill(PrefillWork(r.request_id, a, b, start, end), 0 if b == 2_500 and end == LAYERS
                                   else None)
        if end == LAYERS and b < 2_500:
            assert r.num_computed_tokens == b and r.status is RequestStatus.PREFILLING
    assert r.status is RequestStatus.DECODING and r.num_computed_tokens == 2_500 and not rig.sched.inflight
