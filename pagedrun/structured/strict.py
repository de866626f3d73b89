"""Strict JSON Schemas, as xgrammar (vLLM's default structured-outputs engine) reads them by default.

JSON Schema lets an object hold properties its schema does not name, and an array with
`prefixItems` hold items past them, unless the schema says otherwise. A small model takes that
freedom: on the default model 4 of 12 schemas ran to max_tokens adding keys, cut-off JSON
(docs/log/2026-11-28-strict-structured-outputs.md). xgrammar's strict mode, on in vLLM, allows none
of them, as does vLLM's `disable_additional_properties` for the guidance engine (pagedrun's).

strict_schema(schema) is the schema with that made explicit, for llguidance to compile:
- an object schema naming `properties` (or `patternProperties`) and saying nothing of
  `additionalProperties` / `unevaluatedProperties` gets `additionalProperties: false`;
- an array schema with `prefixItems` and no `items` / `unevaluatedItems` gets `items: false` (the
  2019 form, `items` as a list without `additionalItems`, gets `additionalItems: false`).
A schema that says what it allows keeps it (`additionalProperties: true` or a schema). Objects
that name no properties (`{"type": "object"}`) and arrays with neither `items` nor `prefixItems`
stay open: any object, any array. Members of an `allOf`, and a schema holding one, are left as
written: each member names only some of the properties, and closing it would refuse the others.
Every subschema is visited ($defs, properties, items, anyOf/oneOf, ...); the input is not changed.

The recipe's `structured_outputs.disable_additional_properties` (default true) and a request's own
`disable_additional_properties` in its `structured_outputs` turn it off (false: JSON Schema's rules).
"""
from __future__ import annotations

from typing import Any

# Keywords whose value is one subschema / a list of them / a map of name -> subschema.
_ONE = ("items", "additionalProperties", "additionalItems", "unevaluatedProperties", "unevaluatedItems",
        "contains", "propertyNames", "not", "if", "then", "else")
_MANY = ("prefixItems", "anyOf", "oneOf", "allOf")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_MAX_DEPTH = 200  # far deeper than any real schema; a deeper one is left as written below it


def strict_schema(schema: Any) -> Any:
    """A copy of `schema` with undeclared properties and items past prefixItems forbidden."""
    return _walk(schema, in_all_of=False, depth=0)


def _walk(s: Any, *, in_all_of: bool, depth: int) -> Any:
    if isinstance(s, list):  # items in the 2019 form
        return [_walk(x, in_all_of=False, depth=depth + 1) for x in s]
    if not isinstance(s, dict) or depth > _MAX_DEPTH:
        return s
    out = dict(s)
    for k in _ONE:
        if k in out:
            out[k] = _walk(out[k], in_all_of=False, depth=depth + 1)
    for k in _MANY:
        if isinstance(out.get(k), list):
            out[k] = [_walk(x, in_all_of=(k == "allOf"), depth=depth + 1) for x in out[k]]
    for k in _MAP:
        if isinstance(out.get(k), dict):
            out[k] = {name: _walk(v, in_all_of=False, depth=depth + 1) for name, v in out[k].items()}
    if in_all_of or "allOf" in out:
        return out
    names_properties = isinstance(out.get("properties"), dict) or isinstance(out.get("patternProperties"), dict)
    if names_properties and "additionalProperties" not in out and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    if "unevaluatedItems" not in out:
        if "prefixItems" in out and "items" not in out:
            out["items"] = False
        elif isinstance(out.get("items"), list) and "additionalItems" not in out:
            out["additionalItems"] = False
    return out
