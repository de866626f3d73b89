"""Reading a recipe's YAML: a safe loader, duplicate keys refused, and the line of every key.

YAML 1.2 floats (`1e-5` is a float, not a string). A recipe is a few levels deep and never needs
an alias: aliases (`*name`, the "billion laughs" bomb) are refused and nesting is bounded at
MAX_DEPTH, so a hostile file costs no memory and no recursion. Errors are one line naming the file
and line:
    recipe.yaml:4: cache: duplicate key (first on line 2)
    recipe.yaml:3:7: invalid YAML: mapping values are not allowed here
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from pagedrun.errors import PagedrunError
from pagedrun.io.input_files import read_input

MAX_DEPTH = 16  # the deepest recipe value is a list in a section (sampling.stop): 3
# The default recipe, comments and all, is 4 KB; PyYAML is slow per byte
# (docs/log/2026-11-27-figures-from-code-comments.md).
MAX_BYTES = 1 << 20


class Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 floats (`1e-5` is a float, not a string), duplicate-key errors, no
    aliases and at most MAX_DEPTH levels of nesting."""

    _depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        # The composer recurses once per level and expands every alias: both are stopped here,
        # before any node is built, so the error comes after reading at most MAX_DEPTH levels.
        if self.check_event(yaml.AliasEvent):
            raise yaml.composer.ComposerError(
                None, None, "aliases (*name) are not allowed in a recipe; write the value out",
                self.peek_event().start_mark)
        if self._depth >= MAX_DEPTH:
            raise yaml.composer.ComposerError(
                None, None, f"nested more than {MAX_DEPTH} levels deep", self.peek_event().start_mark)
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

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


    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        try:
            return super().construct_yaml_int(node)
        except ValueError:  # more digits than Python converts (4300)
            raise yaml.constructor.ConstructorError(
                None, None, f"an integer of {len(node.value):,} digits is too long", node.start_mark) from None


Loader.add_constructor("tag:yaml.org,2002:int", Loader.construct_yaml_int)


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
    data = read_input(path, "recipe", MAX_BYTES)
    if len(data) > MAX_BYTES:
        raise PagedrunError(f"{name}: larger than {MAX_BYTES:,} bytes; not a recipe")
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
