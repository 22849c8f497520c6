"""What a latency model is asked about: prefill work (new and reused tokens per request), a decode batch (size and
reused tokens), the SM count of the partition; the measured samples profiles are fitted from; the LatencyModel
interface every model (roofline prior, fitted solo-run model) implements.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Literal, Mapping, Protocol, Sequence


@dataclass(frozen=True)
class PrefillItem:
    """One request's prefill chunk: `new` tokens computed now, attending to `reused` tokens already in the cache."""

    new: int
    reused: int = 0


@dataclass(frozen=True)
class DecodeLoad:
    """A decode batch: `batch_size` requests reading `reused_tokens` cached tokens in total (their contexts)."""

    batch_size: int
    reused_tokens: int

    @property
    def empty(self) -> bool:
        return self.batch_size == 0


NO_DECODE = DecodeLoad(0, 0)


@dataclass(frozen=True)
class Sample:
    """One measured step: prefill (all layers) or decode, alone on `sms` SMs, decode while `prefill` runs on the
    other partition (kind "contended"), or both in one forward on all SMs (kind "mixed", a chunked-prefill step);
    `ms` is the measured latency."""

    kind: Literal["prefill", "decode", "contended", "mixed"]
    sms: int
    ms: float
    prefill: tuple[PrefillItem, ...] = ()
    decode: DecodeLoad = NO_DECODE


class LatencyModel(Protocol):
    """Solo-run latency of one step on `sms` SMs (no concurrent work on the rest of the GPU)."""

    def prefill_ms(self, items: Sequence[PrefillItem], sms: int) -> float:
        """All layers of a prefill batch."""

    def decode_ms(self, load: DecodeLoad, sms: int) -> float:
        """One decode step of the batch."""

    def mixed_ms(self, items: Sequence[PrefillItem], load: DecodeLoad, sms: int) -> float:
        """One forward holding the decode rows and the prefill chunks together (aggregated, Sarathi-style)."""


def prefill_items(works: Iterable) -> tuple[PrefillItem, ...]:
    """The prefill items of scheduled works (anything with `num_tokens` computed after `token_start` cached ones)."""
    return tuple(PrefillItem(w.num_tokens, w.token_start) for w in works)


def decode_load(requests: Mapping, ids: Iterable[str]) -> DecodeLoad:
    """The decode batch of requests `ids`: each reads its tokens so far, less the one it decodes from."""
    ids = tuple(ids)
    return DecodeLoad(len(ids), sum(requests[rid].num_tokens - 1 for rid in ids))


def prefill_features(items: Sequence[PrefillItem]) -> tuple[float, float, float]:
    """sum(n^2), sum(n*r), sum(n): the terms of MuxWise's prefill model."""
    return (float(sum(i.new * i.new for i in items)), float(sum(i.new * i.reused for i in items)),
            float(sum(i.new for i in items)))
