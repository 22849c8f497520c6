"""The SLO contract: what the appliance promises (TTFT/TBT/TPOT/E2E targets, attainment, request classes, overload
behaviour), read from YAML into pydantic models. Every problem names the field path and the line it is on.

`ClassSLO` is the resolved, plain view of one class that the dispatcher and the simulator use.
"""
from __future__ import annotations

import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from appliance.errors import ContractError, ContractProblem
from appliance.slo.yaml_lines import LocatedYaml, YamlLimitError, YamlSyntaxError, load_located

CLASS_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class _Strict(BaseModel):
    # strict: a quoted "50" is a string, not a number; YAML already gives numbers their type
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class LatencyTarget(_Strict):
    ms: float = Field(gt=0, description="target in milliseconds")
    percentile: float = Field(99.0, gt=0, le=100, description="the percentile the target applies to")


class TTFTTarget(LatencyTarget):
    per_1k_tokens_ms: float = Field(0.0, ge=0, description="added per 1,000 uncached prompt tokens")

    def for_tokens(self, uncached_tokens: int) -> float:
        return self.ms + self.per_1k_tokens_ms * uncached_tokens / 1000.0


class Targets(_Strict):
    ttft: TTFTTarget | None = None
    tbt: LatencyTarget | None = None
    tpot: LatencyTarget | None = None
    e2e: LatencyTarget | None = None


class RequestClass(_Strict):
    priority: int = Field(0, ge=0, description="lower is served first")
    description: str = ""
    targets: Targets = Targets()


class Overload(_Strict):
    mode: Literal["shed", "queue"] = "queue"
    queue_limit: int = Field(1024, ge=1, description="waiting requests beyond which new ones get HTTP 429")
    retry_after_s: float | None = Field(None, gt=0, description="Retry-After of a shed request; default: the "
                                                                "predicted time until the queue drains")


class Contract(_Strict):
    version: Literal[1] = 1
    name: str = Field(min_length=1)
    description: str = ""
    attainment: float = Field(0.99, gt=0, le=1, description="fraction of requests that must meet every target")
    targets: Targets
    classes: dict[str, RequestClass] = Field(default_factory=lambda: {"default": RequestClass()})
    default_class: str | None = None
    overload: Overload = Overload()

    @property
    def default_class_name(self) -> str:
        return self.default_class or next(iter(self.classes))

    def slo_for(self, class_name: str | None = None) -> "ClassSLO":
        """The targets of a class (its own overrides on top of the contract's); None means the default class."""
        name = class_name or self.default_class_name
        cls = self.classes[name]
        t = self.targets

        def pick(field: str):
            return getattr(cls.targets, field) or getattr(t, field)

        ttft, tbt, tpot, e2e = pick("ttft"), pick("tbt"), pick("tpot"), pick("e2e")
        return ClassSLO(name=name, priority=cls.priority, ttft_ms=ttft.ms, ttft_per_1k_ms=ttft.per_1k_tokens_ms,
                        ttft_percentile=ttft.percentile, tbt_ms=tbt.ms, tbt_percentile=tbt.percentile,
                        tpot_ms=tpot.ms if tpot else None, e2e_ms=e2e.ms if e2e else None)

    def class_names(self) -> list[str]:
        return list(self.classes)

    # the bench's SLO interface (appliance.workload.metrics.SLO)
    def targets_for(self, spec: Any) -> dict[str, float]:
        """Per-request targets in ms of the default class; the TTFT target for the whole prompt, as a client
        cannot know what the server's prefix cache held (the simulator judges by the uncached part)."""
        return self.slo_for(None).targets(spec.prompt_len if spec is not None else 0)

    def describe(self) -> str:
        return f"contract {self.name}"


@dataclass(frozen=True)
class ClassSLO:
    """One request class's targets, resolved."""

    name: str
    priority: int
    ttft_ms: float
    ttft_per_1k_ms: float
    ttft_percentile: float
    tbt_ms: float
    tbt_percentile: float
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def ttft_target_ms(self, uncached_tokens: int) -> float:
        return self.ttft_ms + self.ttft_per_1k_ms * uncached_tokens / 1000.0

    def targets(self, uncached_tokens: int) -> dict[str, float]:
        """Per-request targets in ms, in the bench's terms (ttft, tpot, e2el)."""
        out = {"ttft": self.ttft_target_ms(uncached_tokens)}
        if self.tpot_ms is not None:
            out["tpot"] = self.tpot_ms
        if self.e2e_ms is not None:
            out["e2el"] = self.e2e_ms
        return out


# ---- loading ----------------------------------------------------------------------------------------------------
MAX_CONTRACT_BYTES = 64 * 1024  # a contract is a few hundred bytes; the YAML reader is pure Python


def load_contract(path: str | Path) -> Contract:
    """Read and validate a contract file; raises ContractError listing every problem with its line. A file that
    cannot be read as a contract at all (too large, not UTF-8, not YAML, hostile YAML) is one problem and
    `unreadable`."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            data = f.read(MAX_CONTRACT_BYTES + 1)
    except OSError as exc:
        raise _unreadable(str(path), 0, f"cannot read the file: {exc.strerror or exc}") from None
    if len(data) > MAX_CONTRACT_BYTES:
        raise _unreadable(str(path), 0, f"the file is larger than {MAX_CONTRACT_BYTES // 1024} KiB; an SLO contract "
                          "is a few hundred bytes of YAML")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise _unreadable(str(path), line, f"byte 0x{data[exc.start]:02x} at offset {exc.start} is not UTF-8 "
                          "text; save the contract as UTF-8") from None
    return parse_contract(text, str(path))


def _unreadable(source: str, line: int, message: str) -> ContractError:
    return ContractError(source, [ContractProblem("", line, message)], unreadable=True)


def parse_contract(text: str, source: str = "<contract>") -> Contract:
    try:
        doc = load_located(text)
    except YamlSyntaxError as exc:
        refused = "refused" if isinstance(exc, YamlLimitError) else "not valid YAML"
        raise _unreadable(source, exc.line, f"{refused}: {exc}") from None
    problems = [ContractProblem(_dotted(p), line, f"duplicate {_kind(p)} {p[-1]!r} (first defined on line {first})")
                for p, line, first in doc.duplicates]
    if not isinstance(doc.value, dict):
        problems.append(ContractProblem("", doc.line_of(()), "the contract must be a mapping of keys "
                                        f"({', '.join(Contract.model_fields)}), got {type(doc.value).__name__}"))
        raise ContractError(source, problems)
    try:
        contract = Contract.model_validate(doc.value)
    except ValidationError as exc:
        problems += [_problem(err, doc) for err in exc.errors()]
        raise ContractError(source, sorted(problems, key=lambda p: p.line)) from None
    problems += _semantic_problems(contract, doc)
    if problems:
        raise ContractError(source, sorted(problems, key=lambda p: p.line))
    return contract


def _semantic_problems(c: Contract, doc: LocatedYaml) -> list[ContractProblem]:
    """What the schema alone cannot say: required top-level targets, class names, consistency of targets."""
    out: list[ContractProblem] = []

    def add(path: tuple, message: str) -> None:
        out.append(ContractProblem(_dotted(path), doc.line_of(path), message))

    for field in ("ttft", "tbt"):
        if getattr(c.targets, field) is None:
            add(("targets", field), f"required: the contract's {field.upper()} target (e.g. {field}: {{ms: 50}})")
    if not c.classes:
        add(("classes",), "at least one request class is required")
    for name in c.classes:
        if not CLASS_NAME.match(name):
            add(("classes", name), f"class name {name!r} must be 1-64 letters, digits, '_', '.' or '-' "
                                   "(it travels in the X-SLO-Class header)")
    if c.default_class is not None and c.default_class not in c.classes:
        add(("default_class",), f"{c.default_class!r} is not a class of this contract; classes: "
                                f"{', '.join(c.classes) or 'none'}")
    if out:
        return out
    reported = set()
    for name in c.classes:
        slo = c.slo_for(name)
        own = c.classes[name].targets.e2e is not None
        path = ("classes", name, "targets", "e2e", "ms") if own else ("targets", "e2e", "ms")
        if slo.e2e_ms is not None and slo.e2e_ms < slo.ttft_ms and path not in reported:
            reported.add(path)
            add(path, f"E2E target {slo.e2e_ms:g} ms is below the TTFT target {slo.ttft_ms:g} ms of class "
                      f"{name!r}: no request could meet both")
    return out


def _problem(err: dict[str, Any], doc: LocatedYaml) -> ContractProblem:
    loc = tuple(err.get("loc", ()))
    kind = err.get("type", "")
    if kind == "extra_forbidden":
        allowed = _allowed_keys(loc)
        message = f"unknown key {loc[-1]!r}" + (f"; expected one of: {', '.join(allowed)}" if allowed else "")
    elif kind == "missing":
        message = "required field is missing"
    else:
        msg = err.get("msg", "invalid value")
        message = f"{msg[0].lower()}{msg[1:]} (got {err.get('input')!r})"
    return ContractProblem(_dotted(loc), doc.line_of(loc), message)


def _allowed_keys(loc: tuple) -> list[str]:
    """Field names of the model that holds loc[-1], found by walking the schema along loc."""
    current: Any = Contract
    i = 0
    while i < len(loc) - 1:
        if not (isinstance(current, type) and issubclass(current, BaseModel)) or loc[i] not in current.model_fields:
            return []
        ann = _unwrap(current.model_fields[loc[i]].annotation)
        if typing.get_origin(ann) is dict:
            ann = _unwrap(typing.get_args(ann)[1])
            i += 1  # the next element is a mapping key (a class name)
        current = ann
        i += 1
    return list(current.model_fields) if isinstance(current, type) and issubclass(current, BaseModel) else []


def _unwrap(ann: Any) -> Any:
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        return args[0] if len(args) == 1 else ann
    return ann


def _kind(path: tuple) -> str:
    return "class" if len(path) == 2 and path[0] == "classes" else "key"


def _dotted(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def default_contract() -> Contract:
    """The contract `mux` runs under when no --slo file is given: interactive chat, p99 TBT 50 ms."""
    return Contract.model_validate({
        "name": "default", "description": "built in: interactive chat",
        "targets": {"ttft": {"ms": 1000.0, "per_1k_tokens_ms": 150.0}, "tbt": {"ms": 50.0}},
    })
