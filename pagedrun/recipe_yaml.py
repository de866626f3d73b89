"""Reading a recipe's YAML: a safe loader, duplicate keys refused, and the line of every key.

YAML 1.2 floats (`1e-5` is a float, not a string). Errors are one line naming the file and line:
    recipe.yaml:4: cache: duplicate key (first on line 2)
    recipe.yaml:3:7: invalid YAML: mapping values are not allowed here
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from pagedrun.errors import PagedrunError


class Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 floats (`1e-5` is a float, not a string) and duplicate-key errors."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                if key in seen:
                    raise DuplicateKey(key, key_node.start_mark.line + 1, seen[key])
                seen[key] = key_node.start_mark.line + 1
            except TypeError:  # unhashable key: let SafeLoader report it
                pass
        return super().construct_mapping(node, deep)


class DuplicateKey(Exception):
    def __init__(self, key: Any, line: int, first: int) -> None:
        self.key, self.line, self.first = key, line, first


Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def one_line(text: str) -> str:
    return " ".join(str(text).split())


def key_lines(text: str) -> dict[str, int]:
    """1-based line of every `section` and `section.key` in the file, so errors can point at it."""
    lines: dict[str, int] = {}
    root = yaml.compose(text, Loader=Loader)
    if not isinstance(root, yaml.MappingNode):
        return lines
    for key_node, value_node in root.value:
        section = str(key_node.value)
        lines[section] = key_node.start_mark.line + 1
        if isinstance(value_node, yaml.MappingNode):
            for sub_node, _ in value_node.value:
                lines[f"{section}.{sub_node.value}"] = sub_node.start_mark.line + 1
    return lines


def read_yaml(path: Path) -> tuple[Any, dict[str, int]]:
    """The parsed file and the line of each key in it."""
    name = path.name
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise PagedrunError(f"{name}: recipe file not found ({path})") from None
    except IsADirectoryError:
        raise PagedrunError(f"{name}: is a directory, not a recipe file ({path})") from None
    except OSError as e:
        raise PagedrunError(f"{name}: cannot read recipe file: {e.strerror}") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise PagedrunError(f"{name}:{line}: not valid UTF-8 (byte 0x{data[e.start]:02x})") from None
    try:
        return yaml.load(text, Loader=Loader), key_lines(text)
    except DuplicateKey as e:
        raise PagedrunError(f"{name}:{e.line}: {e.key}: duplicate key (first on line {e.first})") from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        loc = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
        raise PagedrunError(f"{name}{loc}: invalid YAML: {one_line(e.problem or e)}") from None
    except yaml.YAMLError as e:
        raise PagedrunError(f"{name}: invalid YAML: {one_line(e)}") from None
