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
