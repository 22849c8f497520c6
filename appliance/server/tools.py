"""Tool calling: the `tools` and `tool_choice` of a chat request, the grammar that forces a call ("required" or a
named function), and the parsers that read calls from a model's own format when it chooses ("auto"): Hermes-style
`<tool_call>{...}</tool_call>` blocks (Qwen 2.5 and 3), Llama 3.x JSON (`{"name": ..., "parameters": ...}`, after
an optional `<|python_tag|>`) and pythonic lists of calls (`[get_weather(city="Oslo"), get_time()]`, Llama 3.2 with a
pythonic template and Llama 4, between optional `<|python_start|>` and `<|python_end|>`), as vLLM's parsers of those
names read them.
"""
from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema

from appliance.engine.grammar import GrammarSpec

_NAME = r"^[A-Za-z0-9_.-]{1,64}$"
FunctionName = Annotated[str, Field(pattern=_NAME)]


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function"]
    function: FunctionDef

    @property
    def parameters(self) -> dict[str, Any]:
        return self.function.parameters or {"type": "object", "properties": {}}


ToolsRequest = list[Tool]


@dataclass(frozen=True)
class ToolChoiceValue:
    mode: str  # none, auto, required, named
    name: str | None = None

    @property
    def constrains(self) -> bool:
        """The output is forced to be a call (a grammar constrains it)."""
        return self.mode in ("required", "named")

    def describe(self) -> str:
        return repr(self.name) if self.mode == "named" else repr(self.mode)

    def grammar(self, tools: list[Tool], parallel: bool = True) -> GrammarSpec:
        """A grammar forcing the call: the named function's arguments, or a list of calls (one at most without
        parallel tool calls)."""
        if self.mode == "named":
            tool = next(t for t in tools if t.function.name == self.name)
            return GrammarSpec("json_schema", json.dumps(tool.parameters), "tool_choice")
        calls = [{"type": "object", "properties": {"name": {"const": t.function.name}, "parameters": t.parameters},
                  "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
        array = {"type": "array", "minItems": 1, "items": {"anyOf": calls}, **({} if parallel else {"maxItems": 1})}
        return GrammarSpec("json_schema", json.dumps(array), "tool_choice")


def _tool_choice(value: Any) -> ToolChoiceValue:
    if isinstance(value, ToolChoiceValue):
        return value
    if value in ("none", "auto", "required"):
        return ToolChoiceValue(value)
    function = value.get("function") if isinstance(value, dict) else None
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(function, dict) \
            and set(function) == {"name"} and isinstance(function["name"], str) and set(value) == {"type", "function"}:
        return ToolChoiceValue("named", function["name"])
    raise ValueError('must be "none", "auto", "required" or {"type": "function", "function": {"name": NAME}}')


_CHOICE_SCHEMA = {"anyOf": [{"type": "string", "enum": ["none", "auto", "required"]}, {
    "type": "object", "required": ["type", "function"], "additionalProperties": False, "properties": {
        "type": {"type": "string", "enum": ["function"]},
        "function": {"type": "object", "required": ["name"], "additionalProperties": False,
                     "properties": {"name": {"type": "string", "pattern": _NAME}}}}}]}
ToolChoice = Annotated[ToolChoiceValue, BeforeValidator(_tool_choice), WithJsonSchema(_CHOICE_SCHEMA)]


# ---- reading calls from the output --------------------------------------------------------------------------------
@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = ""

    @staticmethod
    def new(name: str, arguments: Any) -> "ToolCall":
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        return ToolCall(name, text, f"call_{uuid.uuid4().hex[:24]}")


_PY_START, _PY_END = "<|python_start|>", "<|python_end|>"  # around Llama 4's pythonic calls


def detect_parser(template: str | None, configured: str = "auto") -> str:
    """The format the model writes calls in: --tool-call-parser, or guessed from its chat template."""
    if configured != "auto":
        return configured
    if template and "<tool_call>" in template:
        return "hermes"
    if template and (_PY_START in template or "[func_name1(" in template):  # (vLLM's pythonic templates' example)
        return "pythonic"
    if template and ("<|python_tag|>" in template or "ipython" in template):
        return "llama3_json"
    return "none"


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def parse_calls(text: str, parser: str) -> tuple[str | None, list[ToolCall]]:
    """(content left, calls) of a whole output; text that does not parse as calls stays content."""
    if parser == "hermes" and "<tool_call>" in text:
        calls = [_call(json.loads(m)) for m in _HERMES.findall(text) if _is_call(m)]
        if calls:
            content = text[:text.index("<tool_call>")].strip()
            return content or None, calls
    if parser == "pythonic":
        calls = _pythonic(text)
        if calls is not None:
            return None, calls
    if parser == "llama3_json":
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if body.startswith("{"):
            parts = [p for p in re.split(r"\s*;\s*(?=\{)", body)]
            if all(_is_call(p) for p in parts):
                return None, [_call(json.loads(p)) for p in parts]
    return text, []


def forced_calls(text: str, choice: ToolChoiceValue) -> list[ToolCall]:
    """The calls of an output a grammar forced (tool_choice "required" or named); an output cut short (max_tokens)
    keeps the calls whose name it wrote, the last one's arguments cut where the output ends (as OpenAI's)."""
    if choice.mode == "named":
        return [ToolCall.new(choice.name, text.strip())]
    forced = ForcedCalls()
    forced.feed(text)
    return forced.calls()


class ForcedCalls:
    """The output of tool_choice "required" (the JSON list its grammar forces, [{"name": ..., "parameters": {...}},
    ...]) read as it streams: `feed` it text deltas and get, per call, its id and name once the name is written, then
    its arguments' text as it arrives; `calls()` are the calls written so far, the last one's arguments perhaps cut
    short (max_tokens). `keys`: the names a call object gives its arguments (CallStream reads the models' own
    formats, which say "arguments" or "parameters"); text between call objects that holds no JSON punctuation (a
    model's <tool_call> tags, Llama's ';') is skipped."""

    def __init__(self, keys: tuple[str, ...] = ("parameters",)) -> None:
        self.keys = keys
        self.text = ""
        self._at = 0  # characters scanned
        self._depth, self._in_string, self._escape, self._string_at = 0, False, False, 0
        self._key: str | None = None
        self._value = False  # after the key's colon, in the call object
        self._names: list[str | None] = []
        self._spans: list[list[int | None]] = []  # per call: where its parameters begin and end in the text
        self._ids: list[str] = []
        self._shown: list[int] = []  # per announced call: characters of its arguments handed out

    def feed(self, delta: str) -> list[tuple[int, str | None, str | None, str]]:
        """(call index, id and name when first announced else None, arguments text new since the last feed)."""
        self.text += delta
        for i in range(self._at, len(self.text)):
            self._scan(i, self.text[i])
        self._at = len(self.text)
        out = []
        for k, name in enumerate(self._names):
            if name is None:
                continue
            args = self._arguments(k)
            if k == len(self._ids):
                self._ids.append(f"call_{uuid.uuid4().hex[:24]}")
                self._shown.append(len(args))
                out.append((k, self._ids[k], name, args))
            elif len(args) > self._shown[k]:
                out.append((k, None, None, args[self._shown[k]:]))
                self._shown[k] = len(args)
        return out

    @property
    def announced(self) -> int:
        """Calls `feed` has announced so far."""
        return len(self._ids)

    @property
    def complete(self) -> bool:
        """The list is closed (the output is the whole JSON)."""
        return self._depth == 0 and bool(self._names)

    def calls(self) -> list[ToolCall]:
        self.feed("")
        return [ToolCall(name, self._arguments(k), self._ids[k]) for k, name in enumerate(self._names)
                if name is not None]

    def _arguments(self, k: int) -> str:
        start, end = self._spans[k]
        if start is not None and self.text[start] == '"':  # arguments given as a JSON string: whole, once closed
            return "" if end is None else json.loads(self.text[start:end])
        return "" if start is None else self.text[start:end]

    def _scan(self, i: int, c: str) -> None:
        if self._in_string:
            if self._escape:
                self._escape = False
            elif c == "\\":
                self._escape = True
            elif c == '"':
                self._in_string = False
                if self._depth == 2:  # a key or a value of the call object
                    text = json.loads(self.text[self._string_at:i + 1])
                    if not self._value:
                        self._key = text
                    elif self._key == "name":
                        self._names[-1] = text
                    elif self._key in self.keys and self._spans[-1][0] == self._string_at:
                        self._spans[-1][1] = i + 1  # arguments given as a string end with it
            return
        opens_parameters = self._depth == 2 and self._value and self._key in self.keys and not c.isspace() \
            and self._spans and self._spans[-1][0] is None
        if opens_parameters:
            self._spans[-1][0] = i
        if c == '"':
            self._in_string, self._string_at = True, i
        elif c in "[{":
            self._depth += 1
            if self._depth == 2:  # a call begins
                self._names.append(None)
                self._spans.append([None, None])
                self._key, self._value = None, False
        elif c in "]}":
            self._depth -= 1
            if self._depth == 2 and self._spans[-1][0] is not None and self._spans[-1][1] is None:
                self._spans[-1][1] = i + 1
        elif self._depth == 2 and c == ":":
            self._value = True
        elif self._depth == 2 and c == ",":
            self._key, self._value = None, False


def _pythonic(text: str) -> list[ToolCall] | None:
    """The calls of an output that is one Python list of calls with keyword arguments of literal values, else None
    (the text stays content)."""
    body = text.strip().removeprefix(_PY_START).removesuffix(_PY_END).strip()
    if not (body.startswith("[") and body.endswith("]")):
        return None
    try:
        tree = ast.parse(body, mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for node in tree.elts:
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args
                    and all(k.arg is not None for k in node.keywords)):
                return None
            calls.append(ToolCall.new(node.func.id, {k.arg: ast.literal_eval(k.value) for k in node.keywords}))
        return calls
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
        return None


def _is_call(text: str) -> bool:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    return isinstance(value, dict) and isinstance(value.get("name"), str) and isinstance(
        value.get("arguments", value.get("parameters", {})), (dict, str))


def _call(value: dict[str, Any]) -> ToolCall:
    return ToolCall.new(value["name"], value.get("arguments", value.get("parameters", {})))


class CallStream:
    """Streams content while the output may be plain text and holds back what may be a call, for one choice: feed
    it text deltas; once the calls begin, `call_deltas()` streams each call as "required" does (its id and name once
    written, then its arguments' text as it arrives, as vLLM's tool parsers stream them); `finish()` gives the calls
    of the whole output (parse_calls), which decide whether it called at all."""

    def __init__(self, parser: str) -> None:
        self.parser = parser
        self.text = ""
        self.sent = 0
        self.calling = False
        self._section = 0  # where the calls begin in the text (the first <tool_call>, or Llama's first '{')
        self._scanner = ForcedCalls(keys=("arguments", "parameters"))  # reads "[" + the text from there

    def feed(self, delta: str) -> str:
        """The content that may be shown now."""
        self.text += delta
        if self.calling or self.parser == "none":
            return self._release(len(self.text)) if self.parser == "none" else ""
        if self.parser == "pythonic":  # the calls are the whole output: held from its first "[", sent at its end
            lead = self.text.lstrip()
            if not lead or _PY_START.startswith(lead):  # (the start marker may be arriving)
                return ""
            head = lead.removeprefix(_PY_START).lstrip()
            if head.startswith("["):
                self.calling = True
            if head.startswith("[") or (not head and lead.startswith(_PY_START)):
                return ""
            return self._release(len(self.text))
        if self.parser == "llama3_json":
            lead = self.text.lstrip()
            if lead and "<|python_tag|>".startswith(lead):  # the tag may be arriving
                return ""
            head = lead.removeprefix("<|python_tag|>").lstrip()
            if head.startswith("{") or (not head and self.text.strip() == ""):
                self.calling = bool(head)
                self._section = self.text.find("{")
                return ""
            return self._release(len(self.text))
        at = self.text.find("<tool_call>", self.sent)
        if at >= 0:
            self.calling, self._section = True, at
            return self._release(at)
        return self._release(len(self.text) - partial_suffix(self.text, "<tool_call>"))

    def call_deltas(self) -> list[tuple[int, str | None, str | None, str]]:
        """The calls' news since the last call, as ForcedCalls.feed gives them: (call index, id and name when first
        announced else None, arguments text new since)."""
        if not self.calling or self.parser == "pythonic":  # (pythonic calls are read whole, at the end)
            return []
        return self._scanner.feed(("[" + self.text[self._section:])[len(self._scanner.text):])

    @property
    def announced(self) -> int:
        """Calls `call_deltas` has announced so far."""
        return self._scanner.announced

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content not shown yet, calls) at the end of the output."""
        content, calls = parse_calls(self.text, self.parser)
        if calls:
            return (content or "")[self.sent:] if content and len(content) > self.sent else "", calls
        return self._release(len(self.text)), []

    def _release(self, end: int) -> str:
        out = self.text[self.sent:end]
        self.sent = max(self.sent, end)
        return out


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker` (held back: the marker may be arriving)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
