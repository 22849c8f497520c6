"""SLO-aware replica choice, as plain Python (the Ray Serve router in router.py only adapts it): each replica's
report (waiting queue and the predicted prefill time of what waits, running batch, KV usage, the prefix hashes it
served, its prefill rate from its own predictor), corrected by what this router sent since that report, gives the
request's predicted TTFT on that replica, as a fraction of its TTFT target. Replicas are ranked by that, plus a
penalty for a nearly full KV cache (preemptions) and a small share of load (to spread ties, which keeps the running
batches, and so TBT, even).
"""
from __future__ import annotations

import collections
import random
from dataclasses import dataclass, field
from typing import Any, Iterable

from appliance.cluster.hints import ORIGIN, RoutingHints, matched_chunks

KV_SAFE = 0.9            # above this KV usage a new request risks preemptions: penalised in proportion
LOAD_WEIGHT = 0.05       # share of the load term beside predicted TTFT / target (breaks ties between idle replicas)
LOCAL_AFFINITY = 4096    # prefix hashes this router remembers per replica (what it sent there lately)
DEFAULT_PREFILL_MS_PER_TOKEN = 0.05


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
    score: float
    predicted_ttft_ms: float
    cached_tokens: int


class Scorer:
    """The router's state across requests: what it sent to each replica since that replica's last report, and the
    prefixes it sent there."""

    def __init__(self, origin: str = ORIGIN) -> None:
        self.origin = origin
        self._sent: dict[str, int] = collections.Counter()              # requests sent per replica
        self._unreported: dict[str, collections.deque] = collections.defaultdict(collections.deque)
        self._affinity: dict[str, collections.OrderedDict] = collections.defaultdict(collections.OrderedDict)

    def rank(self, reports: Iterable[ReplicaReport], hints: RoutingHints) -> list[Choice]:
        """Replicas best first (a replica named in hints.avoid, or unhealthy, last)."""
        choices = [self.score(r, hints) for r in reports]
        random.shuffle(choices)  # equal scores: no replica is always first
        bad = {r.replica for r in reports if not r.healthy} | set(hints.avoid)
        return sorted(choices, key=lambda c: (c.replica in bad, c.score))

    def score(self, report: ReplicaReport, hints: RoutingHints) -> Choice:
        held = report.prefixes | self._affinity[report.replica].keys()
        cached = int(matched_chunks(hints.prefix, held) * hints.chunk_tokens)
        cached = min(cached, max(0, hints.tokens - 1))
        pending = self._pending(report)
        wait_ms = report.backlog_ms + sum(report.prefill_ms(tokens) for tokens in pending)
        ttft_ms = wait_ms + report.prefill_ms(hints.tokens - cached)
        score = ttft_ms / report.ttft_target_ms(hints.slo_class, hints.tokens - cached)
        if report.kv_usage > KV_SAFE:
            score += (report.kv_usage - KV_SAFE) / (1 - KV_SAFE)
        load = report.num_running + report.num_waiting + len(pending)
        score += LOAD_WEIGHT * load / max(1, report.max_num_seqs)
        return Choice(report.replica, score, ttft_ms, cached)

    def _pending(self, report: ReplicaReport) -> list[int]:
        """Prompt tokens of the requests this router sent to the replica that its report does not count yet."""
        queue = self._unreported[report.replica]
        seen = report.received.get(self.origin, 0)
        while queue and queue[0][0] < seen:
            queue.popleft()
        return [tokens for _, tokens in queue]

    def sent(self, replica: str, hints: RoutingHints) -> None:
        """Record a request routed to `replica` (its prefixes now live there too)."""
        self._unreported[replica].append((self._sent[replica], hints.tokens))
        self._sent[replica] += 1
        memory = self._affinity[replica]
        for h in hints.prefix:
            memory[h] = None
            memory.move_to_end(h)
        while len(memory) > LOCAL_AFFINITY:
            memory.popitem(last=False)

    def forget(self, live: set[str]) -> None:
        """Drop the state of replicas that are gone."""
        for table in (self._sent, self._unreported, self._affinity):
            for replica in [r for r in table if r not in live]:
                del table[replica]
