"""Whether a replay kept the contract, computed with the bench metrics: a request is good when it completed and
met its TTFT (per its uncached prompt), TPOT and E2E targets; the contract holds when the good fraction reaches the
attainment, the TTFT target holds at its percentile, and the TBT target holds at its percentile over every gap.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from appliance.slo.contract import ClassSLO, Contract
from appliance.workload.metrics import RequestTimeline, good_flags, request_metrics, summarize
from appliance.workload.traces import RequestSpec


class ContractSLO:
    """The contract's default class as a bench SLO (`targets_for(spec)` in ms). Traces carry no class, so every
    request is judged by the default class; `uncached(spec)` gives the prompt tokens its TTFT target grows with."""

    def __init__(self, contract: Contract, uncached: Callable[[RequestSpec], int] | None = None) -> None:
        self.contract = contract
        self.slo: ClassSLO = contract.slo_for(None)
        self.uncached = uncached or (lambda spec: spec.prompt_len)

    def targets_for(self, spec: RequestSpec | None) -> dict[str, float]:
        return self.slo.targets(self.uncached(spec) if spec is not None else 0)

    def describe(self) -> str:
        return f"contract {self.contract.name}"


@dataclass
class ContractReport:
    met: bool
    attainment: float          # good requests / all requests (refused ones count as missed)
    ttft_ok: float             # requests meeting their TTFT target / all requests
    tbt_ms: float              # the TBT percentile of the contract over every gap of every request
    summary: dict[str, Any]    # the bench summary (vLLM keys: p99_ttft_ms, p99_itl_ms, request_goodput, ...)
    misses: dict[str, str] = field(default_factory=dict)  # "attainment" / "tbt" / "ttft" -> why it was missed
    # the same percentile over the gaps after each request's first token, and over the others: where a TBT miss
    # comes from (a prompt's second token waits for its row to join the decode batch)
    tbt_first_gap_ms: float = 0.0
    tbt_later_gaps_ms: float = 0.0

    @property
    def reasons(self) -> list[str]:
        return list(self.misses.values())

    def verdict(self) -> dict[str, Any]:
        """The contract's keys of a bench result JSON."""
        return {"contract_met": self.met, "contract_tbt_ms": self.tbt_ms, "contract_ttft_ok": self.ttft_ok,
                "contract_misses": self.reasons, "contract_tbt_first_gap_ms": self.tbt_first_gap_ms,
                "contract_tbt_later_gaps_ms": self.tbt_later_gaps_ms}


def evaluate(contract: Contract, timelines: Sequence[RequestTimeline], specs: Sequence[RequestSpec],
             uncached: Callable[[RequestSpec], int] | None = None) -> ContractReport:
    slo = ContractSLO(contract, uncached)
    s = slo.slo
    summary = summarize(timelines, slo=slo, specs=specs)
    tbt, first, later = gap_tails([request_metrics(t).itls for t in timelines if t.success], s.tbt_percentile)
    ttft_ok = np.mean(good_flags(timelines, _OnlyTTFT(slo), specs)) if timelines else 0.0
    attainment = summary["slo_attainment"] or 0.0
    misses = contract_misses(contract, attainment, float(ttft_ok), tbt)
    return ContractReport(not misses, attainment, float(ttft_ok), tbt, summary, misses, first, later)


def gap_tails(itls: Sequence[Sequence[float]], percentile: float) -> tuple[float, float, float]:
    """The `percentile` (ms) of the requests' gaps between tokens (seconds, one list per request): over every gap,
    over the gaps after first tokens, and over the others (0 where there is none)."""
    def tail(gaps: list[float]) -> float:
        return float(np.percentile(np.asarray(gaps) * 1e3, percentile)) if gaps else 0.0

    return (tail([g for gaps in itls for g in gaps]), tail([gaps[0] for gaps in itls if len(gaps)]),
            tail([g for gaps in itls for g in gaps[1:]]))


def contract_misses(contract: Contract, attainment: float, ttft_ok: float, tbt_ms: float,
                    target: float | None = None) -> dict[str, str]:
    """Which of the contract's conditions a replay missed ("attainment" / "tbt" / "ttft" -> why); `target` replaces
    the contract's attainment where given."""
    s = contract.slo_for(None)
    target = contract.attainment if target is None else target
    misses = {}
    if attainment < target:
        misses["attainment"] = f"attainment {attainment:.1%} < {target:.1%}"
    if tbt_ms > s.tbt_ms:
        misses["tbt"] = f"p{s.tbt_percentile:g} TBT {tbt_ms:.1f} ms > {s.tbt_ms:g} ms"
    if ttft_ok < s.ttft_percentile / 100:
        misses["ttft"] = f"TTFT met by {ttft_ok:.1%} < {s.ttft_percentile:g} %"
    return misses


class _OnlyTTFT:
    def __init__(self, slo: ContractSLO) -> None:
        self.slo = slo

    def targets_for(self, spec: RequestSpec | None) -> dict[str, float]:
        return {"ttft": self.slo.targets_for(spec)["ttft"]}
