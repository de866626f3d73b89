"""The summary, the report and the exit code count the same thing: the records the run wrote, whichever
pass failed a line (issue 40, item 9: the summary counted 40 errors too few, the report said 0)."""
from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from pagedrun.cli import app as cli

GOOD = {"prompt_token_ids": [5, 6, 7], "max_tokens": 2}
TOO_LONG = {"prompt_token_ids": [5] * 40}  # past max_model_len: found when the request is pulled (pass 2)
BAD_FIELD = {"prompt_token_ids": [5], "temperature": -1}  # pass 1, with --skip-invalid
NOT_JSON = "{oops"


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama")


def run(model, tmp_path, lines, *extra):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    out = tmp_path / "out.jsonl"
    args = ["generate", str(prompts), "-o", str(out), "--skip-invalid", "--set", f"model.path={model}",
            "--set", "cache.num_blocks=64", "--set", "model.max_model_len=32", "--set", "model.threads=1", *extra]
    result = CliRunner().invoke(cli.app, args)
    records = [json.loads(x) for x in out.read_text().splitlines()]
    report = json.loads((tmp_path / "out.jsonl.report.json").read_text())
    return result, records, report


def summary_counts(text: str) -> tuple[int, int]:
    m = re.search(r"requests\s+(\d+) done(?:, (\d+) errors)?", text)
    assert m, text
    return int(m.group(1)), int(m.group(2) or 0)


MIXES = {
    "pass1": [GOOD, BAD_FIELD, GOOD, NOT_JSON],
    "pass2": [GOOD, TOO_LONG, GOOD, TOO_LONG, TOO_LONG],
    "both": [TOO_LONG, BAD_FIELD, GOOD, NOT_JSON, TOO_LONG, GOOD, GOOD],
    "all_bad": [TOO_LONG, BAD_FIELD, NOT_JSON],
    "none_bad": [GOOD] * 4,
}


@pytest.mark.parametrize("mix", list(MIXES))
def test_summary_report_and_exit_code_agree_with_the_file(model, tmp_path, mix):
    lines = MIXES[mix]
    result, records, report = run(model, tmp_path, lines)
    errors = sum("error" in r for r in records)
    assert len(records) == len(lines)
    assert summary_counts(result.stderr) == (len(lines) - errors, errors)
    assert (report["num_requests"], report["num_errors"]) == (len(lines), errors)
    assert result.exit_code == (0 if not errors else 4 if errors == len(lines) else 3)


def test_a_resumed_run_counts_what_it_wrote(model, tmp_path):
    lines = MIXES["both"]
    run(model, tmp_path, lines)
    out = tmp_path / "out.jsonl"
    kept = out.read_text().splitlines(keepends=True)
    out.write_text("".join(kept[:3]))  # the first three lines done: one good, two errors
    result, records, report = run(model, tmp_path, lines)
    assert len(records) == len(lines)
    errors_after = sum("error" in json.loads(x) for x in kept[3:])
    assert summary_counts(result.stderr) == (len(lines) - 3 - errors_after, errors_after)
    assert (report["num_requests"], report["num_errors"]) == (len(lines) - 3, errors_after)
    assert result.exit_code == 3  # the exit code counts the whole file
