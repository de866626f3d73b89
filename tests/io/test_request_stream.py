"""Streaming a prompts file: checked whole first, tokenized in a bounded window ahead of the engine,
outputs equal to reading everything up front; the final order re-read from the file."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_models import make_tiny_model, write_token_prompts

from pagedrun.errors import PagedrunError
from pagedrun.io.stream import RequestStream
from pagedrun.io.writer import invalid_key, request_key

MAX_NUM_SEQS = 2
WINDOW = 3


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from pagedrun.config.recipe import load_recipe
    from pagedrun.llm import LLM

    model = make_tiny_model("llama", tmp_path_factory.mktemp("stream") / "model")
    return LLM(load_recipe(None, [f"model.path={model}", "cache.num_blocks=64", "model.max_model_len=64",
                                  f"scheduler.max_num_seqs={MAX_NUM_SEQS}"]))


def stream_of(llm, path: Path, **kw) -> RequestStream:
    return RequestStream(path, llm.recipe.sampling, vocab_size=llm.engine.model_config.vocab_size,
                         max_model_len=llm.engine.max_model_len, tokenizer=llm.tokenizer, **kw)


def test_requests_are_tokenized_in_a_bounded_window_and_match_an_up_front_run(llm, tmp_path):
    prompts = write_token_prompts(tmp_path / "p.jsonl", 40, id_prefix="q", max_tokens=4, seed=1)
    requests, _ = llm.read_requests(prompts)
    reference = {o.request_id: o.outputs[0].token_ids for o in llm.run(requests)}

    stream = stream_of(llm, prompts)
    stream.validate()
    assert (stream.num_lines, stream.num_pending, stream.tokenized) == (40, 40, 0)  # pass 1 tokenizes nothing
    finished: dict[str, list[int]] = {}
    ahead = []  # requests tokenized but not finished, after every output

    def on_output(o):
        finished[o.request_id] = o.outputs[0].token_ids
        ahead.append(stream.tokenized - len(finished))

    llm.run(stream.requests(lambda key: False, on_invalid=pytest.fail), on_output=on_output, window=WINDOW)
    assert finished == reference
    assert stream.tokenized == 40
    assert max(ahead) <= WINDOW + MAX_NUM_SEQS  # the running batch and the waiting window, no more
    assert ahead[0] < 40 // 2  # the first output came long before the file was tokenized


def test_done_lines_are_skipped_and_their_input_lines_located(llm, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join([
        json.dumps({"id": "a", "prompt_token_ids": [5, 6]}),
        "",
        json.dumps({"id": "bad", "prompt_token_ids": [5], "temperature": -1}),
        json.dumps({"id": "long", "prompt_token_ids": [5] * 80}),  # over max_model_len: found when tokenized
        json.dumps({"id": "b", "prompt_token_ids": [7]}),
    ]) + "\n")
    done = {request_key("a"), invalid_key(4)}  # "long" failed tokenization in an earlier run
    located = []
    stream = stream_of(llm, prompts, skip_invalid=True)
    stream.validate(done.__contains__, lambda key, line: located.append((key, line)))
    assert located == [(request_key("a"), 1), (invalid_key(4), 4)]
    done.discard(invalid_key(4))
    assert [b.line for b in stream.invalid] == [3]
    assert (stream.num_lines, stream.num_pending) == (4, 1)  # "a" and "long" have records: only "b" runs
    late = []
    assert [r.id for r in stream.requests(done.__contains__, late.append)] == ["b"]
    assert [(b.line, b.error.split(": ")[1]) for b in late] == [(4, "prompt_token_ids")]


def test_without_skip_invalid_the_first_bad_line_stops_pass_one(llm, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt_token_ids": [5]}) + "\n" + json.dumps({"prompt_token_ids": [5],
                                                                                 "top_p": 0}) + "\n")
    stream = stream_of(llm, prompts)
    with pytest.raises(PagedrunError) as e:
        stream.validate()
    assert str(e.value) == "p.jsonl:2: top_p: must be a number in (0, 1], got 0"
