"""Structured outputs: decoding constrained by a JSON Schema, a regex, a choice or a grammar.

    params.py   the `structured_outputs` field's shape (no grammar engine needed)
    grammar.py  constraint -> llguidance grammar; one matcher per sequence, kept by the engine
    bitmask.py  one step's masks: filled for the constrained rows in one call, applied in one batch
"""
