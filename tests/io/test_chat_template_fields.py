"""Chat-template arguments (issue 39, item 5) in JSONL lines, batch bodies, LLM.chat and the recipe:
the prompt is exactly what transformers' apply_chat_template renders with the same arguments, on the
word tokenizer of tests/tiny_models.py (a template that reads every variable) and on the default
model's tokenizer."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from tiny_models import add_word_tokenizer

from pagedrun.config.recipe import load_recipe
from pagedrun.errors import PagedrunError
from pagedrun.io.openai_batch import BatchJob
from pagedrun.io.requests import read_requests
from pagedrun.sampling_params import SamplingParams

WORDS = ["hello", "there", "how", "are", "you", "fine", "search", "think", "system"]
# Reads the tools, a template variable (enable_thinking) and add_generation_prompt, as Qwen3's does.
TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|im_start|> system {% for t in tools %}{{ t['function']['name'] }} "
    "{% endfor %}<|im_end|> {% endif %}{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} "
    "<|im_end|> {% endfor %}{% if add_generation_prompt %}<|im_start|> assistant "
    "{% if enable_thinking is defined and not enable_thinking %}think think {% endif %}{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
CONV = [{"role": "user", "content": "how are you"}]
CONTINUED = CONV + [{"role": "assistant", "content": "fine there"}]
CASES = [
    (CONV, {}),
    (CONV, {"add_generation_prompt": False}),
    (CONTINUED, {"continue_final_message": True}),
    (CONV, {"chat_template": TEMPLATE}),
    (CONV, {"chat_template": TEMPLATE, "chat_template_kwargs": {"enable_thinking": False}, "tools": TOOLS}),
    (CONTINUED, {"chat_template": TEMPLATE, "continue_final_message": True, "tools": TOOLS}),
]


@pytest.fixture(scope="module")
def word_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(add_word_tokenizer(tmp_path_factory.mktemp("tok"), WORDS)))


def _hf(tok, conv, args) -> list[int]:
    """transformers' rendering with the same arguments, encoded as a chat prompt is (the template
    writes the BOS)."""
    kw = dict(args)
    kw.update(kw.pop("chat_template_kwargs", {}))
    if kw.get("continue_final_message"):
        kw.setdefault("add_generation_prompt", False)
    kw.setdefault("add_generation_prompt", True)
    text = tok.apply_chat_template(conv, tokenize=False, **kw)
    return tok.encode(text, add_special_tokens=False)


def _read(tmp_path: Path, lines: list[dict], tok, batch: bool = False):
    p = tmp_path / "prompts.jsonl"
    p.write_text("".join(json.dumps(x) + "\n" for x in lines))
    job = BatchJob(input_sha256="0" * 64, model="m", created=1) if batch else None
    return read_requests(p, tok, SamplingParams(), vocab_size=len(tok), max_model_len=512, batch_job=job,
                         skip_invalid=True)


@pytest.mark.parametrize("conv, args", CASES, ids=lambda x: json.dumps(x)[:60])
def test_a_jsonl_line_renders_as_transformers_does(tmp_path, word_tokenizer, conv, args):
    (req,), invalid = _read(tmp_path, [{"messages": conv, **args}], word_tokenizer)
    assert not invalid
    assert req.prompt_token_ids == _hf(word_tokenizer, conv, args)


@pytest.mark.parametrize("conv, args", CASES, ids=lambda x: json.dumps(x)[:60])
def test_a_batch_body_renders_as_transformers_does(tmp_path, word_tokenizer, conv, args):
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": conv, **args}}
    (req,), invalid = _read(tmp_path, [line], word_tokenizer, batch=True)
    assert not invalid
    assert req.prompt_token_ids == _hf(word_tokenizer, conv, args)


def test_the_thinking_switch_and_tools_change_the_prompt(tmp_path, word_tokenizer):
    (plain, off), _ = _read(tmp_path, [{"messages": CONV, "chat_template": TEMPLATE},
                                       {"messages": CONV, "chat_template": TEMPLATE, "tools": TOOLS,
                                        "chat_template_kwargs": {"enable_thinking": False}}], word_tokenizer)
    think, search = word_tokenizer.convert_tokens_to_ids(["think", "search"])
    assert think not in plain.prompt_token_ids and off.prompt_token_ids.count(think) == 2
    assert search in off.prompt_token_ids


@pytest.mark.parametrize("line, error", [
    ({"prompt": "hello", "chat_template_kwargs": {"a": 1}},
     'prompts.jsonl:1: chat_template_kwargs: only with "messages" (a chat template argument)'),
    ({"messages": CONV, "chat_template_kwargs": [1]},
     "prompts.jsonl:1: chat_template_kwargs: must be an object of template variables"),
    ({"messages": CONV, "chat_template_kwargs": {"tools": []}},
     "prompts.jsonl:1: chat_template_kwargs: 'tools' is a chat-template argument of its own; give it outside"),
    ({"messages": CONV, "add_generation_prompt": "yes"},
     "prompts.jsonl:1: add_generation_prompt: must be true or false"),
    ({"messages": CONV, "add_generation_prompt": True, "continue_final_message": True},
     "prompts.jsonl:1: continue_final_message: excludes add_generation_prompt: true (give one)"),
    ({"messages": CONV, "tools": {"a": 1}}, "prompts.jsonl:1: tools: must be a list of tool objects"),
    ({"messages": CONV, "chat_template": "{% for %}"}, "prompts.jsonl:1: messages: chat template failed: "),
])
def test_bad_template_arguments_are_one_line_errors_and_the_others_run(tmp_path, word_tokenizer, line, error):
    reqs, invalid = _read(tmp_path, [line, {"messages": CONV}], word_tokenizer)
    assert len(reqs) == 1 and reqs[0].line == 2
    assert invalid[0].error.startswith(error) and "\n" not in invalid[0].error


def test_the_default_models_tokenizer(tmp_path, default_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_model))
    for conv, args in CASES:
        # Its BOS is <|im_start|>: the template's own BOS before one would be collapsed (one BOS).
        if "chat_template" in args:
            args = {**args, "chat_template": args["chat_template"].removeprefix("{{ bos_token }}")}
        (req,), invalid = _read(tmp_path, [{"messages": conv, **args}], tok)
        assert not invalid, invalid
        assert req.prompt_token_ids == _hf(tok, conv, args), args


def test_the_recipes_template_file(tmp_path, tiny_model):
    from pagedrun.llm import LLM

    d = tmp_path / "m"
    shutil.copytree(tiny_model("llama"), d)
    add_word_tokenizer(d, WORDS)
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model:\n  path: {d}\n  device: cpu\n  max_model_len: 64\n  chat_template: t.jinja\n"
                      "cache:\n  num_blocks: 64\n")
    r = load_recipe(recipe)
    assert r.model.chat_template == str((tmp_path / "t.jinja").resolve())
    before = r.fingerprint()
    (tmp_path / "t.jinja").write_text(TEMPLATE + " ")  # another template: another job
    assert load_recipe(recipe).fingerprint() != before
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    llm = LLM(recipe=recipe)
    tok = llm.get_tokenizer()
    sp = SamplingParams(max_tokens=1)
    (o,) = llm.chat(CONV, sp, use_tqdm=False, tools=TOOLS, chat_template_kwargs={"enable_thinking": False})
    assert o.prompt_token_ids == _hf(tok, CONV, {"chat_template": TEMPLATE, "tools": TOOLS,
                                                 "chat_template_kwargs": {"enable_thinking": False}})
    with pytest.raises(PagedrunError,
                       match=r"--set model.chat_template=.*: must be a chat template file \(Jinja\); .* is not a file"):
        load_recipe(None, [f"model.chat_template={tmp_path / 'none.jinja'}"])
