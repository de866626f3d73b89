"""`profile-memory --prompts` sizes any prompts file `generate` reads, an OpenAI batch file included; a
reader that cannot answer a batch file says so in one line, never a traceback (issue 40, item 8)."""
from __future__ import annotations

import json

import pytest
from tiny_models import add_word_tokenizer, make_tiny_model
from typer.testing import CliRunner

from pagedrun.cli import app as cli
from pagedrun.config.recipe import load_recipe
from pagedrun.errors import PagedrunError
from pagedrun.io.requests import read_requests

SETS = ["--set", "cache.num_blocks=64", "--set", "model.max_model_len=32", "--set", "model.threads=1"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = make_tiny_model("llama", tmp_path_factory.mktemp("pm") / "m", seed=1)
    return add_word_tokenizer(d, ["hi", "there"])


def chat(i: int, **body) -> dict:
    return {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": "hi there " * (i + 1)}], "max_tokens": 4,
                     **body}}


def completion(i: int) -> dict:
    return {"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
            "body": {"model": "m", "prompt": "hi " * (i + 1), "max_tokens": 3}}


BATCHES = {
    "chat": [chat(i) for i in range(4)],
    "completions": [completion(i) for i in range(3)],
    "mixed_urls": [chat(0), completion(1), chat(2)],
    "one_bad_line": [chat(0), {"custom_id": "x", "method": "POST", "url": "/v1/embeddings", "body": {}}, chat(1)],
    "too_long": [chat(0), chat(40)],
}


@pytest.mark.parametrize("name", list(BATCHES))
def test_profile_memory_sizes_a_batch_file(model, tmp_path, name):
    lines = BATCHES[name]
    prompts = tmp_path / "batch.jsonl"
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(cli.app, ["profile-memory", "--prompts", str(prompts), "--json", str(out),
                                          "--set", f"model.path={model}", *SETS])
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    q = json.loads(out.read_text())["requests"]
    bad = {"one_bad_line": 1, "too_long": 1}.get(name, 0)
    assert q["num_requests"] == len(lines) - bad and q["num_invalid"] == bad


@pytest.mark.parametrize("skip_invalid", [False, True])
@pytest.mark.parametrize("first", [0, 1, 3])
def test_a_reader_without_a_batch_job_refuses_the_file_in_one_line(model, tmp_path, skip_invalid, first):
    """Python's read_requests (and the bench) without a BatchJob: one error for the file, at the line that
    decided its format, whatever came before it (blank lines) and with or without skip_invalid."""
    prompts = tmp_path / "batch.jsonl"
    prompts.write_text("\n" * first + "".join(json.dumps(chat(i)) + "\n" for i in range(3)))
    recipe = load_recipe(None, [f"model.path={model}"])
    with pytest.raises(PagedrunError) as e:
        read_requests(prompts, None, recipe.sampling, vocab_size=640, max_model_len=32, skip_invalid=skip_invalid)
    assert str(e.value).startswith(f"batch.jsonl:{first + 1}: an OpenAI batch file")
    assert "\n" not in str(e.value)
