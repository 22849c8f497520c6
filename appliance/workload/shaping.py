"""Workload shaping on lists of RequestSpec: synthetic traces (Poisson, gamma or constant arrivals; fixed, uniform or
lognormal lengths), time windows, request limits, re-timing to a rate or by a speed-up factor, and clipping to the
served model's context.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

import numpy as np

from appliance.errors import ConfigError
from appliance.workload.traces import RequestSpec


@dataclass(frozen=True)
class LengthDist:
    """Token-length distribution: fixed N, uniform [lo, hi], or lognormal with a median and sigma (of log length)."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, text: str, flag: str = "length") -> "LengthDist":
        """'128' or 'fixed:128', 'uniform:64:256', 'lognormal:128:0.5' (median 128 tokens, sigma 0.5)."""
        parts = str(text).strip().split(":")
        kind = "fixed" if len(parts) == 1 else parts[0]
        args = parts if len(parts) == 1 else parts[1:]
        arity = {"fixed": 1, "uniform": 2, "lognormal": 2}
        try:
            values = [float(x) for x in args]
        except ValueError:
            values = []
        if kind not in arity or len(values) != arity[kind] or not values:
            raise ConfigError(f"{flag}: cannot read {text!r}; write N, fixed:N, uniform:LO:HI or "
                              "lognormal:MEDIAN:SIGMA")
        dist = cls(kind, *values)
        if dist.a < 1 or (kind == "uniform" and dist.b < dist.a) or (kind == "lognormal" and dist.b < 0):
            raise ConfigError(f"{flag}: {text!r} is out of range (lengths >= 1, HI >= LO, SIGMA >= 0)")
        return dist

    def spread(self, ratio: float, flag: str) -> str:
        """A fixed length N as vLLM's --random-range-ratio spreads it: uniform over [N(1-ratio), N(1+ratio)], as a
        length spec; other forms are refused (they spread already)."""
        if not 0 <= ratio < 1:
            raise ConfigError(f"{flag} must be in [0, 1), got {ratio:g}")
        if self.kind != "fixed":
            raise ConfigError(f"{flag} spreads a fixed length N; {self.kind} lengths spread already")
        low, high = max(1, math.floor(self.a * (1 - ratio))), math.ceil(self.a * (1 + ratio))
        return f"uniform:{low}:{high}"

    def sample(self, n: int, rng: np.random.Generator) -> list[int]:
        if self.kind == "fixed":
            values = np.full(n, self.a)
        elif self.kind == "uniform":
            values = rng.integers(int(self.a), int(self.b) + 1, size=n)
        else:
            values = rng.lognormal(math.log(self.a), self.b, size=n)
        return [max(1, int(round(v))) for v in values]


PRESETS = {  # named synthetic workloads: (prompt lengths, output lengths)
    # short-prompt chat: most prompts 400-2,500 tokens, outputs 120-500, as in public chat traces
    "chat-short": ("lognormal:1000:0.6", "lognormal:250:0.5"),
}


def preset(name: str) -> tuple[str, str]:
    """The length distributions of a named synthetic workload."""
    if name not in PRESETS:
        raise ConfigError(f"--workload {name!r} is unknown; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]


def arrival_times(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """n arrival times at `rate` requests/s, the first at 0 s. Gaps are gamma-distributed with shape `burstiness`
    and mean 1/rate, as in vLLM's benchmark (1 = Poisson, < 1 burstier, > 1 more regular); burstiness=inf gives
    constant gaps; rate=inf sends everything at 0 s."""
    if n <= 0:
        return []
    if rate <= 0 or math.isnan(rate):
        raise ConfigError(f"request rate must be > 0 (or inf), got {rate}")
    if burstiness <= 0:
        raise ConfigError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * n
    if math.isinf(burstiness):
        gaps = np.full(n - 1, 1.0 / rate)
    else:
        gaps = np.random.default_rng(seed).gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    return [0.0] + np.cumsum(gaps).tolist()


def synthetic(n: int, rate: float, input_len: LengthDist, output_len: LengthDist, burstiness: float = 1.0,
              seed: int = 0, prefix_len: int = 0) -> list[RequestSpec]:
    """A synthetic workload of n requests (seeded, so a run can be repeated exactly). `prefix_len`: every prompt
    starts with the same prefix of that many tokens, before its own `input_len` tokens (vLLM's
    --random-prefix-len): block 0 of each prompt is the shared one, its other blocks its own."""
    if n < 1:
        raise ConfigError(f"--num-prompts must be >= 1 for a synthetic trace, got {n}")
    if prefix_len < 0:
        raise ConfigError(f"--random-prefix-len must be >= 0, got {prefix_len}")
    rng = np.random.default_rng(seed + 1)
    times = arrival_times(n, rate, burstiness, seed)
    specs = [RequestSpec(t, p, o) for t, p, o in zip(times, input_len.sample(n, rng), output_len.sample(n, rng))]
    if prefix_len == 0:
        return specs
    out = []
    for i, s in enumerate(specs):
        total = prefix_len + s.prompt_len
        own = range(1 + i * _BLOCKS_PER_REQUEST, i * _BLOCKS_PER_REQUEST + math.ceil(total / prefix_len))
        out.append(replace(s, prompt_len=total, hash_ids=(0, *own), block_size=prefix_len))
    return out


_BLOCKS_PER_REQUEST = 1 << 24  # hash ids of one synthetic request's own blocks: [1 + i * this, ...)


_WINDOW = re.compile(r"^\s*([0-9.]*)\s*:\s*([0-9.]*)\s*$")


def parse_window(text: str) -> tuple[float, float]:
    """'START:END' in seconds from the trace start; either side may be empty ('600:' or ':60')."""
    m = _WINDOW.match(text or "")
    try:
        start = float(m.group(1) or 0) if m else None
        end = float(m.group(2)) if m and m.group(2) else math.inf
    except ValueError:
        start = None
    if start is None or end <= start:
        raise ConfigError(f"--window: cannot read {text!r}; write START:END in seconds with END > START, "
                          "e.g. 600:900, 600: or :60")
    return start, end


def select(specs: list[RequestSpec], window: tuple[float, float] | None = None, skip: int = 0,
           max_requests: int | None = None) -> list[RequestSpec]:
    """Requests with start <= arrival < end, then skip the first `skip` and keep `max_requests`; the result is
    shifted so its first request arrives at 0 s."""
    if window is not None:
        start, end = window
        specs = [s for s in specs if start <= s.arrival < end]
    if max_requests is not None and max_requests < 1:
        raise ConfigError(f"--max-requests must be >= 1, got {max_requests}")
    specs = specs[skip:skip + max_requests if max_requests is not None else None]
    if not specs:
        raise ConfigError("no request of the trace is left after --window / --skip / --max-requests")
    t0 = specs[0].arrival
    return [replace(s, arrival=s.arrival - t0) for s in specs]


def retime(specs: list[RequestSpec], rate: float | None = None, speedup: float | None = None,
           burstiness: float = 1.0, seed: int = 0) -> list[RequestSpec]:
    """Change arrival times, keeping order and lengths.

    speedup: every arrival divided by the factor (2 = twice as fast).
    rate:    the trace's gaps scaled so that its average rate, (n - 1) / (last - first arrival), is exactly `rate`
             requests/s, keeping the burst pattern. A trace without times (every arrival equal, e.g. ShareGPT) gets
             gamma arrivals instead (see `arrival_times`); rate=inf sends everything at 0 s.
    """
    if rate is not None and speedup is not None:
        raise ConfigError("give either --request-rate or --speedup, not both")
    if speedup is not None:
        if not speedup > 0 or math.isinf(speedup):
            raise ConfigError(f"--speedup must be a finite number > 0, got {speedup}")
        return [replace(s, arrival=s.arrival / speedup) for s in specs]
    if rate is None:
        return list(specs)
    if not rate > 0:
        raise ConfigError(f"--request-rate must be > 0 (or inf), got {rate}")
    span = specs[-1].arrival - specs[0].arrival
    if math.isinf(rate) or len(specs) == 1:
        return [replace(s, arrival=0.0) for s in specs]
    if span <= 0:
        times = arrival_times(len(specs), rate, burstiness, seed)
        return [replace(s, arrival=t) for s, t in zip(specs, times)]
    scale = (len(specs) - 1) / (rate * span)
    t0 = specs[0].arrival
    return [replace(s, arrival=(s.arrival - t0) * scale) for s in specs]


def spread_ties(specs: list[RequestSpec], seed: int = 0) -> list[RequestSpec]:
    """Spread requests that share an arrival time uniformly (seeded) over the gap to the next distinct time.

    For traces recorded at a coarse resolution: Mooncake's timestamps come in 3 s steps, so about ten requests of
    each step carry the same millisecond; replayed as is they arrive as one burst. The last group spreads over the
    trace's median gap. Order within the result is by the new arrival time."""
    if len(specs) < 2:
        return list(specs)
    times = sorted({s.arrival for s in specs})
    gaps = np.diff(times)
    tail = float(np.median(gaps)) if len(gaps) else 0.0
    width = {t: (gaps[i] if i < len(gaps) else tail) for i, t in enumerate(times)}
    rng = np.random.default_rng(seed)
    moved = [replace(s, arrival=s.arrival + float(rng.uniform(0.0, width[s.arrival]))) for s in specs]
    return sorted(moved, key=lambda s: s.arrival)


def offered_rate(specs: list[RequestSpec]) -> float:
    """The average arrival rate (n - 1) / span in requests/s (inf when everything arrives at once)."""
    span = specs[-1].arrival - specs[0].arrival if specs else 0.0
    return (len(specs) - 1) / span if span > 0 else math.inf


def clip_to_context(specs: list[RequestSpec], max_model_len: int) -> tuple[list[RequestSpec], int]:
    """Fit every request in `max_model_len` tokens (prompt + output); returns the specs and how many were clipped.

    The prompt gives way first (cutting its tail keeps shared prefixes shared), but keeps at least half the context
    when the output alone would fill it; then the output is cut to what is left. Recorded prompt texts are kept
    (the server counts their tokens) and only their output is cut."""
    if max_model_len < 2:
        raise ConfigError(f"max_model_len must be >= 2 to clip a trace, got {max_model_len}")
    out, clipped = [], 0
    for s in specs:
        if s.prompt_len + s.output_len <= max_model_len:
            out.append(s)
            continue
        clipped += 1
        if s.prompt is not None:
            out.append(replace(s, output_len=max(1, max_model_len - s.prompt_len)))
            continue
        prompt = min(s.prompt_len, max_model_len - min(s.output_len, max_model_len // 2))
        output = min(s.output_len, max_model_len - prompt)
        ids = s.hash_ids[:math.ceil(prompt / s.block_size)] if s.hash_ids else ()
        out.append(replace(s, prompt_len=prompt, output_len=output, hash_ids=ids))
    return out, clipped
