"""The config's fields as command-line flags: the typer parameters of `muxd serve` (one per field of every settings
group, a bool field a --name/--no-name switch), commands that take them all (`ServeCommand` also reads vLLM's
command-line forms: `--config FILE`, several values after `--served-model-name`, `32K` integers), and
`parse_serve_args`, the Config that `muxd serve <args>` would build (for `muxd bench --serve-args` and
`--in-process`)."""
from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import re
import typing
from pathlib import Path
from typing import Any, Callable, Optional

import typer
import yaml

from appliance.config import _FIELD_GROUP, GROUPS, Config
from appliance.errors import ConfigError


# serve flags that take several values, as vLLM's nargs="+" ones
SEVERAL = ("--served-model-name", "--cudagraph-capture-sizes", "--cuda-graph-sizes", "--lora-modules",
           "--logits-processors", "--allowed-media-domains", "--ignore-patterns", "--collect-detailed-traces")


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


HUMAN_INTS = ("--max-model-len", "--max-num-batched-tokens")  # vLLM's human-readable integers: 1k, 32K, 25.6k


def human_ints(args: list[str]) -> list[str]:
    """The values of HUMAN_INTS flags written as vLLM allows, as plain integers: k, m, g, t are powers of 1000 (25.6k
    is 25600), K, M, G, T of 1024 and take whole numbers only (32K is 32768)."""
    out, flag = [], None
    for arg in args:
        name, eq, value = arg.partition("=")
        if flag is not None:
            out.append(_human_int(arg, flag))
        elif eq and name in HUMAN_INTS:
            out.append(f"{name}={_human_int(value, name)}")
        else:
            out.append(arg)
        flag = arg if arg in HUMAN_INTS else None
    return out


def _human_int(text: str, flag: str) -> str:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT])", text)
    if match is None:
        return text  # a plain integer, or what click refuses naming the flag
    number, suffix = match.groups()
    power = "kmgt".index(suffix.lower()) + 1
    if suffix.isupper() and "." in number:
        raise typer.BadParameter(f"{text}: a binary suffix ({suffix}) takes a whole number (e.g. 32{suffix})",
                                 param_hint=f"'{flag}'")
    value = float(number) * 1000 ** power if suffix.islower() else int(number) * 1024 ** power
    if value != int(value):
        raise typer.BadParameter(f"{text} is not a whole number of tokens", param_hint=f"'{flag}'")
    return str(int(value))


def with_config_file(command: Any, args: list[str]) -> list[str]:
    """vLLM's `--config FILE`: a YAML mapping of long flag names (dashes or underscores) to values, read as those
    flags placed before the command line, which wins where both set one (and its MODEL over the file's `model`)."""
    where = [i for i, a in enumerate(args) if a == "--config" or a.startswith("--config=")]
    if not where:
        return args

    def bad(message: str) -> typer.BadParameter:
        return typer.BadParameter(message, param_hint="'--config'")
    if len(where) > 1:
        raise bad("given twice; give one file")
    i = where[0]
    if args[i] == "--config":
        if i + 1 >= len(args):
            raise bad("needs a file")
        path, rest = args[i + 1], args[:i] + args[i + 2:]
    else:
        path, rest = args[i].split("=", 1)[1], args[:i] + args[i + 1:]
    try:
        values = yaml.safe_load(Path(path).expanduser().read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise bad(f"{path}: {exc}") from None
    if not isinstance(values, dict):
        raise bad(f"{path}: the file must be a YAML mapping of flag names to values")
    options = {name: p for p in command.params if p.param_type_name == "option" for name in p.opts + p.secondary_opts}
    given, positional, skip = set(), False, False
    for arg in rest:  # what the command line sets itself
        if skip:
            skip = False
        elif arg.startswith("-"):
            option = options.get(arg.split("=", 1)[0])
            given.add(option)
            skip = option is not None and not option.is_flag and "=" not in arg
        else:
            positional = True
    out: list[str] = []
    for key, value in values.items():
        flag = "--" + str(key).replace("_", "-")
        option = options.get(flag)
        if option is None:
            raise bad(f"{path}: {key!r} is not a flag of `muxd serve` (see --help)")
        if option in given or value is None or (flag == "--model" and positional):
            continue
        if option.is_flag:
            out += [flag] if value is True else option.secondary_opts[:1] if value is False else [f"{flag}={value}"]
        elif isinstance(value, list) and option.multiple:
            out += [token for item in value for token in (flag, str(item))]
        else:
            out += [flag, json.dumps(value) if isinstance(value, (list, dict)) else str(value)]
    return out + rest


class ServeCommand(typer.core.TyperCommand):
    """A command taking the serve flags: reads vLLM's `--config FILE`, several values after a flag of SEVERAL (see
    `spread`) and human-readable integers (see `human_ints`)."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        return super().parse_args(ctx, human_ints(spread(with_config_file(self, args))))


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
