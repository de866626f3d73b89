"""The `structured_outputs` sampling field: its shape, checked without the grammar engine.

vLLM's names (StructuredOutputsParams): exactly one of
    {"json": <JSON Schema object, or its text>}   {"regex": "..."}   {"choice": ["a", "b", ...]}
    {"grammar": "<Lark or GBNF/EBNF grammar>"}     {"json_object": true}
plus, optionally, vLLM's `"disable_any_whitespace": true` (JSON without free whitespace between
tokens: the layout is fixed, so a model cannot wander in spaces and newlines) and
`"disable_additional_properties": false` (a JSON Schema read by its own rules, extra properties
allowed where it does not forbid them: structured/strict.py; default: the recipe's
`structured_outputs.disable_additional_properties`, true).

The value is kept as a plain dict in SamplingParams so that recipes, JSONL lines and --set all
round-trip it; the grammar engine turns it into a grammar later (structured/engine.py).
"""
from __future__ import annotations

import json
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object")
OPTIONS = ("disable_any_whitespace", "disable_additional_properties")
MAX_CHOICES = 10_000
MAX_SPEC_CHARS = 1_000_000  # a schema or grammar larger than this is a mistake, not a constraint


class SpecError(ValueError):
    """str() is the "must be ..." part of the message, as sampling_params' InvalidValue."""


def check_structured_outputs(v: Any) -> dict | None:
    """The normalised constraint (None: unconstrained) or SpecError("must be ...")."""
    if v is None:
        return None
    if not isinstance(v, dict):
        raise SpecError(f"must be an object with one of {_kinds()}")
    unknown = [k for k in v if k not in KINDS and k not in OPTIONS]
    if unknown:
        raise SpecError(f"has an unknown key {json.dumps(str(unknown[0]))[:60]}; must have exactly one of {_kinds()}")
    given = [k for k in KINDS if k in v]
    if len(given) != 1:
        raise SpecError(f"must have exactly one of {_kinds()}" + (f" (has {', '.join(given)})" if given else ""))
    kind = given[0]
    out: dict[str, Any] = {kind: _CHECKS[kind](v[kind])}
    for option in OPTIONS:
        if option in v:
            if not isinstance(v[option], bool):
                raise SpecError(f"{option} must be true or false")
            out[option] = v[option]
    return out


def kind_of(spec: dict) -> str:
    return next(k for k in KINDS if k in spec)


def _kinds() -> str:
    return ", ".join(KINDS)


def _json(v: Any) -> dict:
    if isinstance(v, str):  # vLLM accepts the schema as text too
        if len(v) > MAX_SPEC_CHARS:
            raise SpecError(f"json must be a schema of at most {MAX_SPEC_CHARS:,} characters")
        try:
            v = json.loads(v)
        except (json.JSONDecodeError, RecursionError):
            raise SpecError("json must be a JSON Schema object (the string given is not valid JSON)") from None
    if not isinstance(v, dict):
        raise SpecError("json must be a JSON Schema object")
    return v


def _text(kind: str):
    def check(v: Any) -> str:
        if not isinstance(v, str) or not v:
            raise SpecError(f"{kind} must be a non-empty string")
        if len(v) > MAX_SPEC_CHARS:
            raise SpecError(f"{kind} must be at most {MAX_SPEC_CHARS:,} characters")
        return v
    return check


def _choice(v: Any) -> list[str]:
    if not isinstance(v, list) or not v or not all(isinstance(s, str) and s for s in v):
        raise SpecError("choice must be a non-empty list of non-empty strings")
    if len(v) > MAX_CHOICES:
        raise SpecError(f"choice must hold at most {MAX_CHOICES} strings")
    return list(v)


def _json_object(v: Any) -> bool:
    if v is not True:
        raise SpecError("json_object must be true")
    return True


_CHECKS = {"json": _json, "regex": _text("regex"), "choice": _choice, "grammar": _text("grammar"),
           "json_object": _json_object}
