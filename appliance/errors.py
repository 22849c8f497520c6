"""The one error hierarchy of muxd.

Every error a user can cause derives from ApplianceError; its message names the file, field or value that is wrong
and, where it helps, what would be right.
"""
from __future__ import annotations

from dataclasses import dataclass


class ApplianceError(Exception):
    """Base of every error muxd raises on purpose."""


class ConfigError(ApplianceError):
    """A configuration value (flag, config.json field, YAML key) is missing or invalid."""


class ModelLoadError(ApplianceError):
    """A model directory cannot be loaded: missing file, unsupported architecture, missing or misshapen tensor."""


class RequestError(ApplianceError):
    """A request is invalid (bad sampling parameter, prompt too long, ...). `param` names the offending field;
    `code` is the OpenAI error code when one fits (context_length_exceeded)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class CapacityError(ApplianceError):
    """The engine cannot take more work right now (waiting queue full, or the SLO contract sheds it); the caller
    may retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass(frozen=True)
class ContractProblem:
    """One problem in an SLO contract file: the field path, the 1-based line (0: the whole file), what is wrong."""

    path: str
    line: int
    message: str

    def format(self, source: str) -> str:
        where = f"{source}:{self.line}" if self.line else source
        return f"{where}: {self.path + ': ' if self.path else ''}{self.message}"


class ContractError(ConfigError):
    """An SLO contract file is invalid; `problems` lists every problem found, each with its field path and line.
    `unreadable`: the file could not be read as YAML at all (its one problem says why), so nothing else was checked."""

    def __init__(self, source: str, problems: list[ContractProblem], unreadable: bool = False) -> None:
        self.source, self.problems, self.unreadable = source, problems, unreadable
        lines = "\n".join("  " + p.format(source) for p in problems)
        super().__init__(f"{len(problems)} problem{'s' if len(problems) != 1 else ''} in SLO contract {source}:\n"
                         f"{lines}")


class RankError(ApplianceError):
    """A rank of a tensor-parallel engine exited or stopped answering: the engine cannot run any more."""


class ModelNotFoundError(RequestError):
    """A request names a model this server does not serve (HTTP 404, code model_not_found)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "model")


class UnavailableError(ApplianceError):
    """The server cannot serve a request now (loading, restarting its engine or shutting down); another replica, or a
    later retry, can: after `retry_after` seconds where it is known (None: the default wait of a 503)."""

    def __init__(self, message: str, code: str = "unavailable", retry_after: float | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.retry_after = retry_after
