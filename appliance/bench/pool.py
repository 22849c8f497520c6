"""Slices of one replay judged together (`muxd bench pool`). A replay too long for one run (a lent GPU held 30
minutes, a trace of hours) can run as consecutive slices of the trace (`--skip`, `--max-requests`), each at the same
rate with `--save-detailed`. Pooled, the slices are judged as one replay of all their requests: attainment and the
TTFT share from each point's counts, the TTFT and TBT percentiles over every request's first token and every gap.
What the slices cannot give is the state at their boundaries (queue, prefix cache): each slice starts idle.
"""
from __future__ import annotations

import gzip
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from appliance.errors import ConfigError
from appliance.slo.attainment import contract_misses, gap_tails
from appliance.slo.contract import Contract

DETAILED = ("ttfts", "itls", "errors")


@dataclass
class Pooled:
    """The pooled verdict: counts over all requests, percentiles over all of their first tokens and gaps."""

    policy: str
    rate: float
    requests: int
    good: int
    attainment: float
    ttft_ok: float               # requests meeting their TTFT target / all requests
    tbt_ms: float                # the contract's TBT percentile over every gap of every slice
    ttft_ms: dict[str, float]    # p50 / p90 / p99 over the completed requests
    misses: dict[str, str] = field(default_factory=dict)
    sources: list[str] = field(default_factory=list)
    tbt_first_gap_ms: float = 0.0  # the same percentile over the gaps after first tokens, and over the others
    tbt_later_gaps_ms: float = 0.0

    @property
    def passed(self) -> bool:
        return not self.misses

    def as_dict(self) -> dict[str, Any]:
        return {"policy": self.policy, "request_rate": self.rate, "requests": self.requests,
                "good_requests": self.good, "slo_attainment": self.attainment, "contract_ttft_ok": self.ttft_ok,
                "contract_tbt_ms": self.tbt_ms, "contract_tbt_first_gap_ms": self.tbt_first_gap_ms,
                "contract_tbt_later_gaps_ms": self.tbt_later_gaps_ms,
                **{f"{k}_ttft_ms": v for k, v in self.ttft_ms.items()},
                "passed": self.passed, "misses": list(self.misses.values()), "sources": self.sources}


def read_point(path: Path) -> dict[str, Any]:
    """One point's result JSON (or .json.gz), written with --save-detailed (per-request arrays) under a contract."""
    try:
        raw = Path(path).read_bytes()
        point = json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file (give the point JSONs of a sweep's points/ directory)") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: not a readable result JSON ({exc})") from None
    if not isinstance(point, dict):
        raise ConfigError(f"{path}: not a muxd bench result (expected a JSON object)")
    missing = [k for k in (*DETAILED, "request_rate", "good_requests") if point.get(k) is None]
    if missing:
        raise ConfigError(f"{path}: no {', '.join(missing)}; replay with --save-detailed and an SLO (--slo)")
    if point.get("contract_ttft_ok") is None:
        raise ConfigError(f"{path}: no contract_ttft_ok; replay with a YAML contract (--slo FILE)")
    n = len(point["ttfts"])
    if not (len(point["itls"]) == len(point["errors"]) == n) or n == 0:
        raise ConfigError(f"{path}: its per-request arrays are empty or of different lengths")
    return point


def pool(points: Sequence[dict[str, Any]], contract: Contract, attainment: float = 0.0,
         sources: Sequence[str] = ()) -> Pooled:
    """Judge the points as one replay under `contract` (attainment target: the stricter of it and `attainment`)."""
    if not points:
        raise ConfigError("nothing to pool: give two or more point JSONs")
    policies = {p.get("policy") or p.get("label") for p in points}
    if len(policies) > 1:
        raise ConfigError(f"the points were served by different policies ({', '.join(map(str, policies))})")
    rates = [float(p["request_rate"]) for p in points]
    if any(not math.isclose(r, rates[0], rel_tol=1e-6) for r in rates):
        raise ConfigError(f"the points ran at different rates ({', '.join(f'{r:g}' for r in rates)} req/s); "
                          "slices of one replay share its rate")
    cls = contract.slo_for(None)
    n = sum(len(p["ttfts"]) for p in points)
    good = sum(int(p["good_requests"]) for p in points)
    ttft_ok = sum(float(p["contract_ttft_ok"]) * len(p["ttfts"]) for p in points) / n
    ttfts = [t for p in points for t, e in zip(p["ttfts"], p["errors"]) if not e]
    tbt, first, later = gap_tails([itl for p in points for itl, e in zip(p["itls"], p["errors"]) if not e],
                                  cls.tbt_percentile)
    ttft_ms = {f"p{q}": float(np.percentile(np.asarray(ttfts) * 1e3, q)) if ttfts else 0.0 for q in (50, 90, 99)}
    misses = contract_misses(contract, good / n, ttft_ok, tbt, max(attainment, contract.attainment))
    return Pooled(str(policies.pop()), rates[0], n, good, good / n, ttft_ok, tbt, ttft_ms, misses, list(sources),
                  first, later)
