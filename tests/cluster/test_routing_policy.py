"""The SLO-aware replica choice and the autoscaling policy as plain functions (no Ray, no engine)."""
from __future__ import annotations

import pytest

from appliance.cluster.autoscale import SLOAutoscaler
from appliance.cluster.hints import ORIGIN, RoutingHints, hints_for, matched_chunks
from appliance.cluster.scoring import ReplicaReport, Scorer
from appliance.cluster.settings import ClusterSettings
from appliance.errors import ConfigError

LONG = "You are a careful assistant. Answer briefly and cite the document. " * 40


def report(name: str, **kw) -> ReplicaReport:
    base = {"prefill_fixed_ms": 5.0, "prefill_ms_per_token": 0.1, "ttft_targets": {"": (1000.0, 0.0)}}
    return ReplicaReport.from_stats({**base, **kw}, name)


def test_prompts_that_share_a_prefix_share_its_chain_hashes():
    a = hints_for("/v1/completions", {"prompt": LONG + "What is 2+2?"})
    b = hints_for("/v1/completions", {"prompt": LONG + "Name a colour."})
    other = hints_for("/v1/completions", {"prompt": "Name a colour. " + LONG})
    shared = matched_chunks(b.prefix, set(a.prefix))
    assert shared >= len(LONG.encode()) // 128 - 1 and shared < len(b.prefix) + 1
    assert matched_chunks(other.prefix, set(a.prefix)) == 0
    chat = hints_for("/v1/chat/completions", {"messages": [{"role": "system", "content": LONG},
                                                             {"role": "user", "content": "hi"}]})
    assert chat.prefix and chat.tokens > 500
    responses = hints_for("/v1/responses", {"instructions": LONG, "input": "hi"})  # the same conversation
    assert (responses.prefix, responses.tokens) == (chat.prefix, chat.tokens)
    assert hints_for("/v1/responses", {"input": 5}).prefix == ()
    ids = hints_for("/v1/completions", {"prompt": list(range(100))})
    assert ids.tokens == 100 and len(ids.prefix) == 3
    assert hints_for("/v1/completions", {"prompt": 5}).prefix == ()  # the replica answers the bad body


def test_the_replica_holding_the_prefix_wins_when_queues_are_equal():
    hints = hints_for("/v1/completions", {"prompt": LONG + "question"}, origin=ORIGIN)
    warm = report("warm", prefixes=list(hints.prefix[:-1]))
    ranked = Scorer().rank([report("cold"), warm], hints)
    assert ranked[0].replica == "warm" and ranked[0].cached_tokens > 500
    assert ranked[0].predicted_ttft_ms < ranked[1].predicted_ttft_ms


def test_a_long_queue_outweighs_affinity():
    hints = hints_for("/v1/completions", {"prompt": LONG}, origin=ORIGIN)
    warm = report("warm", prefixes=list(hints.prefix), backlog_ms=5000.0, num_waiting=30)
    assert Scorer().rank([warm, report("idle")], hints)[0].replica == "idle"


def test_a_burst_spreads_before_the_reports_catch_up():
    scorer = Scorer()
    replicas = [report("a"), report("b"), report("c")]
    chosen = []
    for i in range(9):  # all chosen before any is confirmed, as Ray routes a burst
        hints = RoutingHints(tokens=500, origin=ORIGIN, prefix=(f"p{i}",))
        best = scorer.rank(replicas, hints)[0].replica
        scorer.chose(f"r{i}", best, hints)
        chosen.append((f"r{i}", best, hints))
    assert sorted([c[1] for c in chosen].count(r) for r in "abc") == [3, 3, 3]
    for rid, replica, hints in chosen:
        scorer.sent(replica, hints, rid)
    assert len(scorer._pending(report("a"))) == 3
    # a report that counts what it received makes those requests its own backlog's business, not the router's
    assert scorer._pending(report("a", received={ORIGIN: 3})) == []
    assert len(scorer._pending(report("b", received={ORIGIN: 1}))) == 2
    # a request that finished before any report counted it waits nowhere (sequential short requests do that)
    done = next(rid for rid, replica, _ in chosen if replica == "c")
    scorer.completed("c", done)
    assert len(scorer._pending(report("c"))) == 2


def test_a_request_that_ended_after_the_report_waits_there_no_more():
    """Sequential requests with a shared prefix stay on the replica that caches it: the report taken while the
    first one prefilled still counts its prefill as backlog, but the router saw it end."""
    hints = hints_for("/v1/completions", {"prompt": LONG + "one"}, origin=ORIGIN)
    scorer = Scorer()
    scorer.sent("warm", hints, "r1")
    tight = {"ttft_targets": {"": (100.0, 0.0)}}
    queued = report("cold", **tight).prefill_ms(hints.tokens)  # the first prompt's prefill, as the replica reports it
    stale = report("warm", backlog_ms=queued, num_running=1, received={ORIGIN: 1}, finished={},
                   prefixes=list(hints.prefix), **tight)
    second = hints_for("/v1/completions", {"prompt": LONG + "two"}, origin=ORIGIN)
    assert scorer.rank([stale, report("cold", **tight)], second)[0].replica == "cold"  # it may still be prefilling
    scorer.completed("warm", "r1")
    ranked = scorer.rank([stale, report("cold", **tight)], second)
    assert ranked[0].replica == "warm" and ranked[0].load == 0
    # once a report counts the end, its own backlog is taken as it is
    fresh = report("warm", backlog_ms=queued, received={ORIGIN: 1}, finished={ORIGIN: 1},
                   prefixes=list(hints.prefix), **tight)
    assert scorer._ended_since(fresh) == []
    # a replica that does not count what ended (an older one) keeps its report as it is
    silent = report("warm", backlog_ms=queued, num_running=1, received={ORIGIN: 1}, prefixes=list(hints.prefix),
                    **tight)
    assert scorer._ended_since(silent) == []
    assert scorer.rank([fresh, report("cold", **tight)], second)[0].replica == "cold"


def test_avoided_unhealthy_and_full_replicas_rank_last():
    hints = RoutingHints(tokens=10, avoid=("a",))
    ranked = Scorer().rank([report("a"), report("b", healthy=False), report("c", kv_usage=0.99),
                            report("d")], hints)
    order = [c.replica for c in ranked]
    assert order[:2] == ["d", "c"] and set(order[2:]) == {"a", "b"}


def test_autoscaler_sizes_for_the_queue_and_adds_one_without_slack():
    policy = SLOAutoscaler(target_queue=4)
    assert policy.desired(1, {"queue": {"r1": 12.0}}, 0) == 3
    assert policy.desired(2, {"queue": {"r1": 0.0, "r2": 1.0}}, 0) == 0.25
    assert policy.desired(2, {"queue": {"r1": 2.0, "r2": 1.0}, "wait_ratio": {"r1": 1.5, "r2": 0.1}}, 0) == 3
    assert policy.desired(1, {}, 8) == 2  # nothing reported yet: Ray's count of ongoing requests
    with pytest.raises(ValueError):
        SLOAutoscaler(target_queue=0)


@pytest.mark.parametrize("kw, needle", [({"router": "random"}, "--router"), ({"replicas": 0}, "--replicas"),
                                        ({"replicas": 5, "max_replicas": 3}, "--max-replicas"),
                                        ({"stall_timeout": 0}, "--stall-timeout"), ({"retries": -1}, "--retries")])
def test_bad_cluster_settings_name_the_flag(kw, needle):
    with pytest.raises(ConfigError, match=needle):
        ClusterSettings(**kw)
    assert ClusterSettings(replicas=2, max_replicas=4).autoscaling


def test_near_equal_scores_are_equals_wherever_they_fall():
    """Two replicas a hair apart on predicted TTFT are equals even across a multiple of the slack step: the one
    holding the prompt's prefix wins (an absolute bucket would split 0.049 and 0.051 and send it to the cold one)."""
    hints = hints_for("/v1/completions", {"prompt": LONG + "question"}, origin=ORIGIN)
    target = {"": (100.0, 0.0)}  # 5 ms of backlog = 0.05 of the target
    warm = report("warm", prefixes=list(hints.prefix), backlog_ms=5.2, ttft_targets=target, prefill_ms_per_token=0.0,
                  prefill_fixed_ms=0.0)
    cold = report("cold", backlog_ms=4.8, ttft_targets=target, prefill_ms_per_token=0.0, prefill_fixed_ms=0.0)
    assert Scorer().rank([cold, warm], hints)[0].replica == "warm"


def test_a_batch_of_prompts_counts_all_their_tokens_and_keeps_the_prefix_they_share():
    one = hints_for("/v1/completions", {"prompt": LONG + "What is 2+2?"})
    batch = hints_for("/v1/completions", {"prompt": [LONG + "What is 2+2?", LONG + "Name a colour."]}, "gold")
    assert batch.tokens == one.tokens + hints_for("/v1/completions", {"prompt": LONG + "Name a colour."}).tokens
    assert batch.prefix and set(batch.prefix) <= set(one.prefix) and batch.slo_class == "gold"
    assert matched_chunks(batch.prefix, set(one.prefix)) == len(batch.prefix)  # the whole shared chain is held there
    ids = hints_for("/v1/completions", {"prompt": [list(range(100)), list(range(40))]})
    assert ids.tokens == 140 and len(ids.prefix) == 1  # one whole chunk of 32 ids in common
    mixed = hints_for("/v1/completions", {"prompt": [LONG, list(range(100))]})
    assert mixed.tokens > 100 and mixed.prefix == ()  # text and ids share no chain
    assert hints_for("/v1/completions", {"prompt": [LONG, 5]}).tokens == 0  # the replica answers the bad body
