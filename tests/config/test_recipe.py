from pathlib import Path

import pytest

from pagedrun.config.recipe import CacheConfig, Recipe, load_recipe, parse_size
from pagedrun.errors import PagedrunError
from pagedrun.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str, name: str = "recipe.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return p


def error_of(path, overrides=()) -> str:
    with pytest.raises(PagedrunError) as e:
        load_recipe(path, list(overrides))
    msg = str(e.value)
    assert "\n" not in msg
    return msg


# ---------------------------------------------------------------- defaults

def test_builtin_defaults():
    r = load_recipe(None)
    assert r.model.path == "default" and r.model.dtype == "auto" and r.model.max_model_len is None
    assert r.model.generation_config == "auto"
    assert (r.model.device, r.model.attention_backend, r.model.threads) == ("auto", "auto", None)
    c = r.cache
    assert (c.block_size, c.kv_cache_memory, c.gpu_memory_utilization, c.num_blocks) == (16, 0.25, 0.9, None)
    assert (c.swap_space, c.enable_prefix_caching, c.watermark) == (1.0, True, 0.01)
    s = r.scheduler
    assert (s.max_num_seqs, s.max_num_batched_tokens, s.preemption_mode) == (64, 2048, "recompute")
    assert r.sampling == SamplingParams()
    assert (r.output.fsync_interval_s, r.output.report, r.seed) == (5.0, True, 0)
    assert (r.distributed.address, r.distributed.replicas) == (None, None)
    assert r.source is None


def test_default_yaml_matches_builtin_defaults():
    r = load_recipe(REPO / "recipes" / "default.yaml")
    assert r == load_recipe(None)
    assert r.fingerprint() == load_recipe(None).fingerprint()


def test_tiny_test_yaml_loads():
    r = load_recipe(REPO / "recipes" / "tiny-test.yaml")
    assert r.cache.block_size == 8 and r.cache.num_blocks == 64


def test_empty_recipe_means_defaults(tmp_path):
    assert load_recipe(write(tmp_path, "# nothing\n")) == Recipe()
    assert load_recipe(write(tmp_path, "cache:\nsampling:\n")) == Recipe()


def test_values_are_loaded(tmp_path):
    p = write(tmp_path, """
model: {dtype: bf16, max_model_len: 1024, device: cpu, attention_backend: torch, threads: 2}
cache: {block_size: 32, kv_cache_memory: 512MiB, num_blocks: 100, swap_space: 0, enable_prefix_caching: false}
scheduler: {max_num_seqs: 4, preemption_mode: swap}
sampling: {temperature: 1e-5, top_k: -1, stop: END, max_tokens: 32}
output: {fsync_interval_s: 1, report: false}
seed: 7
distributed: {address: auto, replicas: 2}
""")
    r = load_recipe(p)
    assert r.model.dtype == "bfloat16" and r.model.max_model_len == 1024 and r.model.threads == 2
    assert r.cache.block_size == 32 and r.cache.kv_cache_memory == 512 * 2**20
    assert r.cache.swap_space == 0.0 and isinstance(r.cache.swap_space, float)
    assert r.cache.enable_prefix_caching is False and r.scheduler.preemption_mode == "swap"
    assert r.sampling.temperature == 1e-5  # YAML 1.1 would read 1e-5 as a string
    assert r.sampling.top_k == 0 and r.sampling.stop == ["END"] and r.sampling.max_tokens == 32
    assert r.output.fsync_interval_s == 1.0 and r.output.report is False
    assert r.seed == 7 and r.distributed.address == "auto" and r.distributed.replicas == 2
    assert r.source == p


# ---------------------------------------------------------------- file errors

@pytest.mark.parametrize("text,expected", [
    ("cache:\n  block_size: 12\n", "recipe.yaml: cache.block_size: must be one of 8, 16, 32, got 12"),
    ("cache:\n  blok_size: 16\n", "recipe.yaml: cache.blok_size: unknown key (did you mean block_size?)"),
    ("cach:\n  block_size: 16\n", "recipe.yaml: cach: unknown key (did you mean cache?)"),
    ("cache: 16\n", "recipe.yaml: cache: must be a mapping, got 16"),
    ("cache:\n  block_size: '16'\n", "recipe.yaml: cache.block_size: must be an integer (one of 8, 16, 32), got '16'"),
    ("cache:\n  gpu_memory_utilization: 1.5\n", "recipe.yaml: cache.gpu_memory_utilization: must be a number in (0, 1], got 1.5"),
    ("cache:\n  gpu_memory_utilization: 0\n", "recipe.yaml: cache.gpu_memory_utilization: must be a number in (0, 1], got 0"),
    ("cache:\n  watermark: 1.0\n", "recipe.yaml: cache.watermark: must be a number in [0, 1), got 1.0"),
    ("cache:\n  num_blocks: 0\n", "recipe.yaml: cache.num_blocks: must be an integer >= 1 or null, got 0"),
    ("cache:\n  swap_space: -1\n", "recipe.yaml: cache.swap_space: must be a number of GiB >= 0, got -1"),
    ("cache:\n  enable_prefix_caching: 1\n", "recipe.yaml: cache.enable_prefix_caching: must be true or false, got 1"),
    ("model:\n  dtype: int8\n", "recipe.yaml: model.dtype: must be one of auto, float32, bfloat16, float16, got 'int8'"),
    ("model:\n  max_model_len: 8\n", "recipe.yaml: model.max_model_len: must be an integer >= 16 or null, got 8"),
    ("model:\n  device: tpu\n", "recipe.yaml: model.device: must be one of auto, cpu, cuda, got 'tpu'"),
    ("model:\n  attention_backend: flash\n",
     "recipe.yaml: model.attention_backend: must be one of auto, torch, cupy, emulated, got 'flash'"),
    ("model:\n  threads: 0\n", "recipe.yaml: model.threads: must be an integer >= 1 or null, got 0"),
    ("scheduler:\n  max_num_seqs: true\n", "recipe.yaml: scheduler.max_num_seqs: must be an integer >= 1, got True"),
    ("scheduler:\n  max_num_batched_tokens: 0\n",
     "recipe.yaml: scheduler.max_num_batched_tokens: must be an integer >= 1, got 0"),
    ("scheduler:\n  preemption_mode: evict\n",
     "recipe.yaml: scheduler.preemption_mode: must be one of recompute, swap, got 'evict'"),
    ("sampling:\n  temperature: -1\n", "recipe.yaml: sampling.temperature: must be a number >= 0 (0 = greedy), got -1"),
    ("sampling:\n  tempreature: 1\n", "recipe.yaml: sampling.tempreature: unknown key (did you mean temperature?)"),
    ("sampling:\n  min_tokens: 300\n", "recipe.yaml: sampling.min_tokens: must be <= max_tokens (256), got 300"),
    ("output:\n  fsync_interval_s: -1\n", "recipe.yaml: output.fsync_interval_s: must be a number of seconds >= 0, got -1"),
    ("seed: 1.5\n", "recipe.yaml: seed: must be an integer in 0..2**64-1, got 1.5"),
    ("distributed:\n  replicas: 0\n", "recipe.yaml: distributed.replicas: must be an integer >= 1 or null, got 0"),
    ("distributed:\n  address: ''\n", "recipe.yaml: distributed.address: must be a non-empty string or null, got ''"),
])
def test_file_errors_name_file_line_and_key_path(tmp_path, text, expected):
    # The message names the line of the offending key (found here by its name in the text).
    keypath = expected.split(": ")[1]
    line = next(i for i, t in enumerate(text.splitlines(), 1) if t.strip().startswith(keypath.split(".")[-1] + ":"))
    assert error_of(write(tmp_path, text)) == expected.replace("recipe.yaml: ", f"recipe.yaml:{line}: ", 1)


@pytest.mark.parametrize("value,ok", [
    ("0.5", 0.5), ("1.0", 1.0), ("2GiB", 2 * 2**30), ("'512 MiB'", 512 * 2**20), ("1048576", 2**20), ("null", None),
])
def test_kv_cache_memory_forms(tmp_path, value, ok):
    r = load_recipe(write(tmp_path, f"cache:\n  kv_cache_memory: {value}\n"))
    assert r.cache.kv_cache_memory == ok


@pytest.mark.parametrize("value", ["1", "0.0", "1.5", "lots", "0", "100KiB"])
def test_kv_cache_memory_rejects(tmp_path, value):
    msg = error_of(write(tmp_path, f"cache:\n  kv_cache_memory: {value}\n"))
    assert msg.startswith("recipe.yaml:2: cache.kv_cache_memory: must be a fraction 0 < x <= 1")


def test_kv_cache_bytes():
    assert CacheConfig(kv_cache_memory=0.5).kv_cache_bytes(1000 * 2**20) == 500 * 2**20
    assert CacheConfig(kv_cache_memory=None).kv_cache_bytes(4 * 2**20) == 2**20
    assert CacheConfig(kv_cache_memory=3 * 2**20).kv_cache_bytes(1 << 40) == 3 * 2**20


def test_yaml_not_a_mapping(tmp_path):
    assert error_of(write(tmp_path, "- a\n- b\n")).startswith("recipe.yaml: must be a mapping of sections")


def test_invalid_yaml_gives_line_and_column(tmp_path):
    msg = error_of(write(tmp_path, "cache:\n  block_size: [16\n"))
    assert msg.startswith("recipe.yaml:") and "invalid YAML" in msg


def test_duplicate_key(tmp_path):
    msg = error_of(write(tmp_path, "cache:\n  block_size: 16\n  block_size: 32\n"))
    assert msg == "recipe.yaml:3: block_size: duplicate key (first on line 2)"


def test_missing_file(tmp_path):
    msg = error_of(tmp_path / "nope.yaml")
    assert msg.startswith("nope.yaml: recipe file not found")


def test_directory_instead_of_file(tmp_path):
    assert "is a directory" in error_of(tmp_path)


def test_non_utf8_file(tmp_path):
    p = tmp_path / "recipe.yaml"
    p.write_bytes(b"cache:\n  block_size: 16\n# caf\xe9\n")
    assert error_of(p) == "recipe.yaml:3: not valid UTF-8 (byte 0xe9)"


def test_model_path_relative_to_recipe_dir(tmp_path, monkeypatch):
    (tmp_path / "models" / "m").mkdir(parents=True)
    sub = tmp_path / "recipes"
    sub.mkdir()
    monkeypatch.chdir(tmp_path / "models")  # the CWD must not matter for a path in a file
    r = load_recipe(write(sub, "model:\n  path: ../models/m\n"))
    assert r.model.path == str((tmp_path / "models" / "m").resolve())


def test_model_path_missing(tmp_path):
    msg = error_of(write(tmp_path, "model:\n  path: no/such/dir\n"))
    assert msg.startswith("recipe.yaml:2: model.path: must be \"default\", an existing model directory or a "
                          "Hugging Face id in the local cache;")
    assert str(tmp_path / "no/such/dir") in msg


# ---------------------------------------------------------------- --set

def test_set_overrides_nested_values_after_the_file(tmp_path):
    p = write(tmp_path, "cache:\n  block_size: 8\nsampling:\n  temperature: 0.5\n")
    r = load_recipe(p, ["cache.block_size=32", "sampling.stop=[\".\", END]", "seed=3",
                        "cache.kv_cache_memory=2GiB", "model.max_model_len=null", "sampling.seed=5"])
    assert r.cache.block_size == 32 and r.sampling.temperature == 0.5
    assert r.sampling.stop == [".", "END"] and r.seed == 3 and r.sampling.seed == 5
    assert r.cache.kv_cache_memory == 2 * 2**30 and r.model.max_model_len is None


def test_set_later_wins_and_whole_section():
    r = load_recipe(None, ["cache.block_size=8", "cache.block_size=32", "scheduler={max_num_seqs: 2}"])
    assert r.cache.block_size == 32 and r.scheduler.max_num_seqs == 2
    assert r.scheduler.max_num_batched_tokens == 2048  # a section override merges


def test_set_empty_value_is_null():
    assert load_recipe(None, ["cache.num_blocks=5", "cache.num_blocks="]).cache.num_blocks is None


def test_set_model_path_relative_to_cwd(tmp_path, monkeypatch):
    (tmp_path / "m").mkdir()
    monkeypatch.chdir(tmp_path)
    assert load_recipe(None, ["model.path=m"]).model.path == str((tmp_path / "m").resolve())


@pytest.mark.parametrize("item,expected", [
    ("cache.block_size=abc", "--set cache.block_size=abc: must be an integer (one of 8, 16, 32)"),
    ("cache.block_size=12", "--set cache.block_size=12: must be one of 8, 16, 32"),
    ("cache.blok_size=16", "--set cache.blok_size=16: unknown key (did you mean block_size?)"),
    ("cach.block_size=16", "--set cach.block_size=16: unknown key cach.block_size (did you mean cache.block_size?)"),
    ("cache.block_size.x=16", "--set cache.block_size.x=16: unknown key cache.block_size.x (did you mean cache.block_size?)"),
    ("sede=1", "--set sede=1: unknown key (did you mean seed?)"),
    ("sampling.temperature=-1", "--set sampling.temperature=-1: must be a number >= 0 (0 = greedy)"),
    ("scheduler.max_num_seqs=true", "--set scheduler.max_num_seqs=true: must be an integer >= 1"),
    ("cache={block_size: 7}", "--set cache={block_size: 7}: cache.block_size: must be one of 8, 16, 32"),
    ("cache=7", "--set cache=7: must be a mapping, got 7"),
    ("sampling.min_tokens=300", "--set sampling.min_tokens=300: must be <= max_tokens (256), got 300"),
    ("block_size", "--set block_size: expected key.path=value, e.g. cache.block_size=32"),
    ("=3", "--set =3: expected key.path=value, e.g. cache.block_size=32"),
])
def test_set_errors(item, expected):
    assert error_of(None, [item]) == expected


def test_set_bad_yaml_value():
    msg = error_of(None, ["sampling.stop=[a, b"])
    assert msg.startswith("--set sampling.stop=[a, b: value is not valid YAML:")


def test_set_error_wins_over_nothing_in_file(tmp_path):
    # the file is fine; the override is named, not the file
    p = write(tmp_path, "cache:\n  block_size: 16\n")
    assert error_of(p, ["cache.watermark=2"]).startswith("--set cache.watermark=2: ")


# ---------------------------------------------------------------- sizes

@pytest.mark.parametrize("text,n", [
    ("2GiB", 2 * 2**30), ("512MiB", 512 * 2**20), ("1KiB", 1024), ("1TiB", 2**40),
    ("2G", 2 * 2**30), ("2gib", 2 * 2**30), ("2GB", 2 * 10**9), ("3kb", 3000), ("1.5GiB", 3 * 2**29),
    ("100", 100), ("100B", 100), (" 4 MiB ", 4 * 2**20),
])
def test_parse_size(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize("text", ["", "GiB", "2XB", "2 GiBs", "-1GiB", "2iB", "two"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        parse_size(text)


# ---------------------------------------------------------------- fingerprint

def test_fingerprint_is_stable():
    a = load_recipe(None).fingerprint()
    assert a == load_recipe(None).fingerprint()
    assert len(a) == 64 and int(a, 16) >= 0
    # same settings spelled differently -> same fingerprint
    assert load_recipe(None, ["cache.kv_cache_memory=1GiB"]).fingerprint() == \
        load_recipe(None, ["cache.kv_cache_memory=1073741824"]).fingerprint()
    assert load_recipe(None, ["sampling.stop=x"]).fingerprint() == \
        load_recipe(None, ["sampling.stop=[x]"]).fingerprint()


@pytest.mark.parametrize("item", [
    "cache.block_size=32", "sampling.temperature=0.5", "seed=1", "model.dtype=bfloat16",
    "scheduler.max_num_seqs=8", "cache.enable_prefix_caching=false", "sampling.stop=[x]",
    "structured_outputs.disable_additional_properties=false",
])
def test_fingerprint_changes_with_settings(item):
    assert load_recipe(None, [item]).fingerprint() != load_recipe(None).fingerprint()


def test_fingerprint_ignores_output_settings():
    # fsync cadence and the report flag change no generated token: resume must still accept them
    assert load_recipe(None, ["output.fsync_interval_s=1", "output.report=false"]).fingerprint() == \
        load_recipe(None).fingerprint()


def test_to_dict_is_plain_data():
    import json
    d = load_recipe(None).to_dict()
    assert set(d) == {"model", "cache", "scheduler", "sampling", "output", "seed", "distributed",
                      "structured_outputs"}
    json.dumps(d)  # serialisable as is


def test_null_leaves_a_sampling_default_to_the_model_and_only_those(tmp_path):
    # temperature, top_p, top_k, min_p, repetition_penalty, max_tokens: null = the model's
    # generation_config.json, else pagedrun's default (models/model_defaults.py)
    r = load_recipe(write(tmp_path, "sampling:\n  temperature: null\n  top_p: 0.9\n"))
    assert r.sampling.temperature == 0.0 and r.explicit_sampling == {"top_p"}
    r = load_recipe(None, ["sampling.temperature=0.5", "sampling.temperature=null"])  # a later null unsets
    assert r.sampling.temperature == 0.0 and r.explicit_sampling == frozenset()
    assert "sampling.n: must be an integer >= 1" in error_of(write(tmp_path, "sampling:\n  n: null\n"))
    assert "model.generation_config: must be auto, vllm or a folder" in \
        error_of(write(tmp_path, "model:\n  generation_config: nowhere\n"))
