"""Hostile and pathological inputs, generated: every one is a one-line error (or an error record),
bounded in the work it causes, and never a traceback, a crash or a hang; n above max_num_seqs runs
and gives the outputs a large max_num_seqs gives; exit codes say whether requests failed; a closed
terminal pipe does not end the job."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pagedrun.cli import app as cli
from pagedrun.config.recipe import load_recipe
from pagedrun.errors import ECHO_CHARS, PagedrunError
from pagedrun.io.requests import read_requests
from pagedrun.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
DEEP = 100_000
# An error quotes at most ECHO_CHARS of a value; the rest of the line is location and explanation.
MAX_ERROR_CHARS = ECHO_CHARS + 300


@pytest.fixture(scope="module")
def model(tiny_model) -> Path:
    return tiny_model("llama")


def one_line(exc_info) -> str:
    msg = str(exc_info.value)
    assert "\n" not in msg and len(msg) < MAX_ERROR_CHARS, msg[:500]
    return msg


def recipe_error(tmp_path: Path, text: str) -> str:
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    with pytest.raises(PagedrunError) as e:
        load_recipe(path)
    return one_line(e)


# ---------------------------------------------------------------- recipes

def test_recipe_nested_deeply_in_flow_style(tmp_path):
    err = recipe_error(tmp_path, "sampling:\n  stop: " + "[" * DEEP + "]" * DEEP + "\n")
    assert err.startswith("recipe.yaml:2:") and "nested more than 16 levels deep" in err


def test_recipe_nested_deeply_in_block_style(tmp_path):
    text = "".join("  " * i + f"k{i}:\n" for i in range(500))
    assert "nested more than 16 levels deep" in recipe_error(tmp_path, text)


def test_yaml_alias_bomb_is_refused_before_expanding(tmp_path):
    # Nine levels of nine aliases: 9**9 (387 million) strings if expanded.
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, 9):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]")
    lines.append("sampling:\n  stop: [" + ", ".join(["*a8"] * 9) + "]")
    err = recipe_error(tmp_path, "\n".join(lines) + "\n")
    assert err.startswith("recipe.yaml:2:") and "aliases (*name) are not allowed" in err


def test_anchor_without_alias_still_loads(tmp_path):
    (tmp_path / "r.yaml").write_text("sampling: &s\n  max_tokens: 5\n")
    assert load_recipe(tmp_path / "r.yaml").sampling.max_tokens == 5


def test_huge_bad_value_is_echoed_cut(tmp_path):
    err = recipe_error(tmp_path, "model:\n  dtype: " + "x" * 500_000 + "\n")
    assert err.startswith("recipe.yaml:2: model.dtype: must be one of auto, float32, bfloat16, float16, got 'xxx")
    assert err.endswith("'…")


def test_huge_recipe_file_is_refused_unread(tmp_path):
    path = tmp_path / "recipe.yaml"
    with path.open("w") as f:
        f.write("model:\n  dtype: ")
        f.write("x" * (20 << 20))
    with pytest.raises(PagedrunError) as e:
        load_recipe(path)
    assert one_line(e) == "recipe.yaml: larger than 1,048,576 bytes; not a recipe"


def test_huge_unknown_key_is_echoed_cut(tmp_path):
    err = recipe_error(tmp_path, "cache:\n  " + "k" * 1000 + ": 1\n")  # YAML keys end at 1024
    assert err.startswith("recipe.yaml:2: cache.kkk") and "unknown key" in err


@pytest.mark.parametrize("override, expected", [
    ("model.threads=100000", "--set model.threads=100000: must be at most 1024"),
    ("cache.num_blocks=1000000000000", "--set cache.num_blocks=1000000000000: must be at most 67108864"),
    ("scheduler.max_num_seqs=10000000", "--set scheduler.max_num_seqs=10000000: must be at most 65536"),
    ("model.max_model_len=999999999", "--set model.max_model_len=999999999: must be at most 4194304"),
    ("sampling.n=1000000", "--set sampling.n=1000000: must be at most 10000"),
    ("sampling.top_k=" + "9" * 30, "--set sampling.top_k=999"),
    ("sampling.max_tokens=" + "9" * 5000, "--set sampling.max_tokens=999"),
    ("sampling.max_tokens=" + "9" * 5000, "an integer of 5,000 digits is too long"),
    ("cache.kv_cache_memory=100000TiB", "--set cache.kv_cache_memory=100000TiB: must be at most"),
    ("sampling.stop=" + "[" * DEEP, "--set sampling.stop=[[["),
], ids=lambda x: x[:40])
def test_numeric_and_structural_caps_in_overrides(override, expected):
    with pytest.raises(PagedrunError) as e:
        load_recipe(None, [override])
    assert expected in one_line(e)


def test_sampling_params_in_python_get_the_same_caps():
    with pytest.raises(PagedrunError) as e:
        SamplingParams(top_k=10**30)
    assert one_line(e) == "SamplingParams: top_k: must be at most 2147483647, got " + str(10**30)


# ---------------------------------------------------------------- prompts files

def read(path: Path, tokenizer=None, vocab_size: int = 640, max_model_len: int = 64, skip_invalid=False):
    return read_requests(path, tokenizer, SamplingParams(), vocab_size=vocab_size, max_model_len=max_model_len,
                         skip_invalid=skip_invalid)


def test_jsonl_nested_deeply_is_a_line_error_even_with_skip_invalid(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text('{"prompt_token_ids": [5]}\n' + "[" * DEEP + "]" * DEEP + "\n"
                 + '{"prompt_token_ids": [' + "[" * DEEP + "]" * DEEP + "]}\n")
    with pytest.raises(PagedrunError) as e:
        read(p)
    assert one_line(e) == "p.jsonl:2: invalid JSON: nested too deeply"
    requests, invalid = read(p, skip_invalid=True)
    assert len(requests) == 1
    assert [bad.error for bad in invalid] == ["p.jsonl:2: invalid JSON: nested too deeply",
                                             "p.jsonl:3: invalid JSON: nested too deeply"]


def test_jsonl_moderately_nested_value_is_echoed_bounded(tmp_path):
    # Nested just under the JSON parser's limit: parsed, then refused, and quoted a few levels deep.
    p = tmp_path / "p.jsonl"
    p.write_text('{"prompt_token_ids": [5, ' + "[" * 500 + "]" * 500 + "]}\n")
    with pytest.raises(PagedrunError) as e:
        read(p)
    assert one_line(e) == "p.jsonl:1: prompt_token_ids: must be a list of integers; index 1 is [[[[...]]]]"


@pytest.mark.parametrize("line, prefix", [
    ({"prompt_token_ids": [5], "temperature": "x" * (20 << 20)}, "p.jsonl:1: temperature: must be"),
    ({"id": ["x" * (20 << 20)], "prompt_token_ids": [5]}, "p.jsonl:1: id: must be a non-empty string"),
    ({"prompt_token_ids": [5], "x" * (1 << 20): 1}, "p.jsonl:1: xxxx"),
    ({"prompt_token_ids": [5, "7" * (1 << 20)]}, "p.jsonl:1: prompt_token_ids: must be a list of integers"),
    ('{"prompt_token_ids": [5, ' + "7" * 10_000 + "]}", "p.jsonl:1: invalid JSON: Exceeds the limit"),
], ids=lambda x: str(x)[:40])
def test_huge_bad_values_in_a_line_are_echoed_cut(tmp_path, line, prefix):
    p = tmp_path / "p.jsonl"
    p.write_text((line if isinstance(line, str) else json.dumps(line)) + "\n")
    with pytest.raises(PagedrunError) as e:
        read(p)
    assert one_line(e).startswith(prefix)


@pytest.fixture(scope="module")
def tokenizer():
    """A word-level tokenizer of 40 entries, one of them 24 characters long."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "<s>", "</s>", "abcdefghijklmnopqrstuvwx"] + [f"w{i}" for i in range(36)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="[UNK]")


class Recording:
    """The tokenizer, recording the length of every text it is asked to encode."""

    def __init__(self, tok) -> None:
        self.tok, self.lengths = tok, []

    def encode(self, text, **kw):
        self.lengths.append(len(text))
        return self.tok.encode(text, **kw)

    def __getattr__(self, name):
        return getattr(self.tok, name)


def test_tokenized_ids_outside_the_model_vocabulary(tmp_path, tokenizer):
    # The tokenizer has 40 entries, the "model" 30: w30 is id 34.
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"prompt": "w1 w2"}) + "\n" + json.dumps({"prompt": "w1 w30 w2"}) + "\n")
    with pytest.raises(PagedrunError) as e:
        read(p, tokenizer, vocab_size=30)
    assert one_line(e) == ("p.jsonl:2: prompt: the tokenizer gave token id 34 (token 1), outside the model's "
                           "vocabulary [0, 30): the tokenizer does not match the model")
    requests, invalid = read(p, tokenizer, vocab_size=30, skip_invalid=True)
    assert [r.line for r in requests] == [1] and [b.line for b in invalid] == [2]


def test_huge_prompt_is_tokenized_only_as_far_as_max_model_len_can_reach(tmp_path, tokenizer):
    max_model_len = 64
    budget = (max_model_len + 1) * 24  # the longest vocabulary entry has 24 characters
    p = tmp_path / "p.jsonl"
    huge = "w1 " * (16 << 20)  # 48 MiB of text
    p.write_text(json.dumps({"id": "huge", "prompt": huge}) + "\n" + json.dumps({"prompt": "w1 w2"}) + "\n")
    rec = Recording(tokenizer)
    requests, invalid = read(p, rec, max_model_len=max_model_len)  # too long: a record, not a stop
    assert [r.line for r in requests] == [2]
    assert max(rec.lengths) == budget
    assert invalid[0].id == "huge" and invalid[0].error == (
        f"p.jsonl:1: prompt: prompt has more than 63 tokens: its first {budget:,} of {len(huge):,} characters "
        f"make {budget // 3:,}; max_model_len is 64")


def test_prompt_just_within_the_character_budget_is_tokenized_exactly(tmp_path, tokenizer):
    p = tmp_path / "p.jsonl"
    # 63 tokens of 24 characters, and the spaces between them, which the tokenizer drops: 1,574
    # characters, more than 65 x 24, yet within max_model_len.
    p.write_text(json.dumps({"prompt": " ".join(["abcdefghijklmnopqrstuvwx"] * 63)}) + "\n")
    requests, invalid = read(p, tokenizer, max_model_len=64)
    assert requests[0].prompt_token_ids == [3] * 63 and not invalid


# ---------------------------------------------------------------- config.json

def copy_model(model: Path, dest: Path, **config) -> Path:
    shutil.copytree(model, dest)
    data = json.loads((dest / "config.json").read_text())
    data.update(config)
    (dest / "config.json").write_text(json.dumps(data))
    return dest


def test_config_json_nested_deeply(model, tmp_path):
    import torch

    from pagedrun.models.loader import load_model

    d = copy_model(model, tmp_path / "m")
    (d / "config.json").write_text('{"a": ' + "[" * DEEP + "]" * DEEP + "}")
    with pytest.raises(PagedrunError) as e:
        load_model(d, torch.float32)
    assert one_line(e).startswith(f"{d / 'config.json'}: cannot read JSON: ")


@pytest.mark.parametrize("config, expected", [
    ({"num_hidden_layers": 10**7}, "config.json: num_hidden_layers is 10000000, the checkpoint has 3 layers"),
    ({"vocab_size": 10**9}, "model.embed_tokens.weight: shape mismatch: model expects [1000000000, 64]"),
    ({"intermediate_size": 10**8}, "model.layers.0.mlp.gate_proj.weight: shape mismatch: model expects [100000000, 64]"),
    ({"num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 10**6},
     "model.layers.0.self_attn.q_proj.weight: shape mismatch: model expects [1000000, 64]"),
    ({"hidden_size": 10**30}, "hidden_size: expected an integer in 1..2147483648, got 1000000000000000000000000000000"),
    ({"rms_norm_eps": "x" * 10**6}, "rms_norm_eps: expected a number, got 'xxx"),
])
def test_absurd_config_sizes_are_refused_before_allocating(model, tmp_path, monkeypatch, config, expected):
    import torch

    from pagedrun.models import loader

    def never(*a, **kw):
        raise AssertionError("the model was allocated before the config was checked")

    monkeypatch.setattr(loader, "LlamaForCausalLM", never)
    d = copy_model(model, tmp_path / "m", **config)
    with pytest.raises(PagedrunError) as e:
        loader.load_model(d, torch.float32)
    assert expected in one_line(e)


# ---------------------------------------------------------------- n above max_num_seqs

def test_n_above_max_num_seqs_runs_and_matches_a_large_max_num_seqs(model):
    from pagedrun.llm import LLM

    prompts = [list(range(5, 24)), [30, 31, 32]]
    seeded = SamplingParams(n=150, max_tokens=6, temperature=1.0, seed=123, ignore_eos=True)
    greedy = SamplingParams(n=40, max_tokens=6, ignore_eos=True)
    results = {}
    for max_num_seqs in (256, 16):
        llm = LLM(load_recipe(None, [f"model.path={model}", f"scheduler.max_num_seqs={max_num_seqs}",
                                     "cache.num_blocks=1024", "model.max_model_len=64", "model.threads=1"]))
        outs = llm.generate(prompts, seeded) + llm.generate(prompts[:1], greedy)
        assert all(o.error is None for o in outs)
        assert [len(o.outputs) for o in outs] == [150, 150, 40]
        assert all(c.index == i for o in outs for i, c in enumerate(o.outputs))
        results[max_num_seqs] = [[c.token_ids for c in o.outputs] for o in outs]
        engine = llm.engine
        engine.kv.check_invariants()
        assert engine.kv.num_free_gpu_blocks == engine.kv.num_gpu_blocks  # no block leaked
        assert not engine.generators
    assert results[16] == results[256]
    assert len({tuple(t) for t in results[16][0]}) > 100  # the seeded completions really differ


# ---------------------------------------------------------------- the command line

@pytest.fixture
def cli_run(model, tmp_path):
    def invoke(lines: list[dict], *extra: str):
        prompts = tmp_path / "p.jsonl"
        prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
        args = ["generate", str(prompts), "-o", str(tmp_path / "out.jsonl"), "-q", "--overwrite",
                "--set", f"model.path={model}", "--set", "cache.num_blocks=64", "--set", "model.max_model_len=32",
                "--set", "model.threads=1", *extra]
        return CliRunner().invoke(cli.app, args)
    return invoke


GOOD = {"prompt_token_ids": [5, 6, 7], "max_tokens": 2}
TOO_LONG = {"prompt_token_ids": [5] * 40}  # always an error record: longer than max_model_len


def test_exit_codes(cli_run, tmp_path):
    ok = cli_run([GOOD, GOOD])
    assert ok.exit_code == 0, ok.output
    some = cli_run([GOOD, TOO_LONG, GOOD])
    assert some.exit_code == 3, some.output
    assert "1 of 3 requests failed" in some.stderr and "exit code 3" in some.stderr
    every = cli_run([TOO_LONG, TOO_LONG])
    assert every.exit_code == 4, every.output
    assert "2 of 2 requests failed" in every.stderr
    records = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert len(records) == 2 and all("error" in r for r in records)
    user_error = cli_run([GOOD], "--set", "model.threads=100000")
    assert user_error.exit_code == 2
    assert user_error.stderr == "error: --set model.threads=100000: must be at most 1024 or null\n"


def test_cli_runs_n_above_max_num_seqs(cli_run, tmp_path):
    result = cli_run([{**GOOD, "n": 20, "seed": 1, "temperature": 1.0}], "--set", "scheduler.max_num_seqs=4")
    assert result.exit_code == 0, result.output
    (rec,) = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert len(rec["outputs"]) == 20


@pytest.mark.slow


def test_closed_terminal_pipe_does_not_end_the_job(model, tmp_path):
    n = 30
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"id": i, **GOOD}) + "\n" for i in range(n)))
    cmd = (f"{sys.executable} -m pagedrun generate p.jsonl -o out.jsonl --set model.path={model} "
           "--set cache.num_blocks=64 --set model.max_model_len=32 --set model.threads=1 2>&1 | head -1; "
           "exit ${PIPESTATUS[0]}")
    done = subprocess.run(["bash", "-c", cmd], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("\n") == 1  # head took one line; every later write met a closed pipe
    records = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert sorted(int(r["id"]) for r in records) == list(range(n))
    assert (tmp_path / "out.jsonl.report.json").is_file()


def nested_schema(depth: int, key: str) -> dict:
    s: dict = {"type": "string"}
    for _ in range(depth):
        s = {"type": "object", "properties": {"a": s}, "required": ["a"]} if key == "properties" else \
            {"type": "array", "items": s} if key == "items" else {"anyOf": [s, {"type": "null"}]}
    return s


@pytest.mark.parametrize("depth", [300, 450])  # 450: 900 JSON levels, what json.dumps can still write
@pytest.mark.parametrize("key", ["properties", "items", "anyOf"])
@pytest.mark.parametrize("as_text", [False, True])
def test_a_json_schema_nested_hundreds_of_levels_is_one_line(tmp_path, depth, key, as_text):
    """Issue 40 item 8: a schema nested 300 levels gave a RecursionError even with --skip-invalid."""
    schema = nested_schema(depth, key)
    line = {"prompt_token_ids": [5], "structured_outputs": {"json": json.dumps(schema) if as_text else schema}}
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"prompt_token_ids": [5]}) + "\n" + json.dumps(line) + "\n")
    requests, invalid = read(p, skip_invalid=True)
    assert len(requests) + len(invalid) == 2 and len(requests) >= 1
    for bad in invalid:
        assert bad.error.startswith("p.jsonl:2:") and "\n" not in bad.error and len(bad.error) < MAX_ERROR_CHARS
    if invalid:
        with pytest.raises(PagedrunError) as e:
            read(p)
        assert one_line(e).startswith("p.jsonl:2:")
