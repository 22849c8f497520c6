"""The profiling grid: which steps `muxd profile` measures on each partition — solo prefill (new x reused tokens) on
every prefill SM count, solo decode (batch x context) on every decode SM count, decode beside a prefill on every
split, and mixed steps (a prompt chunk and a decode batch in one forward on all SMs, as chunked prefill runs) —
their ranges (defaults, or where a trace says the workload lives), and their order: first the points every
fit needs, then held-out points (random, off the grid, never fitted), then the rest of the grid. A budget that runs
out early therefore still leaves a fit and an honest error figure.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Literal, Sequence

import numpy as np

from appliance.predictor.shapes import NO_DECODE, DecodeLoad, PrefillItem, Sample


@dataclass(frozen=True)
class Point:
    """One step to measure. `sms`: the prefill partition's SMs for prefill, the decode partition's otherwise.
    Decode batches are `batch` requests of `context` tokens each."""

    kind: Literal["prefill", "decode", "contended", "mixed"]
    sms: int
    new: int = 0
    reused: int = 0
    batch: int = 0
    context: int = 0
    holdout: bool = False

    @property
    def key(self) -> str:
        return (f"{self.kind}:{self.sms}:{self.new}:{self.reused}:{self.batch}:{self.context}"
                f"{':holdout' if self.holdout else ''}")

    @property
    def items(self) -> tuple[PrefillItem, ...]:
        return (PrefillItem(self.new, self.reused),) if self.kind != "decode" else ()

    @property
    def load(self) -> DecodeLoad:
        # a request of `context` tokens decodes its next token attending to context - 1 cached ones
        return DecodeLoad(self.batch, self.batch * (self.context - 1)) if self.kind != "prefill" else NO_DECODE

    def sample(self, ms: float) -> Sample:
        return Sample(self.kind, self.sms, ms, prefill=self.items, decode=self.load)

    @property
    def tokens(self) -> int:
        """KV tokens the point occupies at once (what the pool must hold)."""
        return self.new + self.reused + self.batch * (self.context + 16)


@dataclass(frozen=True)
class Ranges:
    prefill_new: tuple[int, ...] = (256, 1024, 2048, 4096, 8192)
    prefill_reused: tuple[int, ...] = (0, 4096, 16384)
    decode_batch: tuple[int, ...] = (1, 8, 32, 64, 128, 256)
    decode_context: tuple[int, ...] = (512, 2048, 8192)
    contended_new: tuple[int, ...] = (1024, 4096, 8192)
    contended_batch: tuple[int, ...] = (8, 32, 128)
    contended_context: tuple[int, ...] = (1024, 8192)
    mixed_new: tuple[int, ...] = (128, 512, 1024, 1536, 2048, 4096)
    mixed_batch: tuple[int, ...] = (1, 8, 32, 128)

    def clipped(self, max_prefill_tokens: int, max_num_seqs: int, max_model_len: int) -> "Ranges":
        """Only what the server will run: prefill batches up to max_prefill_tokens, decode batches up to
        max_num_seqs (one fewer beside a prefill), contexts within max_model_len."""
        def cap(values: Iterable[int], top: int) -> tuple[int, ...]:
            kept = sorted({min(v, top) for v in values if v >= 1})
            return tuple(kept) or (top,)

        new = cap(self.prefill_new, max_prefill_tokens)
        beside = max(1, max_num_seqs - 1)  # a decode batch beside a prefill leaves the prompt one sequence
        if max(self.prefill_new) > max_prefill_tokens and len(new) < len(self.prefill_new):
            new = _geometric(new[0], max_prefill_tokens, len(self.prefill_new))  # keep the grid's resolution
        return Ranges(new, tuple(sorted({min(r, max(0, max_model_len - new[-1] - 1)) for r in self.prefill_reused})),
                      cap(self.decode_batch, max_num_seqs), cap(self.decode_context, max_model_len - 32),
                      cap(self.contended_new, max_prefill_tokens), cap(self.contended_batch, beside),
                      cap(self.contended_context, max_model_len - 32), cap(self.mixed_new, max_prefill_tokens),
                      cap(self.mixed_batch, beside))

    @classmethod
    def from_lengths(cls, prompt: Sequence[int], output: Sequence[int], reused: Sequence[int]) -> "Ranges":
        """Ranges where a workload lives: prompt tokens not served from the prefix cache (new), the cached part
        (reused), decode contexts (prompt + half the output); batch sizes stay the defaults."""
        new = np.asarray([p - r for p, r in zip(prompt, reused)], dtype=float)
        hit = np.asarray([r for r in reused if r > 0], dtype=float)
        ctx = np.asarray([p + o / 2 for p, o in zip(prompt, output)], dtype=float)
        top = max(256, int(np.percentile(new, 99)))
        return cls(prefill_new=_geometric(128, top, 6),
                   prefill_reused=tuple(sorted({0, *(int(np.percentile(hit, q)) for q in (50, 80, 95))})) if hit.size
                   else (0,),
                   decode_context=tuple(sorted({max(64, int(np.percentile(ctx, q))) for q in (10, 50, 90)})),
                   contended_new=tuple(sorted({max(128, int(np.percentile(new, q))) for q in (50, 90)} | {top})),
                   contended_context=tuple(sorted({max(64, int(np.percentile(ctx, q))) for q in (25, 75)})))


def reused_tokens(specs: Sequence) -> list[int]:
    """Per request of a trace (objects with prompt_len, hash_ids, block_size), the prompt tokens a prefix cache
    would already hold when it arrives: its leading blocks seen in earlier requests (Mooncake's hash ids)."""
    seen: set[int] = set()
    out = []
    for s in specs:
        hit = 0
        for h in s.hash_ids:
            if h not in seen:
                break
            hit += 1
        seen.update(s.hash_ids)
        out.append(min(hit * s.block_size, max(0, s.prompt_len - 1)))
    return out


def _geometric(lo: int, hi: int, n: int) -> tuple[int, ...]:
    if hi <= lo:
        return (hi,)
    return tuple(sorted({int(round(lo * (hi / lo) ** (i / (n - 1)))) for i in range(n)}))


def _mid(values: Sequence[int]) -> int:
    return values[len(values) // 2]


def plan_points(ranges: Ranges, sm_count: int, decode_partitions: Sequence[int], holdout: int = 4,
                seed: int = 0, kv_tokens: int | None = None) -> list[Point]:
    """Every point to measure, in order: the fit's core on every partition, `holdout` random points per partition
    and phase, then the rest of the grid. Without partitions (CPU) only the all-SMs prefill and decode. With
    `kv_tokens`, only points the KV pool holds (a decode batch of long contexts the pool cannot hold runs as the
    largest batch of them it holds)."""
    points = _plan(ranges, sm_count, decode_partitions, holdout, seed, kv_tokens or 1 << 62)
    return [p for p in points if kv_tokens is None or p.tokens <= kv_tokens]


def phase_partitions(sm_count: int, decode_partitions: Sequence[int]) -> tuple[list[int], list[int]]:
    """The SM counts profiled for prefill (all SMs and each split's rest, widest first) and for decode (each split,
    then all SMs)."""
    splits = sorted(decode_partitions)
    return sorted({sm_count, *(sm_count - d for d in splits)}, reverse=True), [*splits, sm_count]


def _plan(ranges: Ranges, sm_count: int, decode_partitions: Sequence[int], holdout: int, seed: int,
          kv_tokens: int) -> list[Point]:
    splits = sorted(decode_partitions)
    prefill_sms, decode_sms = phase_partitions(sm_count, splits)
    new, reused = ranges.prefill_new, ranges.prefill_reused
    batch, context = ranges.decode_batch, ranges.decode_context
    core: list[Point] = []
    want_prefill = [(new[0], 0), (_mid(new), 0), (new[-1], 0), (_mid(new), reused[-1]), (new[-1], _mid(reused))]
    # fallbacks where those repeat (a workload without prefix-cache hits: reused is (0,)): other prompt lengths, so
    # that the core still holds the fit's samples
    want_prefill += [(new[len(new) // 4], 0), (new[3 * len(new) // 4], 0), *((n, 0) for n in new)]
    for s in prefill_sms:
        core += [Point("prefill", s, n, r) for n, r in list(dict.fromkeys(want_prefill))[:5]]
    wanted = [(batch[0], context[0]), (batch[-1], context[0]), (_mid(batch), context[-1]),
              (_mid(batch), _mid(context)), (batch[0], context[-1])]
    wanted += [(b, c) for c in reversed(context) for b in reversed(batch)]  # fallbacks when some do not fit
    feasible = [bc for bc in dict.fromkeys(wanted) if bc[0] * (bc[1] + 16) <= kv_tokens][:4]
    for s in decode_sms:
        core += [Point("decode", s, batch=b, context=c) for b, c in feasible]
    for d in splits:
        core.append(Point("contended", d, _mid(ranges.contended_new), 0, _mid(ranges.contended_batch),
                          _mid(ranges.contended_context)))
    mn, mb, ctx, hit = ranges.mixed_new, ranges.mixed_batch, _mid(context), _mid(reused)
    far = _far_prefix(ranges)
    core += [Point("mixed", sm_count, n, r, b, ctx) for n, r, b in
             [(mn[0], 0, mb[0]), (_mid(mn), 0, mb[1 % len(mb)]), (mn[-1], 0, mb[0]), (_mid(mn), hit, mb[-1]),
              (mn[-1], hit, _mid(mb)), (mn[1 % len(mn)], 0, _mid(mb)), (_mid(mn), far, _mid(mb))]]
    rng = np.random.default_rng(seed)
    held: list[Point] = []
    for _ in range(holdout):
        for s in prefill_sms:
            r = 0 if rng.random() < 0.4 else int(rng.integers(1, reused[-1] + 1)) if reused[-1] else 0
            held.append(Point("prefill", s, _log_uniform(rng, new[0], new[-1]), r, holdout=True))
        for s in decode_sms:
            b = _log_uniform(rng, batch[0], batch[-1])
            c = _log_uniform(rng, context[0], max(context[0], min(context[-1], kv_tokens // b - 16)))
            held.append(Point("decode", s, batch=b, context=c, holdout=True))
    cb, cc = ranges.contended_batch, ranges.contended_context
    for d in splits:
        b = _log_uniform(rng, cb[0], cb[-1])
        held.append(Point("contended", d, _log_uniform(rng, ranges.contended_new[0], ranges.contended_new[-1]), 0,
                          b, _log_uniform(rng, cc[0], max(cc[0], min(cc[-1], kv_tokens // b - 16))), holdout=True))
    for _ in range(holdout):
        b = _log_uniform(rng, mb[0], mb[-1])
        held.append(Point("mixed", sm_count, _log_uniform(rng, mn[0], mn[-1]), 0 if rng.random() < 0.5 else
                          int(rng.integers(0, far + 1)), b, _log_uniform(rng, context[0], context[-1]), holdout=True))
    rest = [Point("prefill", s, n, r) for s in prefill_sms for n in new for r in reused]
    # a batch of long contexts that the pool cannot hold is measured at the largest batch it can: the fit then
    # reaches as much KV as serving (and the held-out draw) can have at once
    rest += [Point("decode", s, batch=min(b, max(1, kv_tokens // (c + 16))), context=c)
             for s in decode_sms for b in batch for c in context]
    rest += [Point("contended", d, n, 0, b, c) for d in splits for n in ranges.contended_new
             for b in ranges.contended_batch for c in ranges.contended_context]
    rest += [Point("mixed", sm_count, n, r, b, ctx) for n in mn for r in sorted({0, hit, far}) for b in mb]
    seen: set[str] = set()
    out = []
    for p in core + held + rest:
        if p.key not in seen:
            seen.add(p.key)
            out.append(p)
    return out


def _far_prefix(ranges: Ranges) -> int:
    """The longest cached part a mixed step's chunk attends over: the longest prefix-cache hit of the ranges, or the
    earlier chunks of a prompt as long as the longest prefill (a workload without hits still chunks its long
    prompts). Without such points the mixed fit has no term for it (the prefix's attention rides on the others)."""
    return max(ranges.prefill_reused[-1], ranges.prefill_new[-1] - _mid(ranges.mixed_new), 0)


def _log_uniform(rng: np.random.Generator, lo: int, hi: int) -> int:
    if hi <= lo:
        return lo
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))
