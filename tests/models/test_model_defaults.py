"""The model's own defaults (pagedrun/models/model_defaults.py): generation_config.json's sampling
fields under vLLM's `--generation-config auto`, and `dtype: auto`."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pagedrun.config.recipe import load_recipe
from pagedrun.errors import PagedrunError
from pagedrun.models import model_defaults
from pagedrun.models.model_defaults import (
    apply_model_defaults,
    checkpoint_dtype,
    read_generation_config,
    resolve_auto_dtype,
)
from pagedrun.sampling_params import SamplingParams, merged

# The default recipe's fingerprint before generation_config and dtype: auto existed (main at
# f08f568): a job started then resumes now wherever auto is float32 for the default model.
LEGACY_DEFAULT_FINGERPRINT = "380034a4f41f72b7ab4318e9280c6a1fe73234987d1836f3fb8e3ec374eb528a"


def model_with(tmp_path: Path, generation: dict | None, torch_dtype: str | None = "float32") -> Path:
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"]}
    if torch_dtype is not None:
        config["torch_dtype"] = torch_dtype
    (d / "config.json").write_text(json.dumps(config))
    if generation is not None:
        (d / "generation_config.json").write_text(json.dumps(generation))
    return d


def resolved(model: Path, *items: str):
    return apply_model_defaults(load_recipe(None, [f"model.path={model}", *items]))


QWEN3 = {"bos_token_id": 1, "do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95}


def test_generation_config_sets_the_defaults_the_recipe_leaves_unset(tmp_path):
    r = resolved(model_with(tmp_path, {**QWEN3, "max_new_tokens": 100, "repetition_penalty": 1.1, "min_p": 0.05}))
    s = r.sampling
    assert (s.temperature, s.top_k, s.top_p, s.max_tokens, s.repetition_penalty, s.min_p) == \
        (0.6, 20, 0.95, 100, 1.1, 0.05)
    assert r.model_defaults.applied == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05,
                                        "repetition_penalty": 1.1, "max_tokens": 100}
    line = r.model_defaults.generation_line()
    assert line.startswith("generation config: temperature=0.6, top_p=0.95, top_k=20")
    assert "generation_config.json" in line
    # A request's own field wins over the model's; the fields it omits take the model's.
    req = merged(s, {"temperature": 0.0}, "prompts.jsonl:1")
    assert (req.temperature, req.top_p) == (0.0, 0.95)


def test_precedence_recipe_over_generation_config_over_pagedrun(tmp_path):
    model = model_with(tmp_path, QWEN3)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("sampling:\n  temperature: 0.0\n  top_p: null\n")  # greedy pinned; top_p left to the model
    r = apply_model_defaults(load_recipe(recipe, [f"model.path={model}"]))
    assert (r.sampling.temperature, r.sampling.top_p, r.sampling.top_k) == (0.0, 0.95, 20)
    assert r.model_defaults.overridden == ["temperature"]
    # --set and engine arguments count as the recipe's
    r = resolved(model, "sampling.top_k=5")
    assert (r.sampling.top_k, r.sampling.temperature) == (5, 0.6)
    # untouched fields keep pagedrun's defaults
    assert r.sampling.max_tokens == SamplingParams().max_tokens


def test_vllm_mode_ignores_the_file_and_a_folder_replaces_it(tmp_path):
    model = model_with(tmp_path, QWEN3)
    r = resolved(model, "model.generation_config=vllm")
    assert r.sampling == SamplingParams() and "vllm" in r.model_defaults.generation_line()
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"temperature": 0.3}))
    r = resolved(model, f"model.generation_config={other}")
    assert (r.sampling.temperature, r.sampling.top_p) == (0.3, 1.0)


def test_transformers_default_values_and_token_ids_set_nothing(tmp_path):
    r = resolved(model_with(tmp_path, {"bos_token_id": 1, "eos_token_id": 2, "temperature": 1.0, "top_k": 50,
                                       "top_p": 1.0, "repetition_penalty": 1.0, "do_sample": False}))
    assert r.sampling == SamplingParams() and r.model_defaults.applied == {}
    assert r.model_defaults.generation_line().startswith("generation config: no sampling defaults")


def test_a_bad_value_is_one_line_naming_the_file_and_field(tmp_path):
    with pytest.raises(PagedrunError) as e:
        resolved(model_with(tmp_path, {"top_p": 1.5}))
    msg = str(e.value)
    assert "\n" not in msg and "generation_config.json: top_p: must be a number in (0, 1], got 1.5" in msg
    (tmp_path / "model" / "generation_config.json").write_text("{not json")
    with pytest.raises(PagedrunError, match=r"generation_config.json: cannot read JSON"):
        resolved(tmp_path / "model")


def test_fingerprint_unchanged_without_model_defaults_and_changed_by_them(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDRUN_AUTO_DTYPE", "float32")
    assert apply_model_defaults(load_recipe(None)).fingerprint() == LEGACY_DEFAULT_FINGERPRINT
    assert load_recipe(None, ["model.dtype=float32", "model.generation_config=vllm"]).fingerprint() == \
        LEGACY_DEFAULT_FINGERPRINT
    model = model_with(tmp_path, {"bos_token_id": 1})
    plain = resolved(model).fingerprint()
    assert plain == load_recipe(None, [f"model.path={model}", "model.dtype=float32"]).fingerprint()
    (model / "generation_config.json").write_text(json.dumps(QWEN3))
    sampled = resolved(model).fingerprint()
    assert sampled != plain  # the model's defaults are part of the job
    (model / "generation_config.json").write_text(json.dumps({**QWEN3, "temperature": 0.7}))
    assert resolved(model).fingerprint() not in (plain, sampled)  # a changed file: another job
    assert resolved(model, "model.generation_config=vllm").fingerprint() == plain


def test_default_yaml_leaves_the_model_defaults_to_the_model(tmp_path):
    model = model_with(tmp_path, QWEN3)
    repo = Path(__file__).resolve().parents[2]
    r = apply_model_defaults(load_recipe(repo / "recipes" / "default.yaml", [f"model.path={model}"]))
    assert (r.sampling.temperature, r.sampling.top_p) == (0.6, 0.95)


def test_dtype_auto(tmp_path, monkeypatch):
    monkeypatch.delenv("PAGEDRUN_AUTO_DTYPE", raising=False)
    monkeypatch.setattr(model_defaults, "_cuda_available", lambda: False)
    fp32 = model_with(tmp_path, None, "float32")
    monkeypatch.setattr(model_defaults, "cpu_bf16_arithmetic", lambda: True)
    assert resolve_auto_dtype(fp32, "auto")[0] == "bfloat16"
    assert resolve_auto_dtype(None, "cpu")[0] == "bfloat16"  # the default model: a float32 checkpoint
    monkeypatch.setattr(model_defaults, "cpu_bf16_arithmetic", lambda: False)
    assert resolve_auto_dtype(fp32, "cpu") == ("float32", "auto: the checkpoint's float32")
    bf16 = model_with(tmp_path / "b", None, "bfloat16") if (tmp_path / "b").mkdir() is None else None
    assert resolve_auto_dtype(bf16, "cpu")[0] == "bfloat16"
    assert checkpoint_dtype(model_with(tmp_path / "b", None, None)) == "float32"
    monkeypatch.setattr(model_defaults, "cpu_bf16_arithmetic", lambda: True)
    monkeypatch.setenv("PAGEDRUN_AUTO_DTYPE", "float32")
    assert resolve_auto_dtype(fp32, "cpu")[0] == "float32"
    r = resolved(fp32, "model.dtype=bfloat16")
    assert r.model.dtype == "bfloat16" and r.model_defaults.dtype_note is None


def test_an_llm_applies_them_and_requests_default_to_them(tiny_model, tmp_path):
    from pagedrun.llm import LLM

    model = tmp_path / "m"
    shutil.copytree(tiny_model("llama"), model)
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.9, "bos_token_id": 1}))
    llm = LLM(model=str(model), max_model_len=64)
    assert llm.recipe.model.dtype == "float32"  # PAGEDRUN_AUTO_DTYPE=float32 (tests/conftest.py)
    [req] = llm.make_requests([[5, 6, 7]])
    assert (req.sampling.temperature, req.sampling.top_p) == (0.6, 0.9)
    [req] = llm.make_requests([[5, 6, 7]], SamplingParams(max_tokens=4))  # given params are used as given
    assert req.sampling.temperature == 0.0


def test_generate_says_what_applies_and_a_changed_file_is_another_job(tiny_model, tmp_path):
    from typer.testing import CliRunner

    from pagedrun.cli.app import app

    model = tmp_path / "m"
    shutil.copytree(tiny_model("llama"), model)
    gen = model / "generation_config.json"
    gen.write_text(json.dumps({"temperature": 0.6, "top_p": 0.95, "bos_token_id": 1}))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt_token_ids": [5, 6, 7], "max_tokens": 3}) + "\n")
    out = tmp_path / "o.jsonl"
    args = ["generate", str(prompts), "--model", str(model), "-o", str(out), "--max-model-len", "64"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert f"generation config: temperature=0.6, top_p=0.95 from {gen}" in " ".join(res.output.split())
    res = CliRunner().invoke(app, args)  # the same defaults: a resume with nothing to do
    assert res.exit_code == 0 and "nothing to do" in res.output, res.output
    gen.write_text(json.dumps({"temperature": 0.7}))
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2 and "different recipe" in res.output, res.output
    res = CliRunner().invoke(app, [*args, "--generation-config", "vllm", "--overwrite"])
    assert res.exit_code == 0 and "generation config: vllm" in res.output, res.output


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_the_suites_models_set_no_sampling_defaults(tiny_model, family):
    """The tiny checkpoints' generation_config.json (transformers' own) holds token ids only: every
    test that expects greedy outputs still gets them under generation_config: auto."""
    assert resolved(tiny_model(family)).model_defaults.applied == {}


def test_the_default_model_sets_no_sampling_defaults(default_model):
    """Its generation_config.json (written by the GGUF conversion) holds token ids only: the README's
    first command and the default-model tests stay greedy."""
    assert read_generation_config(default_model / "generation_config.json") == {}
    assert checkpoint_dtype(default_model) == "float32"


def test_cuda_scheduler_defaults_where_the_recipe_leaves_them_unset(tmp_path, monkeypatch):
    """On CUDA max_num_seqs and max_num_batched_tokens default to vLLM's (256, 8192) unless the recipe,
    a flag or an engine argument sets them; the CPU keeps 64 and 2048, and its fingerprint."""
    from pagedrun.config.recipe import Recipe, SchedulerConfig

    model = model_with(tmp_path, None)
    monkeypatch.setattr(model_defaults, "_cuda_available", lambda: False)
    cpu = resolved(model)
    assert (cpu.scheduler.max_num_seqs, cpu.scheduler.max_num_batched_tokens) == (64, 2048)
    assert cpu.model_defaults.scheduler_note is None
    monkeypatch.setattr(model_defaults, "_cuda_available", lambda: True)
    monkeypatch.setattr(model_defaults, "_cuda_bf16", lambda: True)
    gpu = resolved(model)
    assert (gpu.scheduler.max_num_seqs, gpu.scheduler.max_num_batched_tokens) == (256, 8192)
    assert gpu.scheduler.admission_burst == 16
    assert "max_num_seqs 256, max_num_batched_tokens 8192" in gpu.model_defaults.scheduler_note
    # recipes/default.yaml leaves them null: the device's defaults
    repo = Path(__file__).resolve().parents[2]
    yaml = apply_model_defaults(load_recipe(repo / "recipes" / "default.yaml", [f"model.path={model}"]))
    assert (yaml.scheduler.max_num_seqs, yaml.scheduler.admission_burst) == (256, 16)
    assert yaml.fingerprint() == gpu.fingerprint()
    assert gpu.fingerprint() != cpu.fingerprint()  # what runs differs: another job
    # a value the recipe sets stays, even the CPU default itself
    kept = resolved(model, "scheduler.max_num_seqs=64")
    assert (kept.scheduler.max_num_seqs, kept.scheduler.max_num_batched_tokens) == (64, 8192)
    assert resolved(model, "model.device=cpu").scheduler.max_num_seqs == 64
    # a Recipe built in Python: a field away from its default counts as set
    py = apply_model_defaults(Recipe(scheduler=SchedulerConfig(max_num_seqs=32)))
    assert (py.scheduler.max_num_seqs, py.scheduler.max_num_batched_tokens) == (32, 8192)
