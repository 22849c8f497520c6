"""How the decode attention kernel spreads a batch over the SMs it runs on, as a latency feature.

flashinfer's tensor-core decode (the path for GQA groups of 3 or more) splits each request's KV cache into chunks
so that the work fills a grid of two CTAs per SM of the whole GPU: a binary search for the smallest chunk (at least
128 tokens) whose chunks, over all requests, stay within that grid, one CTA per chunk and KV head. It plans for all
the GPU's SMs, not for the SMs a green context leaves the decode stream, so on a partition the CTAs run in waves of
two per partition SM, and a wave lasts as long as its longest CTA. On a 64-SM partition of an H200, 22 requests of
15k tokens get one chunk each: 176 CTAs over 128 slots, two waves of a whole request's tokens where 1.4 would do,
and the step runs 17 % over a model linear in the cached tokens.

`DecodePlan.critical_tokens` replays that plan for a decode batch (its requests taken as equally long; the CUDA
graph's padding rows hold one page each) and returns the tokens on the critical path: the sum over waves of the
longest CTA's tokens. The solo-run model fits it beside the cached tokens (solo.py). Pure arithmetic: no CUDA.
"""
from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass

from appliance.predictor.shapes import DecodeLoad

SLOTS_PER_SM = 2     # flashinfer's prefill-style plan: max grid = 2 CTAs x the device's SM count
MIN_CHUNK_TOKENS = 128


@dataclass(frozen=True)
class DecodePlan:
    """What the kernel's plan depends on: the device's SM count, the model's KV heads, the KV page size and the
    batch sizes of the captured decode graphs (a batch runs padded to the next one; empty: no graphs)."""

    total_sms: int
    kv_heads: int
    page_size: int
    graph_sizes: tuple[int, ...] = ()

    def critical_tokens(self, load: DecodeLoad, sms: int) -> float:
        """Tokens on the critical path of one decode attention launch of `load` on `sms` SMs."""
        if load.empty:
            return 0.0
        batch = load.batch_size
        i = bisect.bisect_left(self.graph_sizes, batch)
        pad = (self.graph_sizes[i] if i < len(self.graph_sizes) else batch) - batch  # rows of one page each
        pages = math.ceil(max(1, round(load.reused_tokens / batch) + 1) / self.page_size)
        return float(self.page_size * _critical_pages(batch, pages, pad, self.kv_heads,
                                                      SLOTS_PER_SM * self.total_sms // self.kv_heads,
                                                      max(MIN_CHUNK_TOKENS // self.page_size, 1),
                                                      max(1, SLOTS_PER_SM * sms)))

    def to_dict(self) -> dict[str, int | list[int]]:
        return {"total_sms": self.total_sms, "kv_heads": self.kv_heads, "page_size": self.page_size,
                "graph_sizes": list(self.graph_sizes)}

    @classmethod
    def from_dict(cls, raw: dict) -> "DecodePlan":
        return cls(int(raw["total_sms"]), int(raw["kv_heads"]), int(raw["page_size"]),
                   tuple(sorted(int(s) for s in raw.get("graph_sizes", ()))))


@functools.lru_cache(maxsize=65536)  # the planner asks for the same batches step after step
def _critical_pages(batch: int, pages: int, pad: int, heads: int, limit: int, min_chunk: int, slots: int) -> int:
    """The plan for `batch` requests of `pages` pages and `pad` one-page rows: the smallest chunk (at least
    `min_chunk` pages) whose chunks number at most `limit`, a CTA per chunk and head, CTAs longest first in waves of
    `slots`; the sum over waves of each wave's first (longest) CTA, in pages."""
    lo, hi = min_chunk, max(pages, 1)
    while lo < hi:
        mid = (lo + hi) // 2
        if batch * math.ceil(pages / mid) + pad > limit:
            lo = mid + 1
        else:
            hi = mid
    chunks = math.ceil(pages / lo)
    last = pages - (chunks - 1) * lo
    # (CTAs, pages each), longest first: whole chunks, each request's last chunk, the padding rows
    groups = [(batch * (chunks - 1) * heads, lo), (batch * heads, last), (pad * heads, 1)]
    total, start = 0, 0
    for count, size in groups:
        if count:
            total += size * (math.ceil((start + count) / slots) - math.ceil(start / slots))  # waves starting here
            start += count
    return total
