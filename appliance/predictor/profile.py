"""The profile file: a versioned JSON naming the model (by shape), the GPU and the muxd version, holding the fitted
solo-run coefficients per partition and the contention guard's cells. `build_profile` fits one from samples
(`muxd profile` measures them on the GPU; tests draw them from a known function); `load_predictor` turns a file
into a Predictor, falling back to the roofline prior with a warning when the file is missing or does not match.
"""
from __future__ import annotations

import datetime
import json
import logging
from pathlib import Path
from typing import Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from appliance import __version__
from appliance.errors import ConfigError
from appliance.model_zoo.config import ModelConfig
from appliance.predictor.contention import ContentionGuard
from appliance.predictor.decode_plan import DecodePlan
from appliance.predictor.gemm_table import GemmTable
from appliance.predictor.host import HostModel
from appliance.predictor.predictor import Predictor
from appliance.predictor.prefill_plan import PrefillPlan
from appliance.predictor.roofline import DEVICES, DeviceSpec, RooflineModel, device_spec
from appliance.predictor.shapes import LatencyModel, Sample
from appliance.predictor.solo import MeasuredRange, SoloModel, fit_error, fit_solo
from appliance.predictor.split import FACTOR_RANGE, SLOPE_RANGE, SplitSlowdown, all_sms

log = logging.getLogger("muxd.predictor")
FORMAT, VERSION = "muxd-profile", 1
SERVING_RANGE = FACTOR_RANGE  # serving time / profiled time a profile may keep
FLOOR_RANGE = (0.0, 1000.0)   # a mixed step's floor while serving, in ms


def serving_range(phase: str) -> tuple[float, float]:
    """What a profile's serving block may hold for `phase`: a slope per 1k tokens of span, a floor in ms, or a
    factor."""
    return SLOPE_RANGE if phase.endswith("_per_1k") else FLOOR_RANGE if phase == "mixed_floor" else SERVING_RANGE


def keepable(factors: dict[str, float]) -> tuple[dict[str, float], list[str]]:
    """Serving factors fitted from replays, split into those a profile may keep and, for the others, why not (a
    factor outside `serving_range` means the profile does not describe the engine that served)."""
    kept, dropped = {}, []
    for phase, factor in factors.items():
        lo, hi = serving_range(phase)
        if lo <= factor <= hi:
            kept[phase] = factor
        else:
            dropped.append(f"{phase} came out {factor:.3g} while serving; not kept (outside {lo:g}..{hi:g}: the "
                           "profile does not describe this engine)")
    return kept, dropped


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelInfo(_Model):
    name: str
    shape: dict[str, int]


class GpuInfo(_Model):
    name: str
    sm_count: int = Field(gt=0)


class CellEntry(_Model):
    cell: tuple[int, int, int, int, int]  # decode SMs, prefill new bin, prefill reused bin, batch bin, reused bin
    slowdown: float = Field(ge=1.0)


class ProfileFile(_Model):
    format: Literal["muxd-profile"] = FORMAT
    version: int = VERSION
    muxd_version: str = __version__
    created: str = ""
    model: ModelInfo
    gpu: GpuInfo
    tensor_parallel_size: int = Field(default=1, ge=1)  # ranks the model was split across (each on its own GPU)
    decode_partitions: list[int]
    # SM count -> a, b, c, d[, host floor h[, q: per GEMM ms of the table[, w: per unit of the attention plan's
    # critical path]]]
    prefill: dict[str, list[float]]
    decode: dict[str, list[float]]    # SM count -> e, f, g[, k: per token on the kernel's critical path]
    mixed: list[float] | None = None  # a', b', c', e', d', h' of a mixed step on all SMs (None: not measured)
    # what the decode attention kernel's plan depended on (decode_plan.py); None: k is not fitted
    decode_plan: dict[str, int | str | list[int]] | None = None
    # one layer's GEMM time per prefill partition at the row buckets prefill launches are padded to (gemm_table.py);
    # None: no padding, q is not fitted
    gemm: dict[str, int | list[int] | dict[str, list[float]]] | None = None
    # what the prefill attention kernel's plan depended on (prefill_plan.py); None: w is not fitted
    prefill_plan: dict[str, int] | None = None
    contention_default: float = Field(ge=1.0)
    contention: list[CellEntry] = []
    fit: dict[str, float] = {}        # relative errors of the fit on its samples
    # measured in a calibration replay: decode and prefill (mixed steps), serving / profiled time, which only the
    # simulator's clock applies (the host's and the GPU clock's share of serving); prefill_full, prefill on all SMs
    # (mux's temporal steps, after decode; else a whole prompt alone, from serial's time to first token) and
    # prefill_split (+ prefill_split_per_1k per 1,000 tokens of attention span), layer-wise prefill on a partition
    # beside decode over its solo time: the clock applies them and the predictor plans with them, refining both
    # online (split.py); mixed_floor (ms) replaces the mixed model's floor h' (calibrate.mixed_floor says why)
    serving: dict[Literal["decode", "prefill", "prefill_full", "prefill_split", "prefill_split_per_1k",
                          "mixed_floor"], float] = {}
    # the host's share of a step (host.py), fitted from a calibration replay; None: the prior
    # (graph_launch_ms, graph_per_layer_ms: launches replaying piecewise graphs; absent: derived from the eager ones)
    host: dict[Literal["step_ms", "per_row_us", "launch_ms", "per_layer_ms", "graph_launch_ms",
                       "graph_per_layer_ms"], float] | None = None
    # the longest prompt measured: its new tokens, its new + reused tokens; past it the predictor
    # scales the edge's time as the roofline prior does (solo.py); None: the fit extrapolates on its own
    measured: dict[Literal["prefill_new", "prefill_kv"], int] | None = None

    @field_validator("measured")
    @classmethod
    def _measured_range(cls, measured: dict[str, int] | None) -> dict[str, int] | None:
        if measured is not None:
            if set(measured) != {"prefill_new", "prefill_kv"}:
                raise ValueError("needs prefill_new and prefill_kv")
            if min(measured.values()) < 1:
                raise ValueError(f"token counts must be >= 1, got {measured}")
        return measured

    @field_validator("host")
    @classmethod
    def _host_times(cls, host: dict[str, float] | None) -> dict[str, float] | None:
        if host is not None:
            missing = {"step_ms", "per_row_us", "launch_ms", "per_layer_ms"} - set(host)
            if missing:
                raise ValueError(f"needs {', '.join(sorted(missing))}")
            bad = {k: v for k, v in host.items() if not 0 <= v <= 1000}
            if bad:
                raise ValueError(f"host times must be in 0..1000 (ms, or us per row), got {bad}")
        return host

    @field_validator("serving")
    @classmethod
    def _serving_factors(cls, factors: dict[str, float]) -> dict[str, float]:
        for phase, factor in factors.items():
            lo, hi = serving_range(phase)
            if not lo <= factor <= hi:
                floor = phase == "mixed_floor"
                raise ValueError(f"{phase} {'floor' if floor else 'factor'} {factor} is outside {lo:g}..{hi:g} "
                                 f"({'ms' if floor else 'serving time / profiled time'})")
        return factors

    @field_validator("prefill", "decode")
    @classmethod
    def _coefficient_counts(cls, table: dict[str, list[float]], info) -> dict[str, list[float]]:
        counts = (4, 5, 6, 7) if info.field_name == "prefill" else (3, 4)
        for sms, coefficients in table.items():
            if len(coefficients) not in counts:
                raise ValueError(f"{sms} SMs has {len(coefficients)} coefficients; expected "
                                 f"{' or '.join(map(str, counts))}")
        return table

    @field_validator("decode_plan", "prefill_plan", "gemm")
    @classmethod
    def _kernel_inputs(cls, raw: dict | None, info) -> dict | None:
        """Each kernel block parses into its class (decode_plan.py, prefill_plan.py, gemm_table.py) with positive
        sizes."""
        kind, needs, sizes = {
            "decode_plan": (DecodePlan, "total_sms, kv_heads, page_size (and graph_sizes, kernel)",
                            ("total_sms", "kv_heads", "page_size")),
            "prefill_plan": (PrefillPlan, "total_sms and qo_heads (and tile_q)", ("total_sms", "qo_heads", "tile_q")),
            "gemm": (GemmTable, "rows (ascending bucket sizes) and ms (per SM count, a time per bucket), and "
                     "graph_rows", ()),
        }[info.field_name]
        if raw is not None:
            try:
                parsed = kind.from_dict(raw)
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                raise ValueError(f"needs {needs}: {exc}") from None
            if sizes and min(getattr(parsed, k) for k in sizes) < 1:
                raise ValueError(f"{', '.join(sizes)} must be >= 1, got {raw}")
        return raw

    @model_validator(mode="after")
    def _terms_need_their_tables(self) -> "ProfileFile":
        if self.decode_plan is None and any(len(v) == 4 for v in self.decode.values()):
            raise ValueError("decode has a critical-path coefficient but the profile has no decode_plan")
        gemm = GemmTable.from_dict(self.gemm) if self.gemm is not None else None
        for sms, coefficients in self.prefill.items():
            if len(coefficients) >= 6 and (gemm is None or int(sms) not in gemm.ms):
                raise ValueError(f"prefill on {sms} SMs has a GEMM coefficient but the profile has no GEMM times "
                                 "for that partition")
            if len(coefficients) == 7 and self.prefill_plan is None:
                raise ValueError(f"prefill on {sms} SMs has a critical-path coefficient but the profile has no "
                                 "prefill_plan")
        return self

    @field_validator("mixed")
    @classmethod
    def _mixed_count(cls, coefficients: list[float] | None) -> list[float] | None:
        if coefficients is not None and len(coefficients) != 6:
            raise ValueError(f"{len(coefficients)} coefficients; expected 6")
        return coefficients

    def _mixed(self) -> tuple[float, ...] | None:
        """The mixed model's coefficients, its floor the one measured while serving where there is one."""
        if not self.mixed:
            return None
        return (*self.mixed[:5], self.serving.get("mixed_floor", self.mixed[5]))

    def predictor(self, num_layers: int, source: str, prior: LatencyModel | None = None) -> Predictor:
        """The profile's predictor; `prior` (the roofline model of this model on this GPU) takes over the scaling of
        prefills past the measured range."""
        measured = MeasuredRange.from_dict(self.measured) if self.measured else None
        solo = SoloModel({int(k): tuple(v) for k, v in self.prefill.items()},
                         {int(k): tuple(v) for k, v in self.decode.items()},
                         self._mixed(),
                         DecodePlan.from_dict(self.decode_plan) if self.decode_plan else None,
                         GemmTable.from_dict(self.gemm) if self.gemm else None,
                         PrefillPlan.from_dict(self.prefill_plan) if self.prefill_plan else None,
                         measured, prior)
        guard = ContentionGuard({tuple(c.cell): c.slowdown for c in self.contention}, self.contention_default)
        split = SplitSlowdown(self.serving.get("prefill_split", 1.0), self.serving.get("prefill_split_per_1k", 0.0))
        full = all_sms(self.serving.get("prefill_full", 1.0))
        return Predictor(solo, guard, num_layers, self.gpu.sm_count, tuple(sorted(self.decode_partitions)), source,
                         serving=dict(self.serving), split=split, full=full,
                         host=HostModel.from_dict(self.host) if self.host else HostModel())


def model_shape(cfg: ModelConfig) -> dict[str, int]:
    """What makes two models the same for latency: their shapes (the whole model's), not their names or weights;
    the tensor-parallel degree is recorded beside it."""
    cfg = cfg.unsharded
    return {"num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "num_heads": cfg.num_heads, "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
            "vocab_size": cfg.vocab_size}


def build_profile(samples: Sequence[Sample], *, model_name: str, model: ModelConfig, gpu_name: str, sm_count: int,
                  decode_partitions: Sequence[int], decode_plan: DecodePlan | None = None,
                  gemm: GemmTable | None = None, prefill_plan: PrefillPlan | None = None) -> ProfileFile:
    """Fit the solo-run model per partition and the contention cells from measured samples (`decode_plan`: the
    decode kernel's, when the engine that measured them ran it; `gemm`: the GEMM times at the row buckets the
    engine padded its prefills to; `prefill_plan`: the prefill attention kernel's)."""
    solo = fit_solo(samples, decode_plan, gemm, prefill_plan)
    guard = ContentionGuard(default=1.0)
    for s in samples:
        if s.kind == "contended":
            guard.observe(s.sms, s.prefill, s.decode, solo.decode_ms(s.decode, s.sms), s.ms)
    err = fit_error(solo, samples)
    return ProfileFile(
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        model=ModelInfo(name=model_name, shape=model_shape(model)), gpu=GpuInfo(name=gpu_name, sm_count=sm_count),
        tensor_parallel_size=model.tp_size,
        decode_partitions=sorted(decode_partitions),
        prefill={str(k): list(v) for k, v in solo.prefill.items()},
        decode={str(k): list(v) for k, v in solo.decode.items()},
        mixed=list(solo.mixed) if solo.mixed else None,
        decode_plan=decode_plan.to_dict() if decode_plan else None,
        gemm=gemm.to_dict() if gemm else None,
        prefill_plan=prefill_plan.to_dict() if prefill_plan else None,
        contention_default=max(guard.cells.values(), default=1.0),
        contention=[CellEntry(cell=c, slowdown=v) for c, v in sorted(guard.cells.items())],
        measured=solo.measured.to_dict() if solo.measured else None,
        fit={"prefill_max_rel_error": err.prefill_max, "prefill_mean_rel_error": err.prefill_mean,
             "decode_max_rel_error": err.decode_max, "decode_mean_rel_error": err.decode_mean,
             **({"mixed_max_rel_error": err.mixed_max, "mixed_mean_rel_error": err.mixed_mean} if solo.mixed else {})})


def save_profile(profile: ProfileFile, path: str | Path) -> None:
    Path(path).write_text(profile.model_dump_json(indent=1) + "\n", encoding="utf-8")


def read_profile(path: str | Path) -> ProfileFile:
    """Parse a profile file; ConfigError naming the file and the field when it is not one."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"profile {path}: cannot read it ({exc.strerror or exc})") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"profile {path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise ConfigError(f"profile {path}: not a muxd profile (its 'format' must be {FORMAT!r})")
    if raw.get("version") != VERSION:
        raise ConfigError(f"profile {path}: format version {raw.get('version')!r} is not supported by muxd "
                          f"{__version__} (it reads version {VERSION}); profile the GPU again with `muxd profile`")
    try:
        return ProfileFile.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise ConfigError(f"profile {path}: field {where}: {first['msg']}") from None


def mismatch(profile: ProfileFile, model: ModelConfig, device: DeviceSpec, gpu_name: str) -> str | None:
    """Why the profile does not describe this model on this GPU, or None when it does."""
    shape = model_shape(model)
    if profile.model.shape != shape:
        diff = ", ".join(f"{k} {profile.model.shape.get(k)} != {v}" for k, v in shape.items()
                         if profile.model.shape.get(k) != v)
        return f"it was measured for model {profile.model.name!r} of another shape ({diff})"
    if profile.tensor_parallel_size != model.tp_size:
        return (f"it was measured with --tensor-parallel-size {profile.tensor_parallel_size}, this engine runs "
                f"{model.tp_size}")
    try:
        same_gpu = device_spec(profile.gpu.name).name == device.name
    except ConfigError:
        same_gpu = profile.gpu.name == gpu_name
    if not same_gpu or profile.gpu.sm_count != device.sm_count:
        return f"it was measured on {profile.gpu.name} ({profile.gpu.sm_count} SMs), this is {gpu_name}"
    return None


def load_predictor(path: str | Path | None, model: ModelConfig, gpu_name: str,
                   loaded: ProfileFile | str | None = None) -> Predictor:
    """The predictor for serving `model` on `gpu_name` ('cpu', 'h100' or the CUDA device name): the profile at
    `path` when it matches, else the roofline prior (with a warning saying why). `loaded`: the file already parsed
    (or the text of why it could not be), so that it is read once."""
    try:
        device = device_spec(gpu_name)
        notes = []
    except ConfigError:
        device = DEVICES["h100"]
        notes = [f"no ceilings known for {gpu_name!r}; the prior uses H100 figures"]
    reason = profile = None
    if path is None:
        reason = "no --profile given"
    elif isinstance(loaded, str):
        reason = loaded
    else:
        try:
            profile = loaded if loaded is not None else read_profile(path)
            reason = mismatch(profile, model, device, gpu_name)
        except ConfigError as exc:
            reason = str(exc)
    if reason is None:
        if profile.muxd_version != __version__:
            notes.append(f"profile {path} was written by muxd {profile.muxd_version}; this is {__version__} "
                         "(profile again if step times changed)")
        predictor = profile.predictor(model.num_layers, f"profile {path}", RooflineModel(model, device))
    else:
        predictor = Predictor.prior(model, device)
        notes.append(f"latency predictor: using the roofline prior for {device.name} ({reason})")
    for note in notes:
        log.warning(note)
    predictor.notes.extend(notes)
    return predictor
