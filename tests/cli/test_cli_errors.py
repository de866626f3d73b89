"""Bad input to `pagedrun generate`: one line on stderr naming file, line and field, a non-zero
exit, no traceback (`--debug` shows it); `--skip-invalid` turns line errors into error records."""
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

ROOT = Path(__file__).resolve().parents[2]
GOOD = '{"id": "a", "prompt_token_ids": [5, 6, 7], "max_tokens": 2}'
SETS = ["cache.num_blocks=16", "model.max_model_len=64", "scheduler.max_num_batched_tokens=64"]


@pytest.fixture(scope="module")
def model(tiny_model) -> Path:
    return tiny_model("llama")


@pytest.fixture
def run(model, tmp_path, monkeypatch):
    """Invoke the CLI in-process; the model is loaded once for the module (errors in prompts are
    found after loading), and the console is narrow so that any wrapping would show."""
    import torch

    from pagedrun import llm as llm_module

    real = llm_module.LLM
    cache = run.__dict__.setdefault("cache", {})

    def cached_llm(recipe, *a, **kw):
        if recipe.model.path != str(model.resolve()):
            return real(recipe, *a, **kw)  # the model-directory errors need a real load
        key = recipe.fingerprint()
        if key not in cache:
            cache[key] = real(recipe, *a, **kw)
        return cache[key]

    monkeypatch.setattr(llm_module, "LLM", cached_llm)
    monkeypatch.setattr(cli.console, "_width", 40)  # the private field: undo must restore "auto"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny model: one thread is fastest, and no spinning on a busy machine

    def invoke(lines: list[str] | bytes | None = None, *extra: str, model_dir: Path | None = None):
        prompts = tmp_path / "p.jsonl"
        if lines is not None:
            prompts.write_bytes(lines if isinstance(lines, bytes) else ("\n".join(lines) + "\n").encode())
        args = ["generate", str(prompts), "-o", str(tmp_path / "out.jsonl"), "-q",
                "--set", f"model.path={model_dir or model}", *extra]
        for s in SETS:
            args += ["--set", s]
        return CliRunner().invoke(cli.app, args)

    yield invoke
    torch.set_num_threads(threads)


def assert_one_line_error(result, prefix: str) -> str:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    err = result.stderr
    assert err.startswith(f"error: {prefix}"), err
    assert err.count("\n") == 1 and err.endswith("\n"), err  # one line, even at 40 columns
    return err


# (second line of the prompts file, the error after "error: ")
LINE_ERRORS = [
    ('{"prompt_token_ids": [1, 2', "p.jsonl:2: invalid JSON: "),
    ("[1, 2]", "p.jsonl:2: must be a JSON object, got an array"),
    ('"just a string"', "p.jsonl:2: must be a JSON object, got a string"),
    ('{"max_tokens": 3}', 'p.jsonl:2: prompt: missing: each line needs one of "prompt", "messages", "prompt_token_ids"'),
    ('{"prompt_token_ids": "5 6"}', "p.jsonl:2: prompt_token_ids: must be a list of integers, got a string"),
    ('{"prompt_token_ids": [5, 6.5]}', "p.jsonl:2: prompt_token_ids: must be a list of integers; index 1 is 6.5"),
    ('{"prompt": 5}', "p.jsonl:2: prompt: must be a string, got a number"),
    ('{"prompt_token_ids": [5], "max_tokens": "8"}', "p.jsonl:2: max_tokens: "),
    ('{"prompt_token_ids": [5], "temperature": "hot"}', "p.jsonl:2: temperature: "),
    ('{"id": [1], "prompt_token_ids": [5]}', "p.jsonl:2: id: must be a non-empty string or an integer"),
    ('{"prompt_token_ids": [5], "temperature": -0.5}', "p.jsonl:2: temperature: "),
    ('{"prompt_token_ids": [5], "top_p": 0}', "p.jsonl:2: top_p: "),
    ('{"prompt_token_ids": [5], "top_p": 1.5}', "p.jsonl:2: top_p: "),
    ('{"prompt_token_ids": [5], "max_tokens": 0}', "p.jsonl:2: max_tokens: "),
    ('{"prompt_token_ids": [5], "n": 0}', "p.jsonl:2: n: "),
    ('{"prompt_token_ids": [5, 640]}', "p.jsonl:2: prompt_token_ids: token id 640 at index 1 is outside [0, 640)"),
    ('{"prompt_token_ids": [-1]}', "p.jsonl:2: prompt_token_ids: token id -1 at index 0 is outside [0, 640)"),
    ('{"id": "a", "prompt_token_ids": [5]}', "p.jsonl:2: id: duplicate id 'a' (first used on line 1)"),
    ('{"prompt_token_ids": [5], "tempreature": 1}', "p.jsonl:2: tempreature: unknown field (did you mean temperature?)"),
]


@pytest.mark.parametrize("line, expected", LINE_ERRORS, ids=[e.split(": ")[1] + f"-{i}" for i, (_, e) in
                                                              enumerate(LINE_ERRORS)])
def test_bad_line_is_one_line_error_naming_file_line_field(run, line, expected):
    assert_one_line_error(run([GOOD, line]), expected)


def test_user_text_is_printed_verbatim_not_as_markup(run):
    result = run([GOOD, '{"prompt_token_ids": [5], "max_tokens": "[/bold] [red]x :smile:"}'])
    err = assert_one_line_error(result, "p.jsonl:2: max_tokens: ")
    assert err.rstrip("\n").endswith("got '[/bold] [red]x :smile:'")


def test_non_utf8_line(run):
    result = run(GOOD.encode() + b'\n{"id": "caf\xe9", "prompt_token_ids": [5]}\n')
    assert_one_line_error(result, "p.jsonl:2: not valid UTF-8 (byte 0xe9 at column 12)")


@pytest.mark.parametrize("content", [b"", b"\n  \n\n"])
def test_empty_prompts_file(run, content):
    assert_one_line_error(run(content), "p.jsonl: no requests")


def test_missing_prompts_file(run, tmp_path):
    assert_one_line_error(run(None), f"{tmp_path / 'p.jsonl'}: prompts file not found")


def test_output_that_is_the_prompts_file_is_refused(run, tmp_path):
    result = run([GOOD], "-o", str(tmp_path / "p.jsonl"), "--overwrite")
    assert_one_line_error(result, f"{tmp_path / 'p.jsonl'}: -o is the prompts file")
    assert (tmp_path / "p.jsonl").read_text() == GOOD + "\n"


def test_skip_invalid_turns_every_line_error_into_a_record(run, tmp_path):
    bad = [line for line, _ in LINE_ERRORS]
    result = run([GOOD, *bad], "--skip-invalid")
    assert result.exit_code == 3, result.output  # some requests failed
    records = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert len(records) == 1 + len(bad)
    assert records[0]["id"] == "a" and len(records[0]["token_ids"]) == 2
    for i, (rec, (_, expected)) in enumerate(zip(records[1:], LINE_ERRORS)):
        assert rec["line"] == i + 2, rec
        assert rec["error"].startswith(expected.replace("p.jsonl:2:", f"p.jsonl:{i + 2}:")), rec
    duplicate = records[1 + [e for _, e in LINE_ERRORS].index("p.jsonl:2: id: duplicate id 'a' (first used on line 1)")]
    assert duplicate["id"] == "a" and "token_ids" not in duplicate  # kept apart from the real "a"


# ---------------------------------------------------------------- recipe

@pytest.mark.parametrize("text, expected", [
    ("cache:\n  blok_size: 16\n", "recipe.yaml:2: cache.blok_size: unknown key (did you mean block_size?)"),
    ("sampling:\n  temperature: warm\n", "recipe.yaml:2: sampling.temperature: must be a number"),
    ("scheduler:\n  max_num_seqs: [4]\n", "recipe.yaml:2: scheduler.max_num_seqs: must be an integer >= 1, got [4]"),
    ("cache: [1\n", "recipe.yaml:2:1: invalid YAML: "),
])
def test_bad_recipe(run, tmp_path, text, expected):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(text)
    assert_one_line_error(run([GOOD], "-r", str(recipe)), expected)


# ---------------------------------------------------------------- model directory

def copy_model(model: Path, dest: Path, skip: str = "") -> Path:
    shutil.copytree(model, dest, ignore=shutil.ignore_patterns(skip) if skip else None)
    return dest


def test_model_dir_without_config(run, model, tmp_path):
    d = copy_model(model, tmp_path / "m", skip="config.json")
    assert_one_line_error(run([GOOD], model_dir=d), f"{d}/config.json: not found")


def test_model_dir_without_weights(run, model, tmp_path):
    d = copy_model(model, tmp_path / "m", skip="*.safetensors")
    assert_one_line_error(run([GOOD], model_dir=d), f"{d}: no *.safetensors weight files found")


def test_bin_only_model_dir_is_refused_with_how_to_convert(run, model, tmp_path):
    d = copy_model(model, tmp_path / "m", skip="*.safetensors")
    (d / "pytorch_model.bin").write_bytes(b"a pickle would run code on load; it must never be opened")
    err = assert_one_line_error(run([GOOD], model_dir=d), f"{d}: only pytorch_model*.bin weights found")
    assert "safetensors" in err and "save_pretrained" in err and "safe_serialization=True" in err


def test_weights_not_matching_the_config(run, model, tmp_path):
    d = copy_model(model, tmp_path / "m")
    config = json.loads((d / "config.json").read_text())
    config["intermediate_size"] = 96
    (d / "config.json").write_text(json.dumps(config))
    err = assert_one_line_error(run([GOOD], model_dir=d), f"{d}: ")
    assert "mlp" in err and "shape mismatch: model expects [" in err and "96" in err and "160" in err


def test_corrupt_safetensors(run, model, tmp_path):
    d = copy_model(model, tmp_path / "m")
    (d / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage")
    assert_one_line_error(run([GOOD], model_dir=d), f"{d}")


# ---------------------------------------------------------------- a real process

def cli_process(tmp_path: Path, *extra: str, columns: int = 30) -> subprocess.CompletedProcess:
    (tmp_path / "p.jsonl").write_text(GOOD + "\n")
    (tmp_path / "recipe.yaml").write_text("cache:\n  blok_size: 16\n")
    return subprocess.run([sys.executable, "-m", "pagedrun", "generate", "p.jsonl", "-r", "recipe.yaml", *extra],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": str(columns)})


def test_process_prints_one_unwrapped_line_without_traceback(tmp_path):
    done = cli_process(tmp_path)
    assert done.returncode == 2
    assert done.stderr == "error: recipe.yaml:2: cache.blok_size: unknown key (did you mean block_size?)\n"
    assert done.stdout == ""


def test_debug_shows_the_traceback(tmp_path):
    done = cli_process(tmp_path, "--debug")
    assert done.returncode != 0
    assert "Traceback (most recent call last)" in done.stderr
    assert "PagedrunError: recipe.yaml:2: cache.blok_size: unknown key" in done.stderr
