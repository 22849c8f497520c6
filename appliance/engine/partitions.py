"""SM partitions of one GPU for running prefill and decode at the same time.

At start-up every (decode, prefill) split the planner may use is created once with CUDA green contexts (cuda-python
driver API): decode gets k x granularity SMs, prefill the disjoint remainder of the same split, each phase a
non-blocking stream of its own green context. A `full` partition runs both phases on ordinary all-SM streams. The SM
counts are read back from the driver, never assumed. On CPU, and with multiplexing off, the set holds one null
partition (no streams), so the same code path runs everywhere.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from appliance.errors import ConfigError

log = logging.getLogger("muxd.partitions")


def partitions_available() -> bool:
    """cuda-python's driver bindings (green contexts) are importable."""
    try:
        from cuda.bindings import driver  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class Partition:
    """Two streams whose kernels run on disjoint SM sets (or, for `full`, both on every SM)."""

    name: str
    decode_sms: int
    prefill_sms: int
    decode_stream: torch.cuda.Stream | None = None
    prefill_stream: torch.cuda.Stream | None = None
    _keep: list = field(default_factory=list, repr=False)  # green contexts and raw streams kept alive

    @property
    def is_null(self) -> bool:
        return self.decode_stream is None


class PartitionError(ConfigError):
    """The GPU cannot be split as asked (no green contexts, granularity not allowed, driver refused)."""


def _check(result, what: str):
    err, *rest = result
    if int(err) != 0:
        raise PartitionError(f"{what} failed: {err!r}")
    return rest[0] if len(rest) == 1 else rest


class PartitionSet:
    def __init__(self, total_sms: int, splits: list[Partition], full: Partition) -> None:
        self.total_sms, self.splits, self.full = total_sms, splits, full
        self.create_seconds = 0.0

    @classmethod
    def null(cls) -> "PartitionSet":
        """One partition without streams: CPU, or multiplexing off (everything on the current stream)."""
        null = Partition("null", 0, 0)
        return cls(0, [], null)

    @property
    def partitions(self) -> list[Partition]:
        return self.splits + [self.full]

    def for_decode(self, sms: int) -> Partition:
        """The split with the fewest decode SMs that still has at least `sms` (the full partition if none)."""
        for p in self.splits:
            if p.decode_sms >= sms:
                return p
        return self.full

    @classmethod
    def create(cls, device: torch.device | int = 0, granularity: int = 16,
               decode_sms: list[int] | None = None) -> "PartitionSet":
        """Create every split: decode gets each of `decode_sms` (default: multiples of `granularity` that leave at
        least one granule to prefill), prefill the rest."""
        from cuda.bindings import driver

        index = torch.device(device).index if isinstance(device, torch.device) else int(device)
        index = torch.cuda.current_device() if index is None else index
        torch.cuda.init()
        start = time.perf_counter()
        _check(driver.cuInit(0), "cuInit")
        dev = _check(driver.cuDeviceGet(index), "cuDeviceGet")
        sm_type = driver.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM
        whole = _check(driver.cuDeviceGetDevResource(dev, sm_type), "cuDeviceGetDevResource")
        total = int(whole.sm.smCount)
        if granularity < 1 or granularity % 8:
            raise PartitionError(f"partition granularity must be a positive multiple of 8 SMs on Hopper, "
                                 f"got {granularity}")
        sizes = decode_sms or list(range(granularity, total - granularity + 1, granularity))
        splits = []
        for want in sizes:
            if not 0 < want < total:
                raise PartitionError(f"a decode partition of {want} SMs does not fit a GPU of {total} SMs")
            groups, _, remaining = _check(driver.cuDevSmResourceSplitByCount(1, whole, 0, want),
                                          f"splitting {want} of {total} SMs")
            decode_stream, decode_keep = _green_stream(driver, dev, index, groups[0])
            prefill_stream, prefill_keep = _green_stream(driver, dev, index, remaining)
            splits.append(Partition(f"decode{int(groups[0].sm.smCount)}", int(groups[0].sm.smCount),
                                    int(remaining.sm.smCount), decode_stream, prefill_stream,
                                    decode_keep + prefill_keep))
        full = Partition("full", total, total, torch.cuda.Stream(index), torch.cuda.Stream(index))
        out = cls(total, splits, full)
        out.create_seconds = time.perf_counter() - start
        log.info("SM partitions of %d SMs (decode/prefill): %s, created in %.1f ms", total,
                 ", ".join(f"{p.decode_sms}/{p.prefill_sms}" for p in splits), out.create_seconds * 1e3)
        return out


def _green_stream(driver, dev, index: int, resource) -> tuple[torch.cuda.ExternalStream, list]:
    desc = _check(driver.cuDevResourceGenerateDesc([resource], 1), "cuDevResourceGenerateDesc")
    ctx = _check(driver.cuGreenCtxCreate(desc, dev, driver.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM),
                 "cuGreenCtxCreate")
    raw = _check(driver.cuGreenCtxStreamCreate(ctx, driver.CUstream_flags.CU_STREAM_NON_BLOCKING, 0),
                 "cuGreenCtxStreamCreate")
    return torch.cuda.ExternalStream(int(raw), device=torch.device("cuda", index)), [ctx, raw]
