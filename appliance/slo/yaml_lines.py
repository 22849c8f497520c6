"""YAML to plain Python values with the line of every key and value, so schema errors can name where they are.

Parses with pyyaml's safe composer (no tags beyond plain data), keeps each node's start mark, and reports
duplicate keys, which pyyaml's own loader would silently overwrite.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import yaml

Path = tuple[Any, ...]


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


def load_located(text: str) -> LocatedYaml:
    """Parse one YAML document; raises YamlSyntaxError (with a 1-based line) when it is not valid YAML."""
    try:
        loader = yaml.SafeLoader(text)
    except yaml.reader.ReaderError as exc:  # the reader refuses control characters before any parsing
        line = text[:exc.position].count("\n") + 1
        raise YamlSyntaxError(f"character U+{exc.character:04X} is not allowed in YAML", line) from None
    try:
        node = loader.get_single_node()
        out = LocatedYaml(None)
        if node is not None:
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
