"""How the decode attention kernel spreads a batch over the SMs it runs on, as a latency feature.

flashinfer's tensor-core decode (the path for GQA groups of 3 or more) splits each request's KV cache into chunks
so that the work fills a grid of two CTAs per SM of the whole GPU: a binary search for the smallest chunk (at least
128 tokens) whose chunks, over all requests, stay within that grid, one CTA per chunk and KV head. It plans for all
the GPU's SMs, not for the SMs a green context leaves the decode stream, so on a partition the CTAs run in waves of
two per partition SM, and a wave lasts as long as its longest CTA. On a 64-SM partition of an H200, 22 requests of
15k tokens get one chunk each: 176 CTAs over 128 slots, two waves of a whole request's tokens where 1.4 would do,
and the step runs 17 % over a model linear in the cached tokens.

muxd's own decode kernels (attention/triton_decode.py, `kernel="triton"`: what CUDA-graph batches run by default)
plan for the whole GPU too: the split-KV kernel a fixed number of splits per row, the balanced one work items of about
equal pages aimed at a number of programs per SM of the device. On a partition their programs run in waves of the
programs its SMs hold at once, as flashinfer's do; batches past the largest graph run flashinfer's decode.

`DecodePlan.critical_tokens` replays the plan for a decode batch (its requests taken as equally long; the CUDA
graph's padding rows hold one page each) and returns the tokens on the critical path: the sum over waves of the
longest CTA's tokens. The solo-run model fits it beside the cached tokens (solo.py). Pure arithmetic: no CUDA.
"""
from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass

import numpy as np

from appliance.attention import triton_decode
from appliance.predictor.shapes import DecodeLoad

SLOTS_PER_SM = 2     # flashinfer's prefill-style plan: max grid = 2 CTAs x the device's SM count
MIN_CHUNK_TOKENS = 128
KERNELS = ("flashinfer", "triton")


@dataclass(frozen=True)
class DecodePlan:
    """What the kernel's plan depends on: the device's SM count, the model's KV heads, the KV page size, the
    batch sizes of the captured decode graphs (a batch runs padded to the next one; empty: no graphs) and the kernel
    those graphs run (`KERNELS`: flashinfer's tensor-core decode, or muxd's Triton kernels)."""

    total_sms: int
    kv_heads: int
    page_size: int
    graph_sizes: tuple[int, ...] = ()
    kernel: str = "flashinfer"

    def __post_init__(self) -> None:
        if self.kernel not in KERNELS:
            raise ValueError(f"decode kernel {self.kernel!r} is not one of {', '.join(KERNELS)}")

    def critical_tokens(self, load: DecodeLoad, sms: int) -> float:
        """Tokens on the critical path of one decode attention launch of `load` on `sms` SMs."""
        if load.empty:
            return 0.0
        batch = load.batch_size
        i = bisect.bisect_left(self.graph_sizes, batch)
        graph = self.graph_sizes[i] if i < len(self.graph_sizes) else None
        pad = (graph or batch) - batch  # rows of one page each
        pages = math.ceil(max(1, round(load.reused_tokens / batch) + 1) / self.page_size)
        if self.kernel == "triton" and graph is not None:
            return float(self.page_size * _triton_critical_pages(batch, pages, graph, self.kv_heads, self.total_sms,
                                                                 max(1, sms)))
        return float(self.page_size * _critical_pages(batch, pages, pad, self.kv_heads,
                                                      SLOTS_PER_SM * self.total_sms // self.kv_heads,
                                                      max(MIN_CHUNK_TOKENS // self.page_size, 1),
                                                      max(1, SLOTS_PER_SM * sms)))

    def to_dict(self) -> dict[str, int | str | list[int]]:
        return {"total_sms": self.total_sms, "kv_heads": self.kv_heads, "page_size": self.page_size,
                "graph_sizes": list(self.graph_sizes), "kernel": self.kernel}

    @classmethod
    def from_dict(cls, raw: dict) -> "DecodePlan":
        return cls(int(raw["total_sms"]), int(raw["kv_heads"]), int(raw["page_size"]),
                   tuple(sorted(int(s) for s in raw.get("graph_sizes", ()))), str(raw.get("kernel", "flashinfer")))


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
    return _waves([(batch * (chunks - 1) * heads, lo), (batch * heads, last), (pad * heads, 1)], slots)


@functools.lru_cache(maxsize=65536)
def _triton_critical_pages(batch: int, pages: int, graph: int, heads: int, total_sms: int, sms: int) -> int:
    """muxd's kernels on `batch` requests of `pages` pages padded to a graph of `graph` rows, on `sms` SMs: the
    split-KV kernel's splits (a fixed count per row, at least `PAGES_PER_BLOCK` pages each) up to its largest batch,
    beyond it the balanced kernel's work items as `triton_decode.balance` cuts them; in pages, as _critical_pages."""
    td = triton_decode
    if graph <= td.MAX_BATCH:
        splits = td.splits_for(graph)
        per = max(math.ceil(pages / splits), td.PAGES_PER_BLOCK)
        used = math.ceil(pages / per)
        groups = [(batch * (used - 1) * heads, per), (batch * heads, pages - (used - 1) * per),
                  ((graph - batch) * heads, 1)]
        return _waves(groups, td.PROGRAMS_PER_SM * sms)
    target, capacity = td.balanced_sizes(td.BALANCED_WAVES, total_sms, heads, graph)
    items = td.balance(np.array([pages] * batch + [1] * (graph - batch)), target, capacity, td.BALANCED_MIN_PAGES)
    items = items[items[:, 0] >= 0]
    lengths, counts = np.unique(items[:, 2] - items[:, 1], return_counts=True)
    return _waves([(int(c) * heads, int(n)) for n, c in zip(lengths[::-1], counts[::-1])],
                  td.BALANCED_PROGRAMS_PER_SM * sms)


def _waves(groups: list[tuple[int, int]], slots: int) -> int:
    """CTAs in groups of (count, pages each), longest group first, run in waves of `slots`: the sum over waves of
    each wave's first (longest) CTA."""
    total, start = 0, 0
    for count, size in groups:
        if count:
            total += size * (math.ceil((start + count) / slots) - math.ceil(start / slots))  # waves starting here
            start += count
    return total
