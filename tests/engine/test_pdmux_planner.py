"""The pdmux planner (SGLang's PD-multiplexing policy) on scripted batches: its stream groups and their mapping onto
muxd's partitions, the group picked by decode batch size alone and re-picked only when a prefill batch forms or
finishes or decode empties (after both streams synchronise), forward_count layers per step, one prefill batch at a
time formed as SGLang's PrefillAdder forms one."""
from __future__ import annotations

import itertools

import pytest

from appliance.config import SchedulerSettings
from appliance.engine.kv_cache import PagePool
from appliance.engine.plan import PrefillWork, StepPlan
from appliance.engine.planners.pdmux import PdmuxOptions, PdmuxPlanner
from appliance.engine.planners.pdmux_groups import choose_group, sglang_divisions, stream_groups
from appliance.engine.planners.registry import build_planner
from appliance.engine.request import Request, RequestStatus, SamplingParams
from appliance.engine.scheduler import Scheduler
from appliance.errors import ConfigError
from appliance.predictor.predictor import partition_choices

LAYERS, SMS = 32, 132
PARTITIONS = partition_choices(SMS)  # 16, 32, ..., 112: the executor's default decode partitions
H200_EXAMPLE = ((112, 20, 1), (104, 28, 5), (96, 36, 10), (80, 52, 15), (64, 68, 20), (56, 76, 25))


class Rig:
    def __init__(self, pages: int = 4096, **options) -> None:
        self.planner = PdmuxPlanner(PdmuxOptions(**options), SMS, PARTITIONS)
        self.sched = Scheduler(PagePool(pages, 16), LAYERS, self.planner, max_num_seqs=256)
        self.ids = itertools.count()

    def request(self, tokens: int, max_tokens: int = 100) -> Request:
        i = next(self.ids)
        r = Request(f"r{i}", [i * 100_000 + t for t in range(tokens)],
                    SamplingParams(max_tokens=max_tokens, ignore_eos=True), arrival_time=0.0)
        self.sched.add(r)
        return r

    def decoding(self, count: int, tokens: int = 100, max_tokens: int = 100) -> list[Request]:
        """Requests already past their prefill (through the scheduler's own mechanisms, not the planner)."""
        out = []
        for _ in range(count):
            r = self.request(tokens, max_tokens)
            assert self.sched.admit(r)
            self.sched.update(StepPlan(prefill=(PrefillWork(r.request_id, 0, r.num_tokens, 0, LAYERS),)),
                              {r.request_id: 0})
            assert r.status is RequestStatus.DECODING
            out.append(r)
        return out

    def plan(self) -> StepPlan:
        return self.sched.schedule()

    def complete(self, *plans: StepPlan) -> None:
        """The prefill launches of `plans` finish on the GPU (the asynchronous executor's poll)."""
        for plan in plans:
            for work in plan.prefill:
                self.sched.complete_prefill(work, 0)

    def finish(self, plan: StepPlan) -> None:
        """Run a plan to its end synchronously (as the CPU runner does)."""
        self.sched.update(plan, {rid: 0 for rid in plan.decode} | {w.request_id: 0 for w in plan.prefill})


def layers(plan: StepPlan) -> set[tuple[int, int]]:
    return {(w.layer_start, w.layer_end) for w in plan.prefill}


# ---- stream groups ------------------------------------------------------------------------------------------
def test_sglang_rule_on_an_h200_and_the_partitions_it_maps_to():
    assert sglang_divisions(SMS, 8) == [(112, 20), (104, 28), (96, 36), (88, 44), (80, 52), (72, 60)]
    groups = stream_groups(SMS, PARTITIONS)
    assert [(g.decode_sms, g.prefill_sms) for g in groups] == [
        (0, 132), (16, 116), (32, 100), (32, 100), (48, 84), (48, 84), (64, 68), (132, 0)]
    # at a granularity of 8 the nearest partitions tie for 20 decode SMs (16 and 24): the larger is taken
    assert [g.decode_sms for g in stream_groups(SMS, partition_choices(SMS, 8))[1:-1]] == [24, 32, 40, 48, 56, 64]


def test_sglang_rule_keeps_fewer_groups_where_the_gpu_has_fewer_divisions():
    assert sglang_divisions(114, 8) == [(96, 18), (88, 26), (80, 34), (72, 42), (64, 50)]  # 5 < 6: all of them
    assert len(stream_groups(114, partition_choices(114))) == 7
    assert sglang_divisions(SMS, 5) == [(104, 28), (88, 44), (72, 60)]  # every second of six, then the first three


def test_manual_divisions_must_make_the_gpu():
    groups = stream_groups(SMS, PARTITIONS, 8, H200_EXAMPLE)
    assert [g.min_batch for g in groups[1:-1]] == [1, 5, 10, 15, 20, 25]
    assert [g.decode_sms for g in groups[1:-1]] == [16, 32, 32, 48, 64, 80]
    with pytest.raises(ConfigError, match="must make the GPU"):
        stream_groups(SMS, PARTITIONS, 8, ((100, 20, 1),) * 6)
    with pytest.raises(ConfigError, match="takes 6"):
        SchedulerSettings(policy="pdmux", pdmux_divisions="112:20:1,104:28:5")
    with pytest.raises(ConfigError, match="cannot read"):
        SchedulerSettings(policy="pdmux", pdmux_divisions="112/20")
    assert SchedulerSettings(pdmux_divisions=",".join(":".join(map(str, d)) for d in H200_EXAMPLE)
                             ).pdmux_division_list == H200_EXAMPLE


@pytest.mark.parametrize("batch, index", [(1, 1), (11, 1), (12, 2), (18, 3), (35, 5), (36, 6), (500, 6)])
def test_group_by_decode_batch_size(batch, index):
    groups = stream_groups(SMS, PARTITIONS)  # 8 groups: stream_idx = max(1, min(6, batch * 6 // 36))
    assert choose_group(groups, batch, True, 36) == index


@pytest.mark.parametrize("batch, index", [(1, 1), (4, 1), (5, 2), (14, 3), (24, 5), (25, 6), (300, 6)])
def test_group_by_manual_thresholds(batch, index):
    assert choose_group(stream_groups(SMS, PARTITIONS, 8, H200_EXAMPLE), batch, True, 36) == index


def test_one_phase_alone_takes_every_sm():
    groups = stream_groups(SMS, PARTITIONS)
    assert choose_group(groups, 9, False, 36) == 7 and choose_group(groups, 0, True, 36) == 0
    assert choose_group(groups, 0, False, 36) == 0


# ---- the step loop ------------------------------------------------------------------------------------------
def test_split_group_and_forward_count_layers_per_step():
    rig = Rig()
    rig.decoding(12)
    r = rig.request(7000)  # forward_count = 65536 // 7000 = 9 layers a step
    plans = [rig.plan() for _ in range(4)]  # launched, never waited for: the prefill stream queues them
    assert all((p.decode_sms, p.prefill_sms) == (32, 100) for p in plans)  # 12 * 6 // 36 = 2: SGLang's 104/28
    assert all(len(p.decode) == 12 for p in plans)
    assert [layers(p) for p in plans] == [{(0, 9)}, {(9, 18)}, {(18, 27)}, {(27, 32)}]
    assert plans[0].prefill[0].token_start == 0 and plans[0].prefill[0].token_end == 7000
    assert rig.plan().prefill == ()  # every layer launched: decode goes on beside it on the same split
    rig.complete(*plans)
    assert r.status is RequestStatus.DECODING


def test_a_short_batch_runs_every_layer_in_one_launch():
    rig = Rig()
    rig.decoding(40)
    rig.request(1000)  # 65536 // 1000 = 65 >= 32 layers
    plan = rig.plan()
    assert layers(plan) == {(0, LAYERS)} and (plan.decode_sms, plan.prefill_sms) == (64, 68)  # group 6: 72/60


def test_group_is_kept_while_decode_grows_and_rechosen_when_the_prefill_merges():
    rig = Rig()
    rig.decoding(2)
    r = rig.request(20_000, max_tokens=100)  # 8 layers a step (a chunk of 8192 tokens; budget 65536 // 8192)
    first = rig.plan()
    assert first.decode_sms == 16 and layers(first) == {(0, 8)}
    rig.decoding(34)  # the decode batch grows to 36 (other requests): no re-choice mid-prefill
    following = [rig.plan() for _ in range(3)]
    assert all(p.decode_sms == 16 and len(p.decode) == 36 for p in following)
    rig.complete(first, *following)  # the first chunk ends: the next chunk is the next batch, 36 decoding
    assert r.status is RequestStatus.PREFILLING and r.num_computed_tokens == 8192
    nxt = rig.plan()
    assert (nxt.decode_sms, nxt.prefill_sms) == (64, 68) and layers(nxt) == {(0, 8)}  # 36 * 6 // 36 = 6
    assert (nxt.prefill[0].token_start, nxt.prefill[0].token_end) == (8192, 16_384)
    assert rig.planner.stats.switches == 2 and rig.planner.stats.batches == 2


def test_decode_empty_synchronises_then_all_prefill():
    rig = Rig()
    (d,) = rig.decoding(1, max_tokens=2)
    rig.request(20_000)
    first = rig.plan()  # group 1 (16 decode SMs), layers 0-8 in flight
    assert first.decode_sms == 16 and layers(first) == {(0, 8)}
    rig.sched.finish(d, "length")  # the decode request ends: decode is empty
    waiting = rig.plan()
    assert waiting.empty and rig.planner.stats.syncs == 1  # both streams synchronised before the switch
    rig.complete(first)
    rest = rig.plan()
    assert layers(rest) == {(8, 16)} and rest.prefill_sms == SMS and rest.decode_sms is None  # all-prefill
    assert rig.planner.group == 0


def test_one_prefill_batch_at_a_time_within_the_token_budget():
    rig = Rig()
    rig.decoding(1)
    a, b, c = rig.request(3000), rig.request(3000), rig.request(3000)
    plan = rig.plan()  # 3008 + 3008 paged tokens leave 2176 of 8192: the third waits
    assert {w.request_id for w in plan.prefill} == {a.request_id, b.request_id}
    assert layers(plan) == {(0, 10)}  # 65536 // 6000
    rig.finish(plan)
    late = rig.request(100)
    for _ in range(3):
        plan = rig.plan()
        rig.finish(plan)
    assert c.status is RequestStatus.WAITING and late.status is RequestStatus.WAITING  # not until the batch ends
    assert a.status is RequestStatus.DECODING
    nxt = rig.plan()
    assert {w.request_id for w in nxt.prefill} == {c.request_id, late.request_id}


def test_kv_estimate_holds_back_a_prompt_the_running_outputs_may_need():
    rig = Rig(pages=200)  # 3200 tokens
    rig.decoding(2, max_tokens=2000)  # 2 x 1999 output tokens x 0.7 reserved, 2976 tokens free
    r = rig.request(100)
    plan = rig.plan()
    assert r.status is RequestStatus.WAITING and plan.prefill == () and plan.decode_sms is None  # all-decode
    idle = Rig(pages=200)
    big = idle.request(3000, max_tokens=2000)  # more than the estimate allows, but nothing else runs
    assert idle.plan().prefill and big.status is RequestStatus.PREFILLING


def test_registry_and_flags_build_it():
    planner = build_planner(SchedulerSettings(policy="pdmux", pdmux_sm_groups=5, pdmux_bs_divisor=10,
                                              pdmux_token_budget=1000, max_num_batched_tokens=4096),
                            partitions=(SMS, PARTITIONS))
    assert isinstance(planner, PdmuxPlanner) and len(planner.groups) == 5
    assert planner.options == PdmuxOptions(5, (), 10, 1000, 4096)
    assert planner.forward_count(300, LAYERS) == 3 and planner.forward_count(5000, LAYERS) == 1
