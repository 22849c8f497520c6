"""Prefill GEMM row buckets: one decoder layer's GEMM time, measured per prefill partition at a fixed set of row
counts, and the row count a prefill launch is padded to.

cuBLAS picks its GEMM kernel from the shape for the whole GPU, not for the SMs a green context leaves the prefill
stream, and on a partition some row counts get a poor choice: on 20 SMs of an H200 one Llama-8B layer's GEMMs take
2.33 ms for 448 rows and 1.73 ms for 512. A latency model linear in the tokens cannot follow such steps, and the
prefill pays them. So `muxd profile` times the GEMMs at bucket sizes (16 per octave, from 32 rows up to the largest
prefill batch) on each partition, the executor pads a prefill launch's rows to the cheapest bucket at or above its
token count (padded rows are zeros that attention skips and the runner drops), and the solo-run model reads the
table for the GEMM time of the rows it will run: measured, not fitted. Launches of at most `graph_rows` tokens run
as piecewise CUDA graphs captured at the buckets up to `graph_rows` (engine/prefill_graphs.py), so they pad only
within those. Pure arithmetic: no CUDA.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

MIN_ROWS = 32
PER_OCTAVE = 16


def bucket_sizes(max_rows: int) -> tuple[int, ...]:
    """Row counts from MIN_ROWS up to at least `max_rows`: steps of MIN_ROWS below 512 rows, then 16 per octave
    (so padding to the next bucket adds at most 1/16 of the rows)."""
    sizes, rows = [], MIN_ROWS
    while True:
        sizes.append(rows)
        if rows >= max_rows:
            return tuple(sizes)
        rows += max(MIN_ROWS, (1 << (rows.bit_length() - 1)) // PER_OCTAVE)


@dataclass(frozen=True)
class GemmTable:
    """One layer's GEMM milliseconds at each bucket size (`rows`, ascending), per prefill SM count; launches of at
    most `graph_rows` tokens pad to buckets of at most `graph_rows` rows (0: no such limit)."""

    rows: tuple[int, ...]
    ms: dict[int, tuple[float, ...]]
    graph_rows: int = 0
    _best: dict[int, list[int]] = field(default_factory=dict, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.rows or list(self.rows) != sorted(set(self.rows)) or self.rows[0] < 1:
            raise ValueError(f"bucket sizes must be positive and ascending, got {list(self.rows)[:8]}...")
        for sms, times in self.ms.items():
            if len(times) != len(self.rows):
                raise ValueError(f"{sms} SMs has {len(times)} times for {len(self.rows)} bucket sizes")
            if min(times) <= 0:
                raise ValueError(f"{sms} SMs has a time <= 0")
            # the cheapest bucket at or above each one (ties: the smaller), on its side of graph_rows
            best, j = [0] * len(times), len(times) - 1
            for i in range(len(times) - 1, -1, -1):
                if times[i] <= times[j] or (self.rows[i] <= self.graph_rows < self.rows[j]):
                    j = i
                best[i] = j
            self._best[sms] = best

    def padded_rows(self, tokens: int, sms: int) -> int:
        """The rows a prefill launch of `tokens` tokens runs on `sms` SMs: the cheapest bucket at or above them;
        `tokens` itself beyond the largest bucket or on a partition the table does not have."""
        best = self._best.get(sms)
        i = bisect.bisect_left(self.rows, tokens)
        if best is None or i == len(self.rows):
            return tokens
        return self.rows[best[i]]

    def gemm_ms(self, tokens: int, sms: int) -> float:
        """One layer's GEMM time for `tokens` rows as the executor runs them on `sms` SMs (a profiled partition):
        the padded bucket's; beyond the largest bucket, its time scaled by the rows."""
        if tokens <= 0:
            return 0.0
        times, best = self.ms[sms], self._best[sms]
        i = bisect.bisect_left(self.rows, tokens)
        if i == len(self.rows):
            return times[-1] * tokens / self.rows[-1]
        return times[best[i]]

    def graph_sizes(self) -> tuple[int, ...]:
        """The buckets that launches run as CUDA graphs."""
        return tuple(r for r in self.rows if r <= self.graph_rows)

    def pad_targets(self, sms: int) -> tuple[int, ...]:
        """The buckets that some launch on `sms` SMs pads to (a bucket slower than a larger one never is: on 20 SMs
        of an H200 a third of them); every bucket on a partition the table does not have."""
        best = self._best.get(sms)
        return self.rows if best is None else tuple(self.rows[j] for j in sorted(set(best)))

    def to_dict(self) -> dict:
        return {"rows": list(self.rows), "ms": {str(k): list(v) for k, v in sorted(self.ms.items())},
                "graph_rows": self.graph_rows}

    @classmethod
    def from_dict(cls, raw: dict) -> "GemmTable":
        return cls(tuple(int(r) for r in raw["rows"]),
                   {int(k): tuple(float(x) for x in v) for k, v in raw["ms"].items()}, int(raw.get("graph_rows", 0)))
