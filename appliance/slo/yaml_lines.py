"""YAML to plain Python values with the line of every key and value, so schema errors can name where they are.

Parses with pyyaml's safe composer (no tags beyond plain data), keeps each node's start mark, and reports
duplicate keys, which pyyaml's own loader would silently overwrite. Hostile input is refused with a line, before it
costs memory or stack: nesting deeper than MAX_DEPTH, an alias that contains itself, and aliases that would expand
to more than MAX_NODES values (pyyaml itself has no such limits; the composed document shares aliased nodes, so
it stays as small as the text, and only the expansion is bounded here).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import yaml

Path = tuple[Any, ...]
MAX_DEPTH = 64  # a contract nests about five levels
MAX_NODES = 10_000  # values after expanding aliases; a contract has a few dozen


@dataclass
class LocatedYaml:
    """The parsed value, the 1-based line of each path (a mapping's key line for its entries), duplicate keys."""

    value: Any
    lines: dict[Path, int] = field(default_factory=dict)
    duplicates: list[tuple[Path, int, int]] = field(default_factory=list)  # (path, line, first line)

    def line_of(self, path: Path) -> int:
        """The line of the longest known prefix of path (a missing field is reported at its parent)."""
        for end in range(len(path), -1, -1):
            if path[:end] in self.lines:
                return self.lines[path[:end]]
        return 1


class YamlSyntaxError(ValueError):
    def __init__(self, message: str, line: int) -> None:
        super().__init__(message)
        self.line = line


class YamlLimitError(YamlSyntaxError):
    """Valid YAML that is refused as hostile: too deep, recursive, or aliases that expand too far."""


class _BoundedLoader(yaml.SafeLoader):
    """The safe loader whose composer refuses nesting deeper than MAX_DEPTH (pyyaml's composer recurses once per
    level, so 50,000 brackets would otherwise end in a RecursionError)."""

    depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self.depth += 1
        try:
            if self.depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise YamlLimitError(f"nested deeper than {MAX_DEPTH} levels", mark.line + 1)
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1


_BRACKET = re.compile(r"[\[\]{}]")


def _check_flow_depth(text: str) -> None:
    """Refuse flow brackets nested deeper than MAX_DEPTH before pyyaml sees them: its scanner looks ahead up to 1,024
    characters for every open bracket (each could start a key), which costs a second on 50,000 of them. Brackets
    inside quoted strings count too; no contract needs 64 of them unbalanced."""
    depth = 0
    for match in _BRACKET.finditer(text):
        depth += 1 if match.group() in "[{" else -1
        if depth > MAX_DEPTH:
            raise YamlLimitError(f"nested deeper than {MAX_DEPTH} levels", text.count("\n", 0, match.start()) + 1)
        depth = max(depth, 0)


def load_located(text: str) -> LocatedYaml:
    """Parse one YAML document; raises YamlSyntaxError (with a 1-based line) when it is not valid YAML or is
    hostile (too deep, recursive, or an alias bomb)."""
    _check_flow_depth(text)
    try:
        loader = _BoundedLoader(text)
    except yaml.reader.ReaderError as exc:  # the reader refuses control characters before any parsing
        line = text[:exc.position].count("\n") + 1
        raise YamlSyntaxError(f"character U+{exc.character:04X} is not allowed in YAML", line) from None
    try:
        node = loader.get_single_node()
        out = LocatedYaml(None)
        if node is not None:
            _check_expansion(node)
            out.lines[()] = node.start_mark.line + 1
            out.value = _convert(loader, node, (), out)
        return out
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else 1
        raise YamlSyntaxError(f"{exc.problem or exc.context or 'invalid YAML'}", line) from None
    except yaml.YAMLError as exc:
        raise YamlSyntaxError(str(exc), 1) from None
    finally:
        loader.dispose()


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def _check_expansion(root: yaml.Node) -> None:
    """Refuse a node graph (aliases share nodes) that contains a cycle, or whose expansion into plain values would
    hold more than MAX_NODES values or nest deeper than MAX_DEPTH. Iterative, each node visited once."""
    size: dict[int, int] = {}
    depth: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, leaving = stack.pop()
        key = id(node)
        if leaving:
            on_path.discard(key)
            kids = _children(node)
            size[key] = 1 + sum(size[id(k)] for k in kids)
            depth[key] = 1 + max((depth[id(k)] for k in kids), default=0)
            line = node.start_mark.line + 1
            if size[key] > MAX_NODES:
                raise YamlLimitError(f"aliases expand to more than {MAX_NODES} values (an alias bomb?)", line)
            if depth[key] > MAX_DEPTH:
                raise YamlLimitError(f"aliases expand to values nested deeper than {MAX_DEPTH} levels", line)
            continue
        if key in size:
            continue
        if key in on_path:
            raise YamlLimitError("an alias refers to a value that contains it (a recursive structure)",
                                  node.start_mark.line + 1)
        on_path.add(key)
        stack.append((node, True))
        for kid in _children(node):
            if id(kid) in on_path:
                raise YamlLimitError("an alias refers to a value that contains it (a recursive structure)",
                                      kid.start_mark.line + 1)
            if id(kid) not in size:
                stack.append((kid, False))
def _convert(loader: yaml.SafeLoader, node: yaml.Node, path: Path, out: LocatedYaml) -> Any:
    if isinstance(node, yaml.MappingNode):
        loader.flatten_mapping(node)  # resolves `<<` merge keys the way the safe loader does
        result: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            key = _convert(loader, key_node, path, out) if isinstance(key_node, yaml.ScalarNode) else str(key_node)
            sub = path + (key,)
            line = key_node.start_mark.line + 1
            if key in result:
                out.duplicates.append((sub, line, out.lines[sub]))
                continue
            out.lines[sub] = line
            result[key] = _convert(loader, value_node, sub, out)
        return result
    if isinstance(node, yaml.SequenceNode):
        items = []
        for i, item in enumerate(node.value):
            out.lines[path + (i,)] = item.start_mark.line + 1
            items.append(_convert(loader, item, path + (i,), out))
        return items
    return loader.construct_object(node, deep=True)
