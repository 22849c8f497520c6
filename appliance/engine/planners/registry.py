"""Every policy by name (`mux`, `chunked`, `serial`, `layerwise`, `pdmux`) and how to build its planner, plus the
chunked baseline's budget tuned to the TBT target (the largest token budget whose step meets it when idle)."""
from __future__ import annotations

from typing import Protocol, Sequence

from appliance.config import POLICIES, SchedulerSettings
from appliance.engine.planners.base import Planner
from appliance.engine.planners.chunked import ChunkedPlanner
from appliance.engine.planners.layerwise import LayerwisePlanner
from appliance.engine.planners.mux import MuxOptions, MuxPlanner
from appliance.engine.planners.pdmux import PdmuxOptions, PdmuxPlanner
from appliance.engine.planners.serial import SerialPlanner
from appliance.errors import ConfigError
from appliance.predictor.host import HostModel
from appliance.predictor.predictor import Predictor, partition_choices
from appliance.predictor.shapes import DecodeLoad, PrefillItem
from appliance.slo.contract import Contract

IDLE_DECODE = DecodeLoad(1, 1024)  # "idle": one other request decoding with a short context
DEFAULT_SMS = 132  # pdmux's stream groups where neither partitions nor a predictor say the GPU (an H100/H200)


class StepTimes(Protocol):
    def mixed_ms(self, items: Sequence[PrefillItem], load: DecodeLoad) -> float: ...


def tune_chunk_budget(timer: StepTimes, tbt_ms: float, decode: DecodeLoad = IDLE_DECODE,
                      lo: int = 16, hi: int = 65536, host: HostModel | None = None) -> int:
    """The largest token budget whose mixed step (a fresh prompt chunk beside `decode`, on `timer`'s clock, plus
    the step's `host` time) meets `tbt_ms`; `lo` when even that misses."""
    # the step's host time is charged on top in either loop: it is the margin that keeps the mixed steps of busier
    # batches than `decode` within the target too
    host_ms = host.step(decode.batch_size) if host is not None else 0.0

    def fits(budget: int) -> bool:
        return timer.mixed_ms([PrefillItem(budget - decode.batch_size, 0)], decode) + host_ms <= tbt_ms

    if not fits(lo):
        return lo
    while lo < hi:  # invariant: fits(lo)
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def build_planner(settings: SchedulerSettings, contract: Contract | None = None,
                  predictor: Predictor | None = None,
                  partitions: tuple[int, tuple[int, ...]] | None = None) -> Planner:
    """The planner of `settings.policy`; `mux` needs the contract and the predictor, `chunked` without a budget
    tunes it to the contract's TBT target with the predictor (else takes --max-num-batched-tokens); `pdmux` lays its
    stream groups over `partitions` (the GPU's SMs and the executor's decode partitions), else the predictor's, else
    a 132-SM GPU's at the default granularity."""
    name, max_tokens = settings.policy, settings.max_num_batched_tokens
    if name == "pdmux":
        if partitions is None:
            partitions = ((predictor.sm_count, tuple(predictor.decode_partitions)) if predictor is not None
                          else (DEFAULT_SMS, partition_choices(DEFAULT_SMS)))
        return PdmuxPlanner(PdmuxOptions(settings.pdmux_sm_groups, settings.pdmux_division_list,
                                         settings.pdmux_bs_divisor, settings.pdmux_token_budget, max_tokens),
                            *partitions)
    if name == "serial":
        return SerialPlanner(max_tokens)
    if name == "layerwise":
        return LayerwisePlanner(settings.layers_per_step, max_tokens, settings.layerwise_decode_sms)
    if name == "chunked":
        budget = settings.chunk_budget
        if budget is None:
            budget = (tune_chunk_budget(predictor, contract.slo_for(None).tbt_ms, lo=min(16, max_tokens),
                                        hi=max_tokens, host=predictor.host)
                      if predictor is not None and contract is not None else max_tokens)
        return ChunkedPlanner(budget, max_tokens)
    if name != "mux":
        raise ConfigError(f"policy {name!r} has no planner; choose one of {', '.join(POLICIES)}")
    if contract is None or predictor is None:
        raise ConfigError("the mux policy needs an SLO contract and a latency predictor")
    return MuxPlanner(contract, predictor, MuxOptions(max_prefill_tokens=max_tokens, chunk_tokens=max_tokens,
                                                      prefill_pause=settings.prefill_pause,
                                                      mixed_chunks=settings.mixed_chunks,
                                                      temporal=settings.temporal_prefill))
