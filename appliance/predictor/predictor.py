"""The Predictor the dispatcher and the simulator ask: solo latency from one LatencyModel (the roofline prior or a
fitted solo-run model), times the contention guard's worst case when prefill and decode share the GPU: decode beside
prefill (`ContentionGuard`), prefill on a partition beside decode (`SplitSlowdown`); both are refined online, as are
how much longer mixed steps (prompt chunks beside the decode rows, on all SMs) and prefill layers on all SMs after a
decode step (temporal steps) run while serving than profiled. Its `host` model
gives the CPU's share of a step, which every inter-token gap carries.

It also knows the partitions the executor offers: decode SM counts (multiples of the granularity), prefill gets
the rest.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from appliance.model_zoo.config import ModelConfig
from appliance.predictor.contention import ContentionGuard
from appliance.predictor.host import HostModel, LaunchCost
from appliance.predictor.roofline import DeviceSpec, RooflineModel
from appliance.predictor.shapes import DecodeLoad, LatencyModel, PrefillItem
from appliance.predictor.split import SplitSlowdown, all_sms

DEFAULT_GRANULARITY = 16  # decode partitions of 16, 32, ... SMs (the multiplex executor's default)


def partition_choices(sm_count: int, granularity: int = DEFAULT_GRANULARITY) -> tuple[int, ...]:
    """Decode SM counts k * granularity that leave prefill at least `granularity` SMs."""
    return tuple(range(granularity, sm_count - granularity + 1, granularity))


@dataclass
class Predictor:
    latency: LatencyModel
    guard: ContentionGuard
    num_layers: int
    sm_count: int
    decode_partitions: tuple[int, ...]
    source: str = "roofline prior"
    notes: list[str] = field(default_factory=list)
    # how much slower each phase ran while serving than this model predicts ("decode", "prefill"; measured by a
    # calibration replay): the simulator's clock applies it, plans never do (the planner refines online instead)
    serving: dict[str, float] = field(default_factory=dict)
    split: SplitSlowdown = field(default_factory=SplitSlowdown)  # prefill on a partition, beside decode
    mixed: SplitSlowdown = field(default_factory=SplitSlowdown)  # mixed steps while serving, against the profile
    # prefill layers on all SMs after decode (temporal steps) while serving, against the profile: may be below 1
    full: SplitSlowdown = field(default_factory=all_sms)
    host: HostModel = field(default_factory=HostModel)  # the host's share of every step (host.py)
    launches: LaunchCost = field(default_factory=LaunchCost)  # prefill launches' host time while serving

    @classmethod
    def prior(cls, model: ModelConfig, device: DeviceSpec, granularity: int = DEFAULT_GRANULARITY) -> "Predictor":
        """The roofline prior, guarded by the device's worst-case contention."""
        return cls(RooflineModel(model, device), ContentionGuard(default=1.0 + device.contention), model.num_layers,
                   device.sm_count, partition_choices(device.sm_count, min(granularity, device.sm_count // 2)))

    @property
    def gemm(self):
        """The profiled GEMM row buckets the executor pads prefill launches to (gemm_table.py), or None."""
        return getattr(self.latency, "gemm", None)

    def _sms(self, sms: int | None) -> int:
        return self.sm_count if sms is None else sms

    def prefill_ms(self, items: Sequence[PrefillItem], sms: int | None = None) -> float:
        """All layers of a prefill batch on `sms` SMs (None: all); on a partition, decode runs on the other SMs and
        slows it (the split slowdown); on all SMs, as learned while serving (1 until measured)."""
        solo = self.prefill_solo_ms(items, sms)
        return solo * (self.split.factor(items) if sms is not None and sms < self.sm_count else self.full.factor(items))

    def prefill_solo_ms(self, items: Sequence[PrefillItem], sms: int | None = None, layers: int | None = None) -> float:
        """All layers (or `layers` of them) of a prefill batch alone on `sms` SMs, as profiled."""
        ms = self.latency.prefill_ms(items, self._sms(sms))
        return ms if layers is None else ms * layers / self.num_layers

    def decode_ms(self, load: DecodeLoad, sms: int | None = None,
                  concurrent: Sequence[PrefillItem] = ()) -> float:
        """One decode step on `sms` SMs; with `concurrent` prefill work on the other SMs, the guarded worst case."""
        solo = self.latency.decode_ms(load, self._sms(sms))
        if sms is None or not concurrent:
            return solo
        return solo * self.guard.slowdown(sms, concurrent, load)

    def mixed_ms(self, items: Sequence[PrefillItem], load: DecodeLoad) -> float:
        """One aggregated forward (decode rows and prefill chunks together) on all SMs, as measured while serving."""
        return self.latency.mixed_ms(items, load, self.sm_count) * self.mixed.factor(items)

    def observe_decode(self, load: DecodeLoad, sms: int, concurrent: Sequence[PrefillItem],
                       measured_ms: float) -> None:
        """Online refinement from a measured decode step that ran beside `concurrent` prefill work."""
        if concurrent and not load.empty:
            self.guard.refine(sms, concurrent, load, self.latency.decode_ms(load, sms), measured_ms)

    def observe_prefill(self, items: Sequence[PrefillItem], layers: int, sms: int, measured_ms: float) -> None:
        """Online refinement from `layers` layers of a prefill batch measured on a partition's `sms` SMs while
        decode ran on the others."""
        if items and 0 < sms < self.sm_count:
            self.split.observe(self.prefill_solo_ms(items, sms, layers), items, measured_ms)

    def observe_full(self, items: Sequence[PrefillItem], layers: int, measured_ms: float) -> None:
        """Online refinement from `layers` layers of a prefill batch measured on all SMs after a decode step."""
        if items and layers > 0:
            self.full.observe(self.prefill_solo_ms(items, None, layers), items, measured_ms)

    def observe_launch(self, launches: int, layers: int, measured_ms: float, graphs: bool = False) -> None:
        """Online refinement of the host model from `launches` prefill launches of `layers` layers in all that took
        `measured_ms` of host time, eager or (`graphs`) replaying piecewise graphs."""
        self.host = self.launches.observe(self.host, launches, layers, measured_ms, graphs)

    def observe_mixed(self, items: Sequence[PrefillItem], load: DecodeLoad, measured_ms: float) -> None:
        """Online refinement from a measured mixed step (prompt chunks `items` beside the decode rows `load`)."""
        if items:
            self.mixed.observe(self.latency.mixed_ms(items, load, self.sm_count), items, measured_ms)
