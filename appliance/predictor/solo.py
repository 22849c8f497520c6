"""The solo-run model of MuxWise, fitted by least squares per partition (SM count):
prefill = max(h, a*sum(n^2) + b*sum(n*r) + c*sum(n) + d), decode = e*sum(r) + f*bs + g (n new, r reused tokens),
and, where mixed steps were measured, mixed = max(h', a'*sum(n^2) + b'*sum(n*r) + c'*(sum(n) + bs) + e'*sum(r) + d').
Where the decode attention kernel's plan is known (decode_plan.py), decode adds k*w, w the tokens on the critical path
of its CTA waves on the partition: the kernel plans for the whole GPU, and some batches leave a last wave half empty.
Where the profile measured the GEMMs per partition (gemm_table.py), prefill adds q*G(sum(n)), G one layer's GEMM time
for the padded rows the executor runs: kernel choices make it a staircase with spikes no term in n can follow.
Where the prefill attention kernel's plan is known too (prefill_plan.py), prefill adds w*v, v the cost on the
critical path of its persistent CTAs on the partition: the kernel's grid is the whole GPU's, and query tiles come
in waves. A partition keeps those two terms only where fits that leave one of its samples out predict it better with
them than without (a partition profiled at a few sizes otherwise threads them and misses the sizes between).

h is the host's floor: a short prefill runs its layers eagerly, and below some hundreds of tokens the host launching
kernels, not the GPU running them, sets its time (MuxWise's model, fitted through such points, bends its GPU terms
to them and misses both regimes). The fit minimises relative error (latencies span three orders of magnitude) and
keeps coefficients non-negative; the floor is chosen among candidates by the same error.

A fit is good where it was measured. Past the largest prefill the profile measured (a short profile, or one made for
a workload of shorter prompts), terms that shared the measured range diverge; there the model takes its time at the
edge of that range and scales it as the roofline prior scales, and it never predicts a prefill slower on more SMs.
A mixed step whose chunk attends over a cached prefix reaching past the range takes the mixed fit with the prefix cut
to the range, plus what the prefill model adds for the rest of it.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from appliance.errors import ConfigError
from appliance.predictor.decode_plan import DecodePlan
from appliance.predictor.gemm_table import GemmTable
from appliance.predictor.prefill_plan import PrefillPlan
from appliance.predictor.shapes import DecodeLoad, LatencyModel, PrefillItem, Sample, prefill_features

PREFILL_MEMO = 4096  # prefill figures remembered per model (cleared when full)
PREFILL_TERMS = ("sum_n2", "sum_nr", "sum_n", "const")
PREFILL_GEMM_TERMS = (*PREFILL_TERMS, "gemm_ms")
PREFILL_PLAN_TERMS = (*PREFILL_GEMM_TERMS, "critical_path")
DECODE_TERMS = ("sum_r", "batch", "const")
DECODE_PLAN_TERMS = (*DECODE_TERMS, "critical_path")
MIXED_TERMS = ("sum_n2", "sum_nr", "sum_n+batch", "decode_sum_r", "const")


@dataclass(frozen=True)
class MeasuredRange:
    """The longest prompt a profile's prefills measured: its new tokens, and its new plus reused tokens. (A batch of
    such prompts stays in range: the terms in its total tokens are linear, the GEMM table's too past its rows; the
    quadratic ones are per prompt.)"""

    new: int
    kv: int

    def fraction(self, items: Sequence[PrefillItem]) -> float:
        """1 for a batch within the range, else the factor that shrinks every prompt of it to the range's edge."""
        new = max(i.new for i in items)
        kv = max(i.new + i.reused for i in items)
        return min(1.0, self.new / max(new, 1), self.kv / max(kv, 1))

    def to_dict(self) -> dict[str, int]:
        return {"prefill_new": self.new, "prefill_kv": self.kv}

    @classmethod
    def from_dict(cls, raw: dict[str, int]) -> "MeasuredRange":
        return cls(int(raw["prefill_new"]), int(raw["prefill_kv"]))

    @classmethod
    def of(cls, samples: Sequence[Sample]) -> "MeasuredRange | None":
        items = [i for s in samples if s.kind == "prefill" for i in s.prefill]
        if not items:
            return None
        return cls(max(i.new for i in items), max(i.new + i.reused for i in items))


@dataclass(frozen=True)
class SoloModel:
    """Coefficients per SM count. An SM count between profiled ones uses the next smaller profiled partition
    (never optimistic); below the smallest, that one's latency scaled by the SM ratio. With `measured` and `prior`,
    a prefill past the measured range scales the range edge's time as the prior does."""

    prefill: dict[int, tuple[float, ...]]  # a, b, c, d[, h[, q[, w]]] (q: with a GEMM table, w: and a plan)
    decode: dict[int, tuple[float, ...]]   # e, f, g[, k] (k: with a decode plan)
    mixed: tuple[float, ...] | None = None  # a', b', c', e', d', h' on all SMs; None: composed from the others
    decode_plan: DecodePlan | None = None
    gemm: GemmTable | None = None
    prefill_plan: PrefillPlan | None = None
    measured: MeasuredRange | None = None
    prior: LatencyModel | None = None
    _keys: dict[str, list[int]] = field(default_factory=dict, init=False, compare=False, repr=False)
    # prefill_ms by (items, sms): a planner asks about the same waiting batches step after step
    _memo: dict[tuple, float] = field(default_factory=dict, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.prefill or not self.decode:
            raise ConfigError("a solo model needs coefficients for prefill and for decode on at least one partition")
        self._keys["prefill"] = sorted(self.prefill)
        self._keys["decode"] = sorted(self.decode)

    def _partition(self, kind: str, sms: int) -> tuple[tuple[float, ...], float, int]:
        """The coefficients of the profiled partition standing in for `sms`, the scale on its time, its SMs."""
        keys = self._keys[kind]
        table = self.prefill if kind == "prefill" else self.decode
        i = bisect.bisect_right(keys, sms) - 1
        if i < 0:
            return table[keys[0]], keys[0] / max(sms, 1), keys[0]
        return table[keys[i]], 1.0, keys[i]

    def _prefill(self, sms: int) -> tuple[tuple[float, ...], float, int]:
        """a, b, c, d, h, q, w of the partition standing in for `sms` (0 where a profile has no h, q or w), the
        scale on its time and its SMs."""
        coefficients, scale, key = self._partition("prefill", sms)
        a, b, c, d, h, q, w = (*coefficients, 0.0, 0.0, 0.0)[:7]
        return (a, b, c, d, h, q, w), scale, key

    def _kernels(self, q: float, w: float, items: Sequence[PrefillItem], rows: int, sms: int) -> float:
        """The GEMM table's and the attention plan's terms."""
        gemm = q * self.gemm.gemm_ms(rows, sms) if q and self.gemm is not None else 0.0
        return gemm + (w * self.prefill_plan.critical_tokens(items, sms) if w and self.prefill_plan else 0.0)

    def prefill_ms(self, items: Sequence[PrefillItem], sms: int) -> float:
        """A prefill batch alone on `sms` SMs. Past the measured range: the batch shrunk to the range's edge,
        scaled by the prior's ratio between the two (a partition whose fit put the GEMMs' time on the quadratic
        attention term predicted a 28k-token prompt three times slower on all SMs than on 100 of them)."""
        if not items:
            return 0.0
        key = (tuple(items), sms)
        ms = self._memo.get(key)
        if ms is None:
            if len(self._memo) >= PREFILL_MEMO:
                self._memo.clear()
            ms = self._memo[key] = self._prefill_ms(items, sms)
        return ms

    def _prefill_ms(self, items: Sequence[PrefillItem], sms: int) -> float:
        f = self.measured.fraction(items) if self.measured is not None and self.prior is not None else 1.0
        if f >= 1.0:
            return self._fitted(items, sms)
        edge = tuple(PrefillItem(max(1, int(i.new * f)), int(i.reused * f)) for i in items)
        return self._fitted(edge, sms) * self.prior.prefill_ms(items, sms) / self.prior.prefill_ms(edge, sms)

    def _fitted(self, items: Sequence[PrefillItem], sms: int) -> float:
        """The partition's fit, held to what every narrower profiled partition predicts (more SMs never run a
        prefill slower)."""
        features = prefill_features(items)
        ms = self._prefill_on(items, features, sms)
        own = self._partition("prefill", sms)[2]
        for key in self._keys["prefill"]:
            if key >= own:
                break
            ms = min(ms, self._prefill_on(items, features, key))
        return ms

    def _prefill_on(self, items: Sequence[PrefillItem], features: tuple[float, float, float], sms: int) -> float:
        (a, b, c, d, h, q, w), scale, key = self._prefill(sms)
        n2, nr, n = features
        return scale * max(h, a * n2 + b * nr + c * n + d + self._kernels(q, w, items, int(n), key))

    def decode_ms(self, load: DecodeLoad, sms: int) -> float:
        if load.empty:
            return 0.0
        (e, f, g, *k), scale, key = self._partition("decode", sms)
        waves = k[0] * self.decode_plan.critical_tokens(load, key) if k and self.decode_plan else 0.0
        return scale * (e * load.reused_tokens + f * load.batch_size + g + waves)

    def mixed_ms(self, items: Sequence[PrefillItem], load: DecodeLoad, sms: int) -> float:
        """The measured mixed model where there is one; else decode rows ride in the prefill's token batch: they cost
        the per-token term c, plus decode attention (e per reused token); the fixed cost is paid once."""
        if not items:
            return self.decode_ms(load, sms)
        n2, nr, n = prefill_features(items)
        if self.mixed is not None:
            return max(self.mixed[5], self.mixed_gpu_ms(items, load))
        (a, b, c, d, h, q, w), scale, key = self._prefill(sms)
        (e, _, g, *_k), dscale, _ = self._partition("decode", sms)
        rows = int(n) + load.batch_size
        gpu = (scale * (a * n2 + b * nr + c * rows + max(d, g) + self._kernels(q, w, items, rows, key))
               + dscale * e * load.reused_tokens)
        return max(gpu, scale * h)

    def mixed_gpu_ms(self, items: Sequence[PrefillItem], load: DecodeLoad) -> float:
        """The measured mixed model without its host floor h' (0 without a measured mixed model). A chunk whose
        cached prefix reaches past the profile's measured range costs the model's time with the prefix cut to the
        range, plus what the prefill model (scaled past the range as the prior scales) adds for the rest of it:
        a profile whose mixed steps all had short prefixes fits no attention term over them."""
        if self.mixed is None or not items:
            return 0.0
        edge = self._mixed_edge(items)
        ms = self._mixed_terms(edge, load)
        if edge is not items:
            full = self._keys["prefill"][-1]
            ms += max(0.0, self.prefill_ms(items, full) - self.prefill_ms(edge, full))
        return ms

    def _mixed_terms(self, items: Sequence[PrefillItem], load: DecodeLoad) -> float:
        a, b, c, e, d, _h = self.mixed
        n2, nr, n = prefill_features(items)
        return a * n2 + b * nr + c * (n + load.batch_size) + e * load.reused_tokens + d

    def _mixed_edge(self, items: Sequence[PrefillItem]) -> Sequence[PrefillItem]:
        """The chunks with each cached prefix cut so that the chunk ends within the measured range (`items` itself
        where all do, or where the profile records no range)."""
        if self.measured is None or self.prior is None or all(i.new + i.reused <= self.measured.kv for i in items):
            return items
        return tuple(PrefillItem(i.new, max(0, min(i.reused, self.measured.kv - i.new))) for i in items)

    @property
    def partitions(self) -> list[int]:
        return sorted(set(self.prefill) | set(self.decode))


@dataclass(frozen=True)
class FitError:
    """Relative errors of a fitted model on samples, per phase: max and mean of |pred - meas| / meas."""

    prefill_max: float
    prefill_mean: float
    decode_max: float
    decode_mean: float
    mixed_max: float = 0.0
    mixed_mean: float = 0.0


def features(sample: Sample, decode_plan: DecodePlan | None = None, gemm: GemmTable | None = None,
             prefill_plan: PrefillPlan | None = None) -> list[float]:
    if sample.kind == "prefill":
        row = [*prefill_features(sample.prefill), 1.0]
        if gemm:
            row.append(gemm.gemm_ms(int(row[2]), sample.sms))
            if prefill_plan:
                row.append(prefill_plan.critical_tokens(sample.prefill, sample.sms))
        return row
    if sample.kind == "mixed":
        n2, nr, n = prefill_features(sample.prefill)
        return [n2, nr, n + sample.decode.batch_size, float(sample.decode.reused_tokens), 1.0]
    row = [float(sample.decode.reused_tokens), float(sample.decode.batch_size), 1.0]
    return row + [decode_plan.critical_tokens(sample.decode, sample.sms)] if decode_plan else row


def fit_solo(samples: Sequence[Sample], decode_plan: DecodePlan | None = None,
             gemm: GemmTable | None = None, prefill_plan: PrefillPlan | None = None) -> SoloModel:
    """Least-squares fit per (phase, SM count) of solo samples (prefill and mixed with a host floor); a partition
    needs at least as many distinct samples as terms, and one with fewer is left out like one never measured (the
    model predicts it from the nearest narrower partition, `_partition`), so a profile whose budget ran out part way
    through the grid still serves; prefill and decode each need one partition fitted. Mixed samples are optional.
    With `decode_plan`, decode also fits the critical path of the attention kernel's waves, with `gemm` prefill the
    measured GEMM time, and with both `gemm` and `prefill_plan` the critical path of the prefill attention kernel
    (each where a partition has the samples for it and it predicts a sample left out of the fit better,
    `_prefill_form`)."""
    tables: dict[str, dict[int, tuple[float, ...]]] = {"prefill": {}, "decode": {}, "mixed": {}}
    groups: dict[tuple[str, int], list[Sample]] = {}
    for s in samples:
        if s.kind in tables:
            groups.setdefault((s.kind, s.sms), []).append(s)
    short: dict[str, list[str]] = {"prefill": [], "decode": []}
    for (kind, sms), group in sorted(groups.items()):
        terms = {"prefill": PREFILL_TERMS, "decode": DECODE_TERMS, "mixed": MIXED_TERMS}[kind]
        if len(group) < len(terms):
            if kind != "mixed":  # (too few mixed samples: the composed estimate stands)
                short[kind].append(f"{len(group)} on {sms} SMs")
            continue
        plan = decode_plan if kind == "decode" and len(group) >= len(DECODE_PLAN_TERMS) else None
        table = gemm if (kind == "prefill" and gemm is not None and sms in gemm.ms
                         and len(group) >= len(PREFILL_GEMM_TERMS)) else None
        waves = prefill_plan if table is not None and len(group) >= len(PREFILL_PLAN_TERMS) else None
        x = np.array([features(s, plan, table, waves) for s in group])
        y = np.array([s.ms for s in group])
        if kind == "prefill":
            x = x[:, :_prefill_form(x, y)]
        beta = _fit_with_floor(x, y) if kind != "decode" else tuple(_nonnegative_relative_lstsq(x, y))
        if kind == "prefill":  # (a, b, c, d[, q[, w]], h) -> (a, b, c, d, h[, q[, w]])
            beta = (*beta[:4], beta[-1], *beta[4:-1])
        tables[kind][sms] = tuple(float(v) for v in beta)
    for kind, terms in (("prefill", PREFILL_TERMS), ("decode", DECODE_TERMS)):
        if short[kind] and not tables[kind]:  # (with no samples at all, SoloModel says so)
            raise ConfigError(f"no {kind} partition has the samples its fit needs ({', '.join(short[kind])}); the "
                              f"fit of {', '.join(terms)} needs at least {len(terms)}")
    mixed = tables["mixed"][max(tables["mixed"])] if tables["mixed"] else None  # measured on all SMs only
    return SoloModel(tables["prefill"], tables["decode"], mixed, decode_plan, gemm, prefill_plan,
                     MeasuredRange.of(samples))


def _prefill_form(x: np.ndarray, y: np.ndarray) -> int:
    """How many of a partition's prefill terms to fit (its columns, in order: the four of PREFILL_TERMS, then the
    GEMM table's and the attention plan's where it has them): the form whose fits, each leaving one sample out, best
    predict the sample left out. A partition profiled at a few sizes has about as many samples as the fullest form
    has terms, and that form then threads every sample and predicts the sizes between them worst (an H100 profile's
    all-SM prefill put its whole time on the attention term and a constant: 29.7 % off a held-out prompt, 14 % with
    the GEMM term and no attention term)."""
    forms = [k for k in range(x.shape[1], len(PREFILL_TERMS) - 1, -1) if len(y) - 1 >= k]
    if len(forms) < 2:
        return x.shape[1]

    def left_out_error(k: int) -> float:
        errs = []
        for i in range(len(y)):
            keep = np.arange(len(y)) != i
            *beta, h = _fit_with_floor(x[keep, :k], y[keep])
            errs.append((max(float(x[i, :k] @ np.array(beta)), h) - y[i]) / y[i])
        return float(np.mean(np.square(errs)))

    return min(forms, key=left_out_error)


def _fit_with_floor(x: np.ndarray, y: np.ndarray) -> tuple[float, ...]:
    """Coefficients and the host's floor h of max(h, x beta): for each candidate floor (none, or one of the
    lower measured times), beta is fitted to the samples clearly above it; the pair with the least relative
    squared error over all samples wins."""
    best, best_err = None, float("inf")
    for h in [0.0, *np.unique(np.percentile(y, np.arange(0, 55, 5)))]:
        above = y > 1.1 * h
        if above.sum() < x.shape[1]:
            continue
        beta = _nonnegative_relative_lstsq(x[above], y[above])
        err = float(np.mean(((np.maximum(x @ beta, h) - y) / y) ** 2))
        if err < best_err - 1e-12:
            best, best_err = (*beta, float(h)), err
    return best if best is not None else (*_nonnegative_relative_lstsq(x, y), 0.0)


def fit_error(model: SoloModel, samples: Sequence[Sample]) -> FitError:
    """How well `model` predicts solo samples (use held-out ones for an honest figure)."""
    errs: dict[str, list[float]] = {"prefill": [], "decode": [], "mixed": []}
    for s in samples:
        if s.kind == "prefill":
            errs["prefill"].append(abs(model.prefill_ms(s.prefill, s.sms) - s.ms) / s.ms)
        elif s.kind == "decode":
            errs["decode"].append(abs(model.decode_ms(s.decode, s.sms) - s.ms) / s.ms)
        elif s.kind == "mixed":
            errs["mixed"].append(abs(model.mixed_ms(s.prefill, s.decode, s.sms) - s.ms) / s.ms)
    p, d, m = errs["prefill"] or [0.0], errs["decode"] or [0.0], errs["mixed"] or [0.0]
    return FitError(max(p), float(np.mean(p)), max(d), float(np.mean(d)), max(m), float(np.mean(m)))


def _nonnegative_relative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """argmin_beta sum(((x beta - y) / y)^2) subject to beta >= 0: drop the most negative term and refit until none
    is negative (a small active-set loop; the models have at most four terms)."""
    w = 1.0 / y
    active = list(range(x.shape[1]))
    beta = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active] * w[:, None], np.ones_like(y), rcond=None)
        if (sol >= 0).all():
            beta[:] = 0.0
            beta[active] = sol
            return beta
        active.pop(int(np.argmin(sol)))
    return beta
