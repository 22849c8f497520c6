"""SLO-aware replica choice, as plain Python (the Ray Serve router in router.py only adapts it): each replica's
report (waiting queue and the predicted prefill time of what waits, running batch, KV usage, the prefix hashes it
served, its prefill rate from its own predictor), corrected by what this router sent since that report and what
finished there since (a short request ends between two reports: its prefill no longer waits there), gives the
request's predicted TTFT on that replica as a fraction of its TTFT target, plus a penalty for a nearly full KV cache
(preemptions). Replicas within SLACK_STEP of the best one on that count are its equals (measured from the best, so
two near-equal scores are never split by a bucket edge); among equals the one holding more of the prompt's prefix
wins (its prefix cache saves the prefill and the pages), then the least loaded (which keeps the running batches, and
so TBT, even).
"""
from __future__ import annotations

import collections
import random
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

from appliance.cluster.hints import ORIGIN, RoutingHints, matched_chunks

KV_SAFE = 0.9            # above this KV usage a new request risks preemptions: penalised in proportion
SLACK_STEP = 0.05        # predicted TTFTs within 5% of the target of the best count as equal
RESERVATION_S = 30.0     # a replica chosen for a request counts it until confirmed, or at most this long
LOCAL_AFFINITY = 4096    # prefix hashes this router remembers per replica (what it sent there lately)
DEFAULT_PREFILL_MS_PER_TOKEN = 0.05
FINISHED_MEMORY = 256    # the latest completions per replica this router keeps for reports that lag behind them
INFLIGHT_MEMORY = 65536  # requests sent and not yet seen to end that this router remembers (the oldest go first)


@dataclass
class ReplicaReport:
    """What one replica said last (record_routing_stats); an empty report reads as an idle replica."""

    replica: str = ""
    seq: int = 0
    healthy: bool = True
    num_waiting: int = 0
    num_running: int = 0
    max_num_seqs: int = 256
    kv_usage: float = 0.0
    backlog_ms: float = 0.0             # predicted prefill time of the prompts queued (or prefilling) ahead
    prefill_fixed_ms: float = 0.0       # predicted prefill of a prompt: fixed + per token x uncached tokens
    prefill_ms_per_token: float = DEFAULT_PREFILL_MS_PER_TOKEN
    ttft_targets: dict[str, tuple] = field(default_factory=dict)  # class ("" default) -> (ms, ms per 1k tokens)
    received: dict[str, int] = field(default_factory=dict)           # requests received from each ingress
    finished: dict[str, int] | None = None  # requests from each ingress that ended (None: a replica that does not say)
    prefixes: frozenset = frozenset()

    @classmethod
    def from_stats(cls, stats: dict[str, Any] | None, replica: str = "") -> "ReplicaReport":
        stats = dict(stats or {})
        known = {k: v for k, v in stats.items() if k in cls.__dataclass_fields__}
        known["prefixes"] = frozenset(stats.get("prefixes") or ())
        known.setdefault("replica", replica)
        return cls(**known)

    def prefill_ms(self, tokens: float) -> float:
        return self.prefill_fixed_ms + self.prefill_ms_per_token * max(0.0, tokens)

    def ttft_target_ms(self, slo_class: str | None, uncached_tokens: int) -> float:
        base, per_1k = self.ttft_targets.get(slo_class or "", self.ttft_targets.get("", (1000.0, 0.0)))
        return max(1.0, base + per_1k * uncached_tokens / 1000.0)


@dataclass
class Choice:
    replica: str
    score: float               # predicted TTFT / target, plus the KV penalty
    predicted_ttft_ms: float
    cached_tokens: int
    load: float                # requests running, waiting or on their way, per seat

    def key(self, best: float) -> tuple:
        """Sort key given the best score among the candidates: the best's equals first, by prefix and load."""
        if self.score <= best + SLACK_STEP:
            return (0, 0.0, -self.cached_tokens, self.load, self.score)
        return (1, self.score, -self.cached_tokens, self.load, self.score)


class Scorer:
    """The router's state across requests: the requests it chose a replica for and has not seen confirmed yet (a
    burst is routed before any confirmation comes back), and those it sent that the replica's report does not count
    yet; those that ended there since its report counted them; and the prefixes it sent to each replica."""

    def __init__(self, origin: str = ORIGIN) -> None:
        self.origin = origin
        self._sent: dict[str, int] = collections.Counter()              # confirmed sends per replica
        self._unreported: dict[str, collections.deque] = collections.defaultdict(collections.deque)  # (id, tokens)
        self._reserved: dict[str, tuple[str, int, float]] = {}          # request -> (replica, tokens, when)
        self._affinity: dict[str, collections.OrderedDict] = collections.defaultdict(collections.OrderedDict)
        self._inflight: dict[str, tuple[str, int]] = {}                 # request -> (replica, tokens), until it ends
        self._done: dict[str, int] = collections.Counter()              # requests ended per replica
        self._ended: dict[str, collections.deque] = collections.defaultdict(
            lambda: collections.deque(maxlen=FINISHED_MEMORY))          # prompt tokens of the latest that ended

    def rank(self, reports: Iterable[ReplicaReport], hints: RoutingHints) -> list[Choice]:
        """Replicas best first (a replica named in hints.avoid, or unhealthy, last)."""
        reports = list(reports)
        choices = [self.score(r, hints) for r in reports]
        random.shuffle(choices)  # equal keys: no replica is always first
        bad = {r.replica for r in reports if not r.healthy} | set(hints.avoid)
        best = min((c.score for c in choices if c.replica not in bad), default=0.0)
        return sorted(choices, key=lambda c: (c.replica in bad, c.key(best)))

    def score(self, report: ReplicaReport, hints: RoutingHints) -> Choice:
        held = report.prefixes | self._affinity[report.replica].keys()
        cached = int(matched_chunks(hints.prefix, held) * hints.chunk_tokens)
        cached = min(cached, max(0, hints.tokens - 1))
        pending = self._pending(report)
        ended = self._ended_since(report)
        backlog_ms = max(0.0, report.backlog_ms - sum(report.prefill_ms(tokens) for tokens in ended))
        wait_ms = backlog_ms + sum(report.prefill_ms(tokens) for tokens in pending)
        ttft_ms = wait_ms + report.prefill_ms(hints.tokens - cached)
        score = ttft_ms / report.ttft_target_ms(hints.slo_class, hints.tokens - cached)
        if report.kv_usage > KV_SAFE:
            score += (report.kv_usage - KV_SAFE) / (1 - KV_SAFE)
        busy = max(0, report.num_running + report.num_waiting - len(ended))
        load = (busy + len(pending)) / max(1, report.max_num_seqs)
        return Choice(report.replica, score, ttft_ms, cached, load)

    def _pending(self, report: ReplicaReport) -> list[int]:
        """Prompt tokens of the requests on their way to the replica: chosen for it and not confirmed yet, or sent
        and not counted by its last report."""
        queue = self._unreported[report.replica]
        behind = self._sent[report.replica] - report.received.get(self.origin, 0)
        while len(queue) > max(0, behind):
            queue.popleft()
        now = time.monotonic()
        for rid in [rid for rid, (_, _, when) in self._reserved.items() if now - when > RESERVATION_S]:
            del self._reserved[rid]  # chosen, then cancelled before it was sent
        return [*(tokens for _, tokens in queue),
                *(tokens for replica, tokens, _ in self._reserved.values() if replica == report.replica)]

    def _ended_since(self, report: ReplicaReport) -> list[int]:
        """Prompt tokens of the requests this router sent to the replica that ended after its report was taken
        (the report may still count them as waiting or running; at most their prefill is taken off its backlog)."""
        ended = self._ended.get(report.replica)
        if report.finished is None:
            return []
        behind = self._done.get(report.replica, 0) - report.finished.get(self.origin, 0)
        if not ended or behind <= 0:
            return []
        return list(ended)[-behind:]

    def chose(self, request_id: str, replica: str, hints: RoutingHints) -> None:
        """The router picked `replica` for the request (it may still go elsewhere if that one is full)."""
        if hints.origin == self.origin:
            self._reserved[request_id] = (replica, hints.tokens, time.monotonic())

    def sent(self, replica: str, hints: RoutingHints, request_id: str | None = None) -> None:
        """Record a request routed to `replica` (its prefixes now live there too). Probes without an origin are
        not counted by the replicas, so not here either."""
        self._reserved.pop(request_id or "", None)
        if hints.origin == self.origin:
            self._unreported[replica].append((request_id, hints.tokens))
            self._sent[replica] += 1
            if request_id:
                self._inflight[request_id] = (replica, hints.tokens)
                while len(self._inflight) > INFLIGHT_MEMORY:
                    del self._inflight[next(iter(self._inflight))]
        memory = self._affinity[replica]
        for h in hints.prefix:
            memory[h] = None
            memory.move_to_end(h)
        while len(memory) > LOCAL_AFFINITY:
            memory.popitem(last=False)

    def completed(self, replica: str, request_id: str) -> None:
        """The request sent to `replica` is over: it waits there no more, whether or not a report counted it yet
        (short requests finish between two reports)."""
        queue = self._unreported.get(replica)
        if queue:
            for entry in [e for e in queue if e[0] == request_id]:
                queue.remove(entry)
        sent = self._inflight.pop(request_id, None)
        if sent is not None and sent[0] == replica:
            self._done[replica] += 1
            self._ended[replica].append(sent[1])

    def forget(self, live: set[str]) -> None:
        """Drop the state of replicas that are gone."""
        for table in (self._sent, self._unreported, self._affinity, self._done, self._ended):
            for replica in [r for r in table if r not in live]:
                del table[replica]
        for rid in [rid for rid, (replica, _) in self._inflight.items() if replica not in live]:
            del self._inflight[rid]
