"""The job around the engine (cli/job.py): what it does before the model loads."""
from __future__ import annotations

import json

from typer.testing import CliRunner

from pagedrun.cli.app import app


def test_a_finished_job_says_nothing_to_do_without_loading_the_model(tiny_model, tmp_path, monkeypatch):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_token_ids": [5, 6, i], "max_tokens": 2, "ignore_eos": True})
                               + "\n" for i in range(3)))
    out = tmp_path / "out.jsonl"
    args = ["generate", str(prompts), "-o", str(out), "--model", str(tiny_model("llama")),
            "--set", "model.device=cpu", "--set", "cache.num_blocks=32", "--max-model-len", "64"]
    res = CliRunner().invoke(app, args + ["-q"])
    assert res.exit_code == 0, res.output
    done = out.read_text()
    assert len(done.splitlines()) == 3

    def no_model(*a, **k):
        raise AssertionError("the model was loaded for a job with nothing left to run")

    monkeypatch.setattr("pagedrun.llm.LLM", no_model)
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "nothing to do: all 3 requests are in" in res.output and out.read_text() == done


def _job_args(tiny_model, tmp_path, n: int = 6) -> list[str]:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_token_ids": [5, 6, i], "max_tokens": 2, "ignore_eos": True})
                               + "\n" for i in range(n)))
    return ["generate", str(prompts), "-o", str(tmp_path / "out.jsonl"), "--model", str(tiny_model("llama")),
            "--set", "model.device=cpu", "--set", "cache.num_blocks=32", "--max-model-len", "64"]


def test_unattended_run_logs_timestamped_progress(tiny_model, tmp_path):
    # CliRunner's stderr is not a terminal: a job under Slurm. An interval of 0.000001 s logs at every output.
    import re

    res = CliRunner().invoke(app, _job_args(tiny_model, tmp_path) + ["--log-interval", "0.000001"])
    assert res.exit_code == 0, res.output
    stamped = [line for line in res.output.splitlines()
               if re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ generating: ", line)]
    assert "6 completions to go" in stamped[0], stamped
    assert any("/6 completions (" in line and "tok/s" in line for line in stamped[1:-1]), stamped
    assert stamped[-1].split(" generating: ")[1].startswith("6/6 completions (100.0%)"), stamped
    assert stamped[-1].endswith("(done)")


def test_progress_log_is_off_with_interval_zero_or_quiet(tiny_model, tmp_path):
    for extra in (["--log-interval", "0"], ["-q"]):
        res = CliRunner().invoke(app, _job_args(tiny_model, tmp_path) + extra + ["--overwrite"])
        assert res.exit_code == 0, res.output
        assert " generating: " not in res.output, (extra, res.output)


def test_progress_log_line_format():
    from pagedrun.cli.progress_log import ProgressLog

    assert ProgressLog.status(1234, 10000, 456.74, 123.4) == (
        "generating: 1,234/10,000 completions (12.3%), 456.7 tok/s, 2m03s, eta 14m36s")
    assert ProgressLog.status(0, 0, 0.0, 3700) == "generating: 0/0 completions, 0.0 tok/s, 1h01m40s"
