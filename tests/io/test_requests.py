import json
from pathlib import Path

import pytest

from pagedrun.errors import PagedrunError
from pagedrun.io.requests import InvalidRequest, Request, read_requests
from pagedrun.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parents[2]
VOCAB = 100
WORDS = ["[UNK]", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "user", "assistant", "system",
         "hello", "world", "the", "cat", "sat", "be", "brief"]
BOS = 1
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> "
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    """A word-level tokenizer whose post-processor adds BOS (like Llama's) and whose chat template
    writes BOS too: encoding the template's text with special tokens would double it."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "</s>", "<|im_start|>", "<|im_end|>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="[UNK]")
    fast.chat_template = CHAT_TEMPLATE
    assert fast.bos_token_id == BOS
    return fast


def write_lines(tmp_path: Path, lines, name="prompts.jsonl") -> Path:
    p = tmp_path / name
    p.write_text("".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines), encoding="utf-8")
    return p


def read(path, tokenizer=None, defaults=None, max_model_len=64, skip_invalid=False):
    return read_requests(path, tokenizer, defaults or SamplingParams(), vocab_size=VOCAB,
                         max_model_len=max_model_len, skip_invalid=skip_invalid)


def error_of(path, tokenizer=None, **kw) -> str:
    with pytest.raises(PagedrunError) as e:
        read(path, tokenizer, **kw)
    assert "\n" not in str(e.value)
    return str(e.value)


# ---------------------------------------------------------------- the three forms

def test_prompt_token_ids_without_tokenizer(tmp_path):
    p = write_lines(tmp_path, [{"prompt_token_ids": [5, 6, 7]}, "", "   ", {"id": "x", "prompt_token_ids": [0, 99]}])
    reqs, bad = read(p)
    assert bad == []
    assert [(r.id, r.line, r.prompt_token_ids) for r in reqs] == [("1", 1, [5, 6, 7]), ("x", 4, [0, 99])]
    assert reqs[0].prompt is None and reqs[0].messages is None
    assert reqs[0].sampling == SamplingParams()


def test_prompt_is_tokenized_with_its_bos(tmp_path, tokenizer):
    reqs, _ = read(write_lines(tmp_path, [{"id": 3, "prompt": "hello world"}]), tokenizer)
    assert reqs[0].id == "3"  # int ids are stored as strings
    assert reqs[0].prompt_token_ids == [BOS, 8, 9] and reqs[0].prompt == "hello world"


def test_prompt_starting_with_bos_text_gets_one_bos(tmp_path, tokenizer):
    reqs, _ = read(write_lines(tmp_path, [{"prompt": "<s> hello"}]), tokenizer)
    assert reqs[0].prompt_token_ids == [BOS, 8]


def test_messages_use_the_chat_template_with_a_single_bos(tmp_path, tokenizer):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
    reqs, _ = read(write_lines(tmp_path, [{"messages": messages}]), tokenizer)
    ids = reqs[0].prompt_token_ids
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    # the trap this avoids: the template writes <s> and encode() with special tokens adds another
    assert tokenizer.encode(text)[:2] == [BOS, BOS]
    assert ids.count(BOS) == 1 and ids[0] == BOS
    assert ids == [BOS, 3, 7, 13, 14, 4, 3, 5, 8, 9, 4, 3, 6]  # ... <|im_start|> assistant
    assert reqs[0].messages == messages and reqs[0].prompt is None


def test_per_request_sampling_overrides_defaults(tmp_path):
    defaults = SamplingParams(max_tokens=32, temperature=0.0, stop=["\n"])
    p = write_lines(tmp_path, [
        {"prompt_token_ids": [1], "temperature": 0.7, "seed": 3, "stop": "END"},
        {"prompt_token_ids": [1]},
    ])
    reqs, _ = read(p, defaults=defaults)
    assert (reqs[0].sampling.temperature, reqs[0].sampling.seed, reqs[0].sampling.stop) == (0.7, 3, ["END"])
    assert reqs[0].sampling.max_tokens == 32
    assert reqs[1].sampling == defaults


def test_crlf_and_utf8_bom(tmp_path):
    p = tmp_path / "prompts.jsonl"
    p.write_bytes(b'\xef\xbb\xbf{"prompt_token_ids": [1]}\r\n{"prompt_token_ids": [2]}\r\n')
    reqs, _ = read(p)
    assert [r.prompt_token_ids for r in reqs] == [[1], [2]]


# ---------------------------------------------------------------- line errors

TOK = "<tokenizer>"  # marker: the case needs the test tokenizer


@pytest.mark.parametrize("line,needs_tok,expected", [
    ('{"prompt": "hi",}', False, "prompts.jsonl:2: invalid JSON: Expecting property name enclosed in double quotes at column 17"),
    ("[1, 2]", False, "prompts.jsonl:2: must be a JSON object, got an array"),
    ('"hello"', False, "prompts.jsonl:2: must be a JSON object, got a string"),
    ({"id": "b"}, False, 'prompts.jsonl:2: prompt: missing: each line needs one of "prompt", "messages", "prompt_token_ids"'),
    ({"prompt": "x", "prompt_token_ids": [1]}, False,
     'prompts.jsonl:2: prompt, prompt_token_ids: give only one of "prompt", "messages", "prompt_token_ids"'),
    ({"prompt": 5}, False, "prompts.jsonl:2: prompt: must be a string, got a number"),
    ({"prompt": ""}, False, "prompts.jsonl:2: prompt: empty prompt"),
    ({"prompt": "hello"}, False, "prompts.jsonl:2: prompt: needs a tokenizer; use prompt_token_ids (this model has no tokenizer)"),
    ({"messages": [{"role": "user", "content": "hi"}]}, False,
     "prompts.jsonl:2: messages: needs a tokenizer; use prompt_token_ids (this model has no tokenizer)"),
    ({"messages": []}, True, 'prompts.jsonl:2: messages: must be a non-empty list of {"role": ..., "content": ...} objects'),
    ({"messages": "hi"}, True, 'prompts.jsonl:2: messages: must be a non-empty list of {"role": ..., "content": ...} objects'),
    ({"messages": ["hi"]}, True, "prompts.jsonl:2: messages: item 0 must be an object, got a string"),
    ({"messages": [{"role": "user"}]}, True, 'prompts.jsonl:2: messages: item 0 needs a string "content"'),
    ({"messages": [{"role": 1, "content": "x"}]}, True, 'prompts.jsonl:2: messages: item 0 needs a string "role"'),
    ({"prompt_token_ids": []}, False, "prompts.jsonl:2: prompt_token_ids: empty prompt"),
    ({"prompt_token_ids": "1 2"}, False, "prompts.jsonl:2: prompt_token_ids: must be a list of integers, got a string"),
    ({"prompt_token_ids": [1, 2.0]}, False, "prompts.jsonl:2: prompt_token_ids: must be a list of integers; index 1 is 2.0"),
    ({"prompt_token_ids": [1, True]}, False, "prompts.jsonl:2: prompt_token_ids: must be a list of integers; index 1 is true"),
    ({"prompt_token_ids": [1, 100]}, False, "prompts.jsonl:2: prompt_token_ids: token id 100 at index 1 is outside [0, 100)"),
    ({"prompt_token_ids": [-1]}, False, "prompts.jsonl:2: prompt_token_ids: token id -1 at index 0 is outside [0, 100)"),
    ({"prompt_token_ids": [1], "stop_token_ids": [100]}, False,
     "prompts.jsonl:2: stop_token_ids: token id 100 at index 0 is outside [0, 100)"),
    ({"prompt_token_ids": [1], "temperature": -1}, False, "prompts.jsonl:2: temperature: must be a number >= 0 (0 = greedy), got -1"),
    ({"prompt_token_ids": [1], "max_tokens": "10"}, False, "prompts.jsonl:2: max_tokens: must be an integer >= 1, got '10'"),
    ({"prompt_token_ids": [1], "logprobs": 50}, False, "prompts.jsonl:2: logprobs: must be an integer in 0..20 or null, got 50"),
    ({"prompt_token_ids": [1], "max_token": 10}, False, "prompts.jsonl:2: max_token: unknown field (did you mean max_tokens?)"),
    ({"prompt_token_ids": [1], "id": None}, False, "prompts.jsonl:2: id: must be a non-empty string or an integer, got null"),
    ({"prompt_token_ids": [1], "id": ""}, False, 'prompts.jsonl:2: id: must be a non-empty string or an integer, got ""'),
    ({"prompt_token_ids": [1], "id": 1.5}, False, "prompts.jsonl:2: id: must be a non-empty string or an integer, got 1.5"),
])
def test_line_errors_name_file_line_and_field(tmp_path, tokenizer, line, needs_tok, expected):
    p = write_lines(tmp_path, [{"prompt_token_ids": [1]}, line])
    assert error_of(p, tokenizer if needs_tok else None) == expected


def test_non_utf8_line_is_named(tmp_path):
    p = tmp_path / "prompts.jsonl"
    p.write_bytes(b'{"prompt_token_ids": [1]}\n{"prompt": "caf\xe9"}\n')
    assert error_of(p) == "prompts.jsonl:2: not valid UTF-8 (byte 0xe9 at column 16)"


def test_duplicate_ids_name_both_lines(tmp_path):
    p = write_lines(tmp_path, [{"id": "a", "prompt_token_ids": [1]}, {"prompt_token_ids": [2]},
                               {"id": "a", "prompt_token_ids": [3]}])
    assert error_of(p) == "prompts.jsonl:3: id: duplicate id 'a' (first used on line 1)"


def test_explicit_id_clashing_with_a_line_number_id(tmp_path):
    p = write_lines(tmp_path, [{"prompt_token_ids": [1]}, {"id": 1, "prompt_token_ids": [2]}])
    assert error_of(p) == "prompts.jsonl:2: id: duplicate id '1' (first used on line 1)"


def test_chat_template_missing(tmp_path, tokenizer):
    import copy
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = None
    p = write_lines(tmp_path, [{"messages": [{"role": "user", "content": "hi"}]}])
    assert error_of(p, tok) == "prompts.jsonl:1: messages: the model's tokenizer has no chat template; use prompt"


def test_chat_template_error_is_one_line(tmp_path, tokenizer):
    import copy
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = "{{ raise_exception('Conversation roles must alternate\\nuser/assistant') }}"
    p = write_lines(tmp_path, [{"messages": [{"role": "user", "content": "hi"}]}])
    msg = error_of(p, tok)
    assert msg.startswith("prompts.jsonl:1: messages: chat template failed: ") and "alternate" in msg


def test_error_uses_the_files_name(tmp_path):
    p = write_lines(tmp_path, ["nope"], name="my-evals.jsonl")
    assert error_of(p).startswith("my-evals.jsonl:1: invalid JSON:")


# ---------------------------------------------------------------- file errors

def test_empty_file(tmp_path):
    p = tmp_path / "prompts.jsonl"
    p.write_text("\n  \n")
    assert error_of(p) == "prompts.jsonl: no requests"
    assert error_of(p, skip_invalid=True) == "prompts.jsonl: no requests"  # file-level: always raised


def test_missing_file(tmp_path):
    assert error_of(tmp_path / "prompts.jsonl", skip_invalid=True).startswith("prompts.jsonl: prompts file not found")


# ---------------------------------------------------------------- skip_invalid, too-long prompts

def test_skip_invalid_turns_line_errors_into_records(tmp_path):
    p = tmp_path / "prompts.jsonl"
    p.write_bytes(b"\n".join([
        b'{"id": "ok1", "prompt_token_ids": [1]}',
        b'{"id": "t", "prompt_token_ids": [1], "temperature": -1}',
        b'not json',
        b'{"prompt": "caf\xe9"}',
        b'{"id": "ok1", "prompt_token_ids": [2]}',
        b'{"id": "ok2", "prompt_token_ids": [3]}',
    ]) + b"\n")
    reqs, bad = read(p, skip_invalid=True)
    assert [r.id for r in reqs] == ["ok1", "ok2"]
    assert [(b.id, b.line) for b in bad] == [("t", 2), ("3", 3), ("4", 4), ("ok1", 5)]
    assert bad[0].error == "prompts.jsonl:2: temperature: must be a number >= 0 (0 = greedy), got -1"
    assert bad[1].error.startswith("prompts.jsonl:3: invalid JSON:")
    assert bad[2].error.startswith("prompts.jsonl:4: not valid UTF-8")
    assert bad[3].error == "prompts.jsonl:5: id: duplicate id 'ok1' (first used on line 1)"
    assert all(isinstance(b, InvalidRequest) for b in bad) and all(isinstance(r, Request) for r in reqs)


def test_skip_invalid_with_only_bad_lines_returns_no_requests(tmp_path):
    reqs, bad = read(write_lines(tmp_path, ["{", "[]"]), skip_invalid=True)
    assert reqs == [] and [b.line for b in bad] == [1, 2]


@pytest.mark.parametrize("skip_invalid", [False, True])
def test_too_long_prompt_is_always_a_record(tmp_path, tokenizer, skip_invalid):
    p = write_lines(tmp_path, [
        {"id": "long", "prompt_token_ids": [1] * 16},
        {"id": "fits", "prompt_token_ids": [1] * 15},
        {"id": "long-chat", "messages": [{"role": "user", "content": "hello " * 20}]},
    ])
    reqs, bad = read(p, tokenizer, max_model_len=16, skip_invalid=skip_invalid)
    assert [r.id for r in reqs] == ["fits"]
    assert [(b.id, b.line) for b in bad] == [("long", 1), ("long-chat", 3)]
    assert bad[0].error == ("prompts.jsonl:1: prompt_token_ids: prompt has 16 tokens; max_model_len is 16"
                            " (a prompt may have at most 15)")
    assert bad[1].error.startswith("prompts.jsonl:3: messages: prompt has 26 tokens; max_model_len is 16")  # BOS + 5 markup + 20 words


# ---------------------------------------------------------------- the example file

def test_example_prompts_parse(tokenizer):
    reqs, bad = read(REPO / "examples" / "prompts.jsonl", tokenizer, max_model_len=8192)
    assert bad == [] and len(reqs) >= 10
    kinds = {("prompt" if r.prompt else "messages") for r in reqs}
    assert kinds == {"prompt", "messages"}
    assert len({r.id for r in reqs}) == len(reqs)
    assert any(not r.sampling.is_greedy and r.sampling.seed is not None for r in reqs)
    assert any(r.sampling.stop for r in reqs)
