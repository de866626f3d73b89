"""`pagedrun generate` and `profile-memory` take vLLM's flags for the common settings; each sets
exactly its recipe key, after the recipe and --set (pagedrun/config/engine_args.py)."""
from __future__ import annotations

import pytest
from typer.testing import CliRunner

from pagedrun.cli.app import app
from pagedrun.config.engine_args import ENGINE_ARGS, NEGATED_ARGS
from pagedrun.config.recipe import load_recipe

# flag, value on the command line, the recipe key's value after parsing
FLAGS = [
    ("--model", "MODEL_DIR", "MODEL_DIR"),  # an existing directory: tmp_path
    ("--dtype", "bfloat16", "bfloat16"),
    ("--max-model-len", "128", 128),
    ("--max-num-seqs", "3", 3),
    ("--max-num-batched-tokens", "512", 512),
    ("--async-scheduling", None, "true"),
    ("--no-async-scheduling", None, "false"),
    ("--gpu-memory-utilization", "0.5", 0.5),
    ("--kv-cache-dtype", "int8", "int8"),
    ("--block-size", "32", 32),
    ("--no-enable-prefix-caching", None, False),
    ("--seed", "9", 9),
    ("--disable-hybrid-kv-cache-manager", None, False),  # sets cache.hybrid_kv to the opposite
    ("--generation-config", "vllm", "vllm"),
]


def _captured(monkeypatch, command: str, target: str, args: list[str]) -> list[str]:
    seen = {}

    def fake(**kwargs):
        seen.update(kwargs)
        return 0

    monkeypatch.setattr(target, fake)
    res = CliRunner().invoke(app, [command, *args])
    assert res.exit_code == 0, res.output
    return seen["overrides"]


@pytest.mark.parametrize("command, target, lead", [
    ("generate", "pagedrun.cli.generate.run_generate", ["p.jsonl"]),
    ("profile-memory", "pagedrun.cli.profile_memory.run_profile_memory", []),
])
@pytest.mark.parametrize("flag, value, want", FLAGS, ids=[f[0] for f in FLAGS])
def test_each_flag_sets_its_recipe_key(monkeypatch, tmp_path, command, target, lead, flag, value, want):
    if value == "MODEL_DIR":
        value = want = str(tmp_path)
    overrides = _captured(monkeypatch, command, target, [*lead, flag, *([value] if value is not None else [])])
    name = flag.removeprefix("--no-").removeprefix("--").replace("-", "_")
    key = ENGINE_ARGS.get(name) or NEGATED_ARGS[name]
    recipe = load_recipe(None, overrides)
    got = recipe
    for part in key.split("."):
        got = getattr(got, part)
    assert got == want and len(overrides) == 1 and overrides[0].startswith(key + "=")


def test_every_flag_is_tested_and_flags_come_after_set(monkeypatch):
    named = {f.removeprefix("--no-").removeprefix("--").replace("-", "_") for f, _, _ in FLAGS}
    assert named == set(ENGINE_ARGS) - {"device", "kv_cache_memory", "num_gpu_blocks_override", "swap_space"} \
        | set(NEGATED_ARGS)
    overrides = _captured(monkeypatch, "generate", "pagedrun.cli.generate.run_generate",
                          ["p.jsonl", "--set", "scheduler.max_num_seqs=7", "--max-num-seqs", "5"])
    assert load_recipe(None, overrides).scheduler.max_num_seqs == 5  # the flag wins, as a later --set would


def test_a_bad_flag_value_is_the_recipe_keys_one_line_error(tmp_path):
    res = CliRunner().invoke(app, ["profile-memory", "--block-size", "7"])
    assert res.exit_code == 2
    lines = [x for x in res.output.splitlines() if x.strip()]
    assert len(lines) == 1 and "cache.block_size" in lines[0], res.output


def test_generation_config_takes_a_folder_and_refuses_one_without_the_file(monkeypatch, tmp_path):
    (tmp_path / "generation_config.json").write_text("{}")
    overrides = _captured(monkeypatch, "generate", "pagedrun.cli.generate.run_generate",
                          ["p.jsonl", "--generation-config", str(tmp_path)])
    assert load_recipe(None, overrides).model.generation_config == str(tmp_path.resolve())
    res = CliRunner().invoke(app, ["profile-memory", "--generation-config", str(tmp_path / "nowhere")])
    assert res.exit_code == 2 and "model.generation_config" in res.output and "generation_config.json" in res.output
