"""How the prefill attention kernel spreads a batch over the SMs it runs on, as a latency feature.

On Hopper, flashinfer's paged prefill runs the FA3 kernel: a persistent grid of one CTA per SM of the whole GPU, each
CTA working through a list of query tiles (128 rows of one query head; group heads are not fused) that the plan
assigns greedily, each tile to the least loaded CTA, at a cost of 2 x 128 plus the keys the tile attends to. On a
green-context partition the grid's CTAs take turns on the partition's SMs, one at a time each, so the step lasts as
long as the partition's most loaded SM. A prompt of 128 new tokens is 32 tiles, one wave on a 52-SM partition; one of
159 tokens is 64 tiles, two waves, and over 20k cached tokens its step ran 25 % over a model linear in new x cached
tokens.

`PrefillPlan.critical_tokens` replays that plan for a prefill batch and returns the cost on the critical path of the
partition (in the plan's units, keys plus twice the tile rows). The solo-run model fits it beside the other prefill
terms (solo.py). Pure arithmetic: no CUDA.
"""
from __future__ import annotations

import functools
import heapq
import math
from dataclasses import dataclass
from typing import Sequence

from appliance.predictor.shapes import PrefillItem

TILE_Q = 128  # FA3's query tile for head dims above 64


@dataclass(frozen=True)
class PrefillPlan:
    """What the kernel's plan depends on: the device's SM count (its grid) and the model's query heads."""

    total_sms: int
    qo_heads: int
    tile_q: int = TILE_Q

    def critical_tokens(self, items: Sequence[PrefillItem], sms: int) -> float:
        """The cost on the critical path of one prefill attention launch of `items` on `sms` SMs."""
        if not items:
            return 0.0
        work = tuple(sorted(((int(i.new), int(i.new + i.reused)) for i in items), key=lambda w: -w[1]))
        return _critical_cost(work, max(1, sms), self.total_sms, self.qo_heads, self.tile_q)

    def to_dict(self) -> dict[str, int]:
        return {"total_sms": self.total_sms, "qo_heads": self.qo_heads, "tile_q": self.tile_q}

    @classmethod
    def from_dict(cls, raw: dict) -> "PrefillPlan":
        return cls(int(raw["total_sms"]), int(raw["qo_heads"]), int(raw.get("tile_q", TILE_Q)))


@functools.lru_cache(maxsize=4096)  # the planner asks for the same batches step after step, on several partitions
def _cta_loads(work: tuple[tuple[int, int], ...], grid: int, heads: int, tile: int) -> tuple[int, ...]:
    """Each of the `grid` CTAs' load, in CTA order. `work`: (new, kv) per request, longest kv first (the plan's
    order). Tiles go to the least loaded CTA, per head, each request's last tile first."""
    tiles = []  # one head's tiles in plan order: each attends its causal end of the keys
    for new, kv in work:
        count = math.ceil(new / tile)
        for t in range(count - 1, -1, -1):
            end = kv if t + 1 == count else max(min(kv - new + (t + 1) * tile, kv), 0)
            tiles.append(2 * tile + end)
    if not tiles:
        return ()
    # a CTA is one integer, load x grid + index: the heap's least is the least loaded, ties to the lowest index,
    # and one heapreplace moves it
    loads = list(range(grid))
    for _ in range(heads):
        for cost in tiles:
            heapq.heapreplace(loads, loads[0] + cost * grid)
    return tuple(key // grid for key in sorted(loads, key=lambda k: k % grid))


@functools.lru_cache(maxsize=16384)
def _critical_cost(work: tuple[tuple[int, int], ...], sms: int, grid: int, heads: int, tile: int) -> float:
    """The CTAs (`_cta_loads`) run in index order on `sms` SMs, one at a time each: the last SM to finish."""
    loads = _cta_loads(work, grid, heads, tile)
    if not loads:
        return 0.0
    free = [0] * min(sms, grid)  # when each SM is next free
    for load in loads:
        heapq.heapreplace(free, free[0] + load)
    return float(max(free))
