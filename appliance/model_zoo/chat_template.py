"""Chat templates as transformers renders them: the same sandboxed jinja environment (trim_blocks, lstrip_blocks,
loop controls), its `tojson` (no HTML escaping, non-ASCII kept, keys in order), its `{% generation %}` block (rendered
as its body), `raise_exception` and `strftime_now`. And the escaping that keeps control tokens written inside messages
from becoming control tokens: `escape_strings` swaps each for a placeholder the template cannot alter, so that after
rendering every control token left in the text is the template's own.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from appliance.errors import ConfigError, RequestError


def _raise(message: str) -> None:
    raise RequestError(f"chat template: {message}", "messages")


def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
           sort_keys: bool = False) -> str:
    """transformers' filter: jinja's own escapes <, >, & and ' for HTML and sorts keys, which changes prompts."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}` marks the assistant's part for training masks; rendering keeps the
    body as it is (transformers' AssistantTracker without the tracking)."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def compile_chat_template(source: str, where: str = "chat template") -> jinja2.Template:
    """Compile a chat template in the environment HF templates expect; a syntax error is a ConfigError naming
    `where` and the line."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError(f"{where}: syntax error on line {exc.lineno}: {exc.message}") from None


@dataclass
class Escaped:
    """Request data (messages, tool definitions) whose control-token text was swapped for placeholders (`marker` +
    index + `marker`)."""

    value: Any
    marker: str
    originals: list[str]

    def restore(self, text: str) -> str:
        """The text with every placeholder turned back into the control-token text it stands for."""
        return re.sub(f"{self.marker}(\\d+){self.marker}", lambda m: self.originals[int(m.group(1))], text)


def escape_strings(value: Any, control: re.Pattern[str]) -> Escaped | None:
    """Swap every match of `control` in the strings of `value` (at any depth) for a placeholder; None when none
    holds one (the common case: nothing to do)."""
    strings: list[str] = []
    _walk(value, strings.append)
    if not any(control.search(s) for s in strings):
        return None
    used = set("".join(strings))
    # a private-use character no string contains, so placeholders cannot be forged either
    marker = next(chr(c) for c in range(0xE000, 0xF900) if chr(c) not in used)
    originals: list[str] = []

    def swap(match: re.Match[str]) -> str:
        originals.append(match.group(0))
        return f"{marker}{len(originals) - 1}{marker}"

    return Escaped(_walk(value, lambda s: control.sub(swap, s)), marker, originals)


def _walk(value: Any, fn: Any) -> Any:
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, dict):
        return {k: _walk(v, fn) for k, v in value.items()}
    if isinstance(value, list):
        return [_walk(v, fn) for v in value]
    return value
