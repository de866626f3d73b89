"""Every file a run derives from -o OUT is named by OUT's whole name, so no two outputs share one
(issue 40, item 9: res.json and res.jsonl both wrote res.report.json)."""
from __future__ import annotations

import itertools
from pathlib import Path

from pagedrun.io.file_safety import lock_path, meta_path, report_path

NAMES = ["res.jsonl", "res.json", "res", "res.txt", "res.jsonl.gz", "res.report", ".res", "res.", "a.b.c.jsonl",
         "res.jsonl.report", "outputs.jsonl"]


def test_derived_names_are_distinct_across_outputs_and_kinds():
    owners: dict[Path, tuple[str, str]] = {}
    for name, (kind, derive) in itertools.product(NAMES, [("report", report_path), ("meta", meta_path),
                                                          ("lock", lock_path)]):
        p = derive(Path("/d") / name)
        assert p.parent == Path("/d")
        assert p not in owners, (name, kind, owners.get(p))
        assert p.name not in NAMES  # never another output's own path
        owners[p] = (name, kind)


def test_the_report_is_beside_out_named_by_it():
    assert report_path(Path("/x/outputs.jsonl")) == Path("/x/outputs.jsonl.report.json")
    assert report_path(Path("res.json")) != report_path(Path("res.jsonl"))
