"""vLLM's request fields through `pagedrun generate` on a JSONL file (issue 39, items 2 and 5): the
output records carry prompt_logprobs, a legacy guided_* field runs as structured_outputs with one
note on stderr, a bad value is one line naming file, line and field while the other lines run."""
from __future__ import annotations

import json
import shutil

from tiny_models import add_word_tokenizer
from typer.testing import CliRunner

from pagedrun.cli.app import app

WORDS = ["hello", "there", "how", "are", "you", "fine", "yes", "no"]


def _run(model, prompts, out, *extra):
    args = ["generate", str(prompts), "-o", str(out), "--set", f"model.path={model}", "--set", "model.device=cpu",
            "--set", "cache.num_blocks=64", "--set", "model.max_model_len=64", *extra]
    return CliRunner().invoke(app, args)


def test_jsonl_lines_with_vllm_fields(tiny_model, tmp_path):
    model = tmp_path / "m"
    shutil.copytree(tiny_model("llama"), model)
    add_word_tokenizer(model, WORDS)
    lines = [
        {"id": "score", "prompt_token_ids": [5, 6, 7, 8], "prompt_logprobs": 1, "max_tokens": 1},
        {"id": "choice", "prompt": "how are you", "guided_choice": ["yes", "no"], "max_tokens": 4},
        {"id": "bad", "prompt": "hello", "bad_words": 5},
        {"id": "chat", "messages": [{"role": "user", "content": "hello"}], "add_generation_prompt": False,
         "max_tokens": 2},
    ]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "out.jsonl"
    result = _run(model, prompts, out, "--skip-invalid")
    assert result.exit_code == 3, result.output  # one line failed
    assert "p.jsonl:2: guided_choice is deprecated (as in vLLM); read as structured_outputs: {\"choice\": ...}" \
        in " ".join(result.stderr.split())
    recs = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    plp = recs["score"]["prompt_logprobs"]
    assert plp[0] is None and [e["token_id"] for e in plp[1:]] == [6, 7, 8]
    assert all(e["logprob"] <= 0 and len(e["top"]) == 1 for e in plp[1:])
    # Read as a constraint: the word tokenizer is one the grammar engine cannot read, which is this
    # request's own error record (a real tokenizer runs it: tests/structured/).
    assert recs["choice"].get("text") in ("yes", "no") or recs["choice"]["error"].startswith("structured_outputs: ")
    assert recs["bad"]["error"] == "p.jsonl:3: bad_words: must be a list of non-empty strings, got 5"
    assert "error" not in recs["chat"] and "Traceback" not in result.output
