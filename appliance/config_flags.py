"""The config's fields as command-line flags: the typer parameters of `muxd serve` (one per field of every settings
group, a bool field a --name/--no-name switch), commands that take them all, and `parse_serve_args`, the Config that
`muxd serve <args>` would build (for `muxd bench --serve-args` and `--in-process`)."""
from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from typing import Any, Callable, Optional

import typer

from appliance.config import _FIELD_GROUP, GROUPS, Config
from appliance.errors import ConfigError


SEVERAL = ("--served-model-name",)  # serve flags that take several values, as vLLM's nargs="+" ones


def spread(args: list[str]) -> list[str]:
    """`--served-model-name a b` as `--served-model-name a --served-model-name b` (click takes several values of an
    option only as repeats): the words after such a flag, up to the next flag, are all its values."""
    out: list[str] = []
    flag, taken = None, 0
    for arg in args:
        if flag is not None and not arg.startswith("-"):
            out += [flag, arg] if taken else [arg]
            taken += 1
            continue
        flag, taken = (arg if arg in SEVERAL else None), 0
        out.append(arg)
    return out


class ServeCommand(typer.core.TyperCommand):
    """A command taking the serve flags: reads several values after a flag of SEVERAL (see `spread`)."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        return super().parse_args(ctx, spread(args))


def serve_flags(skip: tuple[str, ...] = ()) -> list[inspect.Parameter]:
    """typer parameters of `muxd serve`, one per config field (a bool field is a --name/--no-name switch)."""
    return [param for cls in GROUPS.values() for param in dataclass_flags(cls, skip)]


def dataclass_flags(cls: type, skip: tuple[str, ...] = ()) -> list[inspect.Parameter]:
    """typer parameters of one settings dataclass whose fields were made with `flag` (a bool is a switch)."""
    params = []
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        meta, dash = f.metadata, f.name.replace("_", "-")
        names = (f"--{dash}/--no-{dash}",) if hints[f.name] in (bool, Optional[bool]) else (f"--{dash}",)
        option = typer.Option(f.default, *names, *meta["names"], help=meta["help"], envvar=meta["envvar"],
                              show_envvar=meta["envvar"] is not None, hidden=meta["hidden"])
        params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=option,
                                        annotation=hints[f.name]))
    return params


def with_serve_flags(func: Callable[..., Any], skip: tuple[str, ...] = (),
                     on_error: Callable[[ConfigError], Any] | None = None) -> Callable[..., Any]:
    """`func(config: Config, **rest)` as a typer command taking every serve flag (plus func's own parameters);
    `on_error` receives a flag's ConfigError (the CLI prints it and exits 2)."""
    own = [p for name, p in inspect.signature(func).parameters.items() if name != "config"]
    flags = serve_flags(skip)

    @functools.wraps(func)
    def command(**kw: Any) -> Any:
        fields = {k: kw.pop(k) for k in list(kw) if k in _FIELD_GROUP}
        try:
            config = Config.flat(**fields)
        except ConfigError as exc:
            if on_error is None:
                raise
            return on_error(exc)
        return func(config, **kw)

    params = own + flags
    command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in params}
    del command.__wrapped__  # typer must read the generated signature, not func's
    return command


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def parse_serve_args(args: list[str], **overrides: Any) -> Config:
    """The Config that `muxd serve <args>` would build (for `muxd bench --in-process` and `--serve-args`)."""
    def serve(config: Config) -> Config:
        return config

    app = typer.Typer()
    app.command(cls=ServeCommand)(with_serve_flags(serve))
    command = typer.main.get_command(app)
    try:
        ctx = command.make_context("serve", list(args))
    except Exception as exc:  # a usage error of click (or of the click that typer bundles)
        if not hasattr(exc, "format_message"):
            raise
        raise ConfigError(f"--serve-args: {exc.format_message()}") from None
    return Config.flat(**{**ctx.params, **overrides})
