"""Strict against lenient JSON Schemas on the default model: 12 extraction schemas that, as most
written by hand, do not say `additionalProperties: false`; greedy, max_tokens 256 (room for each
answer: the longest valid one is under 80 tokens). For each: does the output parse, does it
validate against the schema as written, did it end or run to max_tokens, how many keys the schema
does not name. Results: docs/log/2026-11-28-strict-structured-outputs.md.

    PYTHONPATH=. python3 benchmarks/structured_strict.py [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import time

import jsonschema

from pagedrun.llm import LLM
from pagedrun.sampling_params import SamplingParams

STR, INT, NUM, BOOL = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}


def obj(required=None, **props):
    return {"type": "object", "properties": props, "required": list(required if required is not None else props)}


CASES = [  # (name, schema, the text to extract from)
    ("person", obj(name=STR, age=INT, city=STR), "Maria Lopez, 34, moved to Madrid last spring."),
    ("product", obj(name=STR, price=NUM, currency=STR, in_stock=BOOL),
     "The Acme X200 kettle costs 49.99 euros and is available now."),
    ("event", obj(title=STR, date=STR, location=STR), "PyCon Italia takes place on 2025-05-28 in Florence."),
    ("sentiment", obj(label={"enum": ["positive", "negative", "neutral"]}, confidence=NUM),
     "I absolutely loved the new album, best thing this year."),
    ("address", obj(street=STR, city=STR, postcode=STR, country=STR),
     "Send it to 221B Baker Street, London NW1 6XE, United Kingdom."),
    ("book", obj(title=STR, author=STR, year=INT), "'Dune' was written by Frank Herbert and published in 1965."),
    ("contact", obj(["name"], name=STR, email=STR, phone=STR), "Reach John Carter at john@carter.io or +1 555 0100."),
    ("order", obj(id=STR, items={"type": "array", "items": obj(sku=STR, qty=INT)}),
     "Order A-17: two units of SKU-4 and one of SKU-9."),
    ("company", obj(name=STR, founded=INT, headquarters=obj(city=STR, country=STR)),
     "Nokia was founded in 1865 and is based in Espoo, Finland."),
    ("weather", obj(city=STR, temperature_c=NUM, condition=STR), "It is 18.5 degrees and cloudy in Lyon today."),
    ("point", {"type": "array", "prefixItems": [NUM, NUM]}, "The station sits at latitude 46.2, longitude 6.1."),
    ("movie", obj(title=STR, director=STR, year=INT, genres={"type": "array", "items": STR}),
     "Christopher Nolan directed Inception (2010), a science-fiction thriller."),
]


def named_keys(schema: dict, value) -> int:
    """How many keys or items the output has that the schema does not name (recursively)."""
    if isinstance(value, dict) and isinstance(schema.get("properties"), dict):
        props = schema["properties"]
        return sum(1 for k in value if k not in props) + sum(named_keys(props[k], v) for k, v in value.items()
                                                              if k in props)
    if isinstance(value, list):
        if "prefixItems" in schema:
            return max(0, len(value) - len(schema["prefixItems"]))
        if isinstance(schema.get("items"), dict):
            return sum(named_keys(schema["items"], v) for v in value)
    return 0


def run(strict: bool, max_tokens: int) -> list[dict]:
    llm = LLM(overrides=[f"structured_outputs.disable_additional_properties={'true' if strict else 'false'}",
                         "model.dtype=float32"])
    convs = [[{"role": "system", "content": "Extract the information as JSON."},
              {"role": "user", "content": text}] for _, _, text in CASES]
    sps = [SamplingParams(max_tokens=max_tokens, structured_outputs={"json": schema}) for _, schema, _ in CASES]
    t = time.perf_counter()
    outs = llm.chat(convs, sps, use_tqdm=False)
    wall = time.perf_counter() - t
    rows = []
    for (name, schema, _), o in zip(CASES, outs):
        c = o.outputs[0]
        row = {"case": name, "finish": c.finish_reason, "tokens": len(c.token_ids),
               "incomplete": c.structured_output_incomplete, "parses": False, "valid": False, "extra": None,
               "text": c.text}
        try:
            value = json.loads(c.text)
            row["parses"] = True
            jsonschema.validate(value, schema)
            row["valid"] = True
            row["extra"] = named_keys(schema, value)
        except (json.JSONDecodeError, jsonschema.ValidationError):
            pass
        rows.append(row)
    print(f"{'strict' if strict else 'lenient'}: {sum(r['valid'] for r in rows)}/{len(rows)} valid JSON, "
          f"{sum(r['finish'] == 'length' for r in rows)} cut by max_tokens, {wall:.1f} s")
    for r in rows:
        print(f"  {r['case']:10} {r['finish']:6} {r['tokens']:4} tok  valid={r['valid']!s:5} "
              f"extra={r['extra']}  {r['text'][:90]!r}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    res = {"lenient": run(False, args.max_tokens), "strict": run(True, args.max_tokens)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
