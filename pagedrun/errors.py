"""The user's errors: PagedrunError, and bounded echoes of the values they quote.

A PagedrunError is an error the user can fix: the CLI prints it on one line, with no traceback.

An error quotes the value it refuses ("got 'fast'"), but the value may be a 20 MB string or a list
nested a thousand deep: the quote is cut at ECHO_CHARS characters (plus "…") and nesting is shown to
a few levels, so an error stays one readable line and costs nothing to build.
"""
from __future__ import annotations

import json
import reprlib
from typing import Any


class PagedrunError(Exception):
    """An error the user can fix; the CLI prints str(err) on one line, no traceback, and exits with
    `exit_code`: 2, "a user error, nothing ran", unless a subclass says otherwise."""

    exit_code = 2


ECHO_CHARS = 80

_repr = reprlib.Repr()
_repr.maxlevel = 3
_repr.maxstring = ECHO_CHARS + 2  # + the quotes
_repr.maxother = ECHO_CHARS
_repr.maxlong = ECHO_CHARS
for _name in ("maxlist", "maxtuple", "maxdict", "maxset", "maxfrozenset", "maxdeque", "maxarray"):
    setattr(_repr, _name, 8)


def clip(text: str, limit: int = ECHO_CHARS) -> str:
    """text, or its first `limit` characters and an ellipsis."""
    return text if len(text) <= limit else text[:limit] + "…"


def echo(value: Any) -> str:
    """repr(value), bounded in length and depth (for values from YAML or Python)."""
    if isinstance(value, str):
        return repr(value[:ECHO_CHARS]) + ("…" if len(value) > ECHO_CHARS else "")
    if isinstance(value, int) and value.bit_length() > 4 * ECHO_CHARS:
        return f"<an integer of {value.bit_length()} bits>"
    try:
        return clip(_repr.repr(value))
    except (RecursionError, ValueError):  # ValueError: an int too long to show, deep in a list
        return f"<{type(value).__name__}>"


def echo_json(value: Any) -> str:
    """value in JSON spelling, bounded in length and depth (for values from a JSONL line)."""
    return clip(_json(value, 3))


def _json(v: Any, depth: int) -> str:
    if isinstance(v, str):
        return json.dumps(v[: ECHO_CHARS + 1], ensure_ascii=False)
    if isinstance(v, list):
        if depth == 0:
            return "[...]" if v else "[]"
        items = [_json(x, depth - 1) for x in v[:8]]
        return "[" + ", ".join(items + (["..."] if len(v) > 8 else [])) + "]"
    if isinstance(v, dict):
        if depth == 0:
            return "{...}" if v else "{}"
        items = [f"{_json(k, 0)}: {_json(x, depth - 1)}" for k, x in list(v.items())[:8]]
        return "{" + ", ".join(items + (["..."] if len(v) > 8 else [])) + "}"
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 4 * ECHO_CHARS:
        return f"<an integer of {v.bit_length()} bits>"
    return json.dumps(v)
