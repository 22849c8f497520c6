"""Every policy by name (`mux`, `chunked`, `serial`, `layerwise`) and how to build its planner, plus the chunked
baseline's budget tuned to the TBT target (the largest token budget whose step meets it when idle)."""
from __future__ import annotations

from dataclasses import dataclass

from appliance.engine.scheduler import ChunkedPlanner, LayerwisePlanner, Planner, SerialPlanner
from appliance.errors import ConfigError
from appliance.predictor.predictor import Predictor
from appliance.predictor.workload import DecodeLoad, PrefillItem
from appliance.slo.contract import Contract
from appliance.slo.dispatcher import MuxOptions, MuxPlanner

POLICIES = ("mux", "chunked", "serial", "layerwise")
DEFAULT_CHUNK_BUDGET = 2048  # vLLM's default max_num_batched_tokens for online serving
IDLE_DECODE = DecodeLoad(1, 1024)  # "idle": one other request decoding with a short context


@dataclass
class PolicyOptions:
    max_prefill_tokens: int = 8192
    layers_per_step: int = 1           # layerwise
    chunk_budget: int | None = None    # chunked; None: tuned to the TBT target when a predictor is given, else 2048
    preemption: bool = True            # mux
    mixed_chunks: bool = False         # mux: adaptive chunked prefill where it beats the split
    layerwise_decode_sms: int = 64     # layerwise: its fixed decode partition


def tune_chunk_budget(predictor: Predictor, tbt_ms: float, decode: DecodeLoad = IDLE_DECODE,
                      lo: int = 16, hi: int = 65536) -> int:
    """The largest token budget whose mixed step (a fresh prompt chunk beside `decode`) meets `tbt_ms`; `lo` when
    even that misses."""
    def fits(budget: int) -> bool:
        return predictor.mixed_ms([PrefillItem(budget - decode.batch_size, 0)], decode) <= tbt_ms

    if not fits(lo):
        return lo
    while lo < hi:  # invariant: fits(lo)
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def check_policy(name: str, flag: str = "--policy (--planner)") -> None:
    if name not in POLICIES:
        raise ConfigError(f"{flag} must be one of {', '.join(POLICIES)}, got {name!r}")


def build_planner(name: str, options: PolicyOptions, contract: Contract | None = None,
                  predictor: Predictor | None = None) -> Planner:
    """The planner of a policy; `mux` needs the contract and the predictor, `chunked` uses them to tune its budget."""
    check_policy(name)
    if name == "serial":
        return SerialPlanner(options.max_prefill_tokens)
    if name == "layerwise":
        return LayerwisePlanner(options.layers_per_step, options.max_prefill_tokens, options.layerwise_decode_sms)
    if name == "chunked":
        budget = options.chunk_budget
        if budget is None:
            cap = options.max_prefill_tokens
            budget = (tune_chunk_budget(predictor, contract.slo_for(None).tbt_ms, lo=min(16, cap), hi=cap)
                      if predictor is not None and contract is not None else DEFAULT_CHUNK_BUDGET)
        return ChunkedPlanner(budget, options.max_prefill_tokens)
    if contract is None or predictor is None:
        raise ConfigError("the mux policy needs an SLO contract and a latency predictor")
    return MuxPlanner(contract, predictor, MuxOptions(max_prefill_tokens=options.max_prefill_tokens,
                                                      preemption=options.preemption,
                                                      mixed_chunks=options.mixed_chunks))
