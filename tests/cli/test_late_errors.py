"""An error once requests began to run never exits 2 ("a user error, nothing ran"): it exits 5, in one
line saying how many requests are kept and that a resume goes on (issue 40, item 9)."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from pagedrun.cli import app as cli
from pagedrun.errors import PagedrunError

GOOD = {"prompt_token_ids": [5, 6, 7], "max_tokens": 2}


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama")


def invoke(model, tmp_path, n=6, *extra):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, **GOOD}) + "\n" for i in range(n)))
    args = ["generate", str(prompts), "-o", str(tmp_path / "out.jsonl"), "-q", "--set", f"model.path={model}",
            "--set", "cache.num_blocks=64", "--set", "model.max_model_len=32", "--set", "model.threads=1", *extra]
    return CliRunner().invoke(cli.app, args)


def boom(*a, **kw):
    raise PagedrunError("disk trouble")


@pytest.mark.parametrize("where", ["pagedrun.report.report.write_report", "pagedrun.io.writer.OutputWriter.finalize",
                                   "pagedrun.engine.engine.LLMEngine.step"])
def test_an_error_after_the_run_started_exits_5_and_resumes(model, tmp_path, monkeypatch, where):
    module, _, attr = where.rpartition(".")
    if attr in ("finalize", "step"):
        cls_path, _, cls_name = module.rpartition(".")
        target = getattr(__import__(cls_path, fromlist=[cls_name]), cls_name)
    else:
        target = __import__(module, fromlist=[attr])
    with monkeypatch.context() as m:
        m.setattr(target, attr, boom)
        result = invoke(model, tmp_path)
    assert result.exit_code == 5, result.output
    (line,) = result.stderr.splitlines()
    assert line.startswith("error: disk trouble; ") and "run the same command again to resume" in line
    again = invoke(model, tmp_path)  # the resume finishes the job
    assert again.exit_code == 0, again.output
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 6


def test_a_user_error_before_any_request_still_exits_2(model, tmp_path):
    result = invoke(model, tmp_path, 2, "--set", "model.threads=100000")
    assert result.exit_code == 2
