"""benchmarks/ab_bench.py's verdict: the median ratio of the two sides and the greedy tokens
compared run by run (the runs themselves are `pagedrun bench`, tested elsewhere)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import ab_bench  # noqa: E402


def _run(rate: float, outputs: list[list[int]]) -> dict:
    return {"engines": [{"engine": "hf-static", "output_tokens_per_s": 1.0, "outputs": []},
                        {"engine": "pagedrun", "output_tokens_per_s": rate, "outputs": outputs}]}


def test_median_ratio_and_agreeing_tokens():
    outs = [[1, 2, 3], [4, 5]]
    s = ab_bench.summarise([_run(100.0, outs), _run(80.0, outs), _run(90.0, outs)],
                           [_run(120.0, outs), _run(99.0, outs), _run(108.0, outs)])
    assert s["ref_tok_s"] == [100.0, 80.0, 90.0] and s["tree_tok_s"] == [120.0, 99.0, 108.0]
    assert s["median_ratio"] == pytest.approx(108.0 / 90.0)
    assert s["differing"] == [] and s["requests"] == 2


def test_a_differing_request_or_a_missing_one_is_named_by_side_and_run():
    outs = [[1, 2, 3], [4, 5]]
    s = ab_bench.summarise([_run(1.0, outs), _run(1.0, outs[:1])], [_run(1.0, [[1, 2, 3], [4, 6]])])
    assert s["differing"] == ["ref run 2: 1 of 2 requests", "tree run 1: 1 of 2 requests"]


def test_an_unknown_ref_is_one_line(tmp_path):
    with pytest.raises(SystemExit, match="git archive no-such-ref"):
        ab_bench.export("no-such-ref", tmp_path)


def test_a_folder_ref_is_used_as_it_is_without_git(tmp_path, monkeypatch):
    # A lent GPU machine's copy of the tree may carry no history: REF exported beforehand.
    (tmp_path / "old" / "pagedrun").mkdir(parents=True)
    monkeypatch.setattr(ab_bench, "export", lambda ref, into: pytest.fail("git archive called"))
    assert ab_bench.ref_tree(str(tmp_path / "old"), tmp_path / "x") == (tmp_path / "old").resolve()
    monkeypatch.undo()
    with pytest.raises(SystemExit, match="git archive"):  # a folder without pagedrun/ is a git ref
        ab_bench.ref_tree(str(tmp_path), tmp_path / "y")
