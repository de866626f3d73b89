"""The model's own defaults, as vLLM applies them: `dtype: auto` and generation_config.json.

`model.dtype: auto` is the checkpoint's torch_dtype (config.json), except that a float32 checkpoint
runs in bfloat16 where the device has bf16 arithmetic (CUDA with bf16, a CPU with avx512_bf16 or
AMX: pagedrun/build/cpu.py's flags), as vLLM's `--dtype auto` does; float32 elsewhere.
PAGEDRUN_AUTO_DTYPE=float32 keeps float32 checkpoints in float32 everywhere (the test suite sets it,
so its comparisons with HF's float32 outputs hold on every machine).

`model.generation_config: auto` (vLLM's `--generation-config auto`, the default) reads the model's
generation_config.json: its temperature, top_p, top_k, min_p, repetition_penalty and max_new_tokens
(as max_tokens) become the defaults of every request, for the fields the recipe's `sampling`
section leaves unset; as transformers' `to_diff_dict` does for vLLM, a value equal to
transformers' own default (temperature 1, top_p 1, top_k 50, repetition_penalty 1) is no default.
`vllm` ignores the file; a folder reads that folder's generation_config.json instead. Precedence,
highest first: a request's field, the recipe's (or --set's), generation_config.json, pagedrun's.

apply_model_defaults(recipe) returns the recipe with both resolved (idempotent); its `sampling` is
then what requests default to, and its fingerprint (resume) covers what the model contributed.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedrun.config.checks import DEFAULT_MODEL
from pagedrun.config.recipe import GENERATION_CONFIG_FIELDS, Recipe
from pagedrun.errors import PagedrunError, echo
from pagedrun.sampling_params import InvalidValue, SamplingParams, check_field

DTYPES = ("float32", "bfloat16", "float16")
# transformers' GenerationConfig defaults: a file's value equal to one of these sets nothing (vLLM
# reads the file through to_diff_dict, which drops them).
_HF_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}
# The default model is converted from its GGUF (models/default_model.py): float32 weights and a
# generation_config.json with token ids only.
_DEFAULT_MODEL_DTYPE = "float32"
# scheduler defaults on CUDA for what the recipe leaves unset: vLLM's max_num_seqs (256) and its
# offline (LLM class) token budget on GPUs below 70 GiB (8192). The CPU keeps the recipe's (64, 2048).
# Admission in bursts of 16 keeps most steps pure decode (CUDA graphs); the CPU admits at once.
CUDA_SCHEDULER_DEFAULTS = {"max_num_seqs": 256, "max_num_batched_tokens": 8192, "admission_burst": 16}


@dataclass
class ModelDefaults:
    """What apply_model_defaults resolved, for the start-up line and the report."""

    dtype: str  # the dtype that runs
    dtype_note: str | None = None  # how auto became it, when it was auto
    source: str | None = None  # the generation_config.json read, or None
    scheduler_note: str | None = None  # the CUDA scheduler defaults applied, or None
    applied: dict[str, Any] = field(default_factory=dict)  # sampling field -> value from the file
    overridden: list[str] = field(default_factory=list)  # the file's fields the recipe sets itself
    mode: str = "auto"

    def generation_line(self) -> str:
        """One line for the start-up output: which of the model's defaults apply."""
        if self.mode == "vllm":
            return "generation config: vllm (the model's generation_config.json is not read)"
        if not self.applied:
            where = f" in {self.source}" if self.source else ""
            extra = f" (the recipe sets {', '.join(self.overridden)})" if self.overridden else ""
            return f"generation config: no sampling defaults{where}{extra}"
        values = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in self.applied.items())
        extra = f"; the recipe sets {', '.join(self.overridden)}" if self.overridden else ""
        return (f"generation config: {values} from {self.source}{extra} "
                "(--generation-config vllm ignores them)")


def apply_model_defaults(recipe: Recipe, *, resolve_dtype: bool = True) -> Recipe:
    """`recipe` with dtype: auto resolved (unless resolve_dtype is False) and the model's generation
    config applied to its sampling defaults."""
    if recipe.model_defaults is not None:
        return recipe
    path = recipe.model.path
    model_dir = None if path == DEFAULT_MODEL else Path(path)
    mode = recipe.model.generation_config
    gen_file = None
    if mode == "auto" and model_dir is not None:
        gen_file = model_dir / "generation_config.json"
    elif mode not in ("auto", "vllm"):
        gen_file = Path(mode) / "generation_config.json"
    file_values = read_generation_config(gen_file) if gen_file is not None and gen_file.is_file() else {}
    # a folder named by the recipe was checked to hold one when the recipe was loaded
    own = recipe.sampling_set_by_recipe()
    applied = {k: v for k, v in file_values.items() if k not in own}
    sampling = recipe.sampling
    if applied:
        d = sampling.to_dict()
        d.update(applied)
        where = f"{gen_file} (with the recipe's sampling section)"
        sampling = SamplingParams.from_dict(d, where)
    dtype, note = recipe.model.dtype, None
    if resolve_dtype and dtype == "auto":
        dtype, note = resolve_auto_dtype(model_dir, recipe.model.device)
    read = gen_file is not None and gen_file.is_file()
    scheduler, sched_note = device_scheduler_defaults(recipe)
    info = ModelDefaults(dtype=dtype, dtype_note=note, source=str(gen_file) if read else None,
                         scheduler_note=sched_note,
                         applied=applied, overridden=sorted(k for k in file_values if k in own), mode=mode)
    model = dataclasses.replace(recipe.model, dtype=dtype)
    return dataclasses.replace(recipe, model=model, sampling=sampling, scheduler=scheduler, model_defaults=info)


def device_scheduler_defaults(recipe: Recipe):
    """(the scheduler section, a note or None): on CUDA the keys the recipe leaves unset take
    CUDA_SCHEDULER_DEFAULTS; elsewhere the section is unchanged."""
    device = recipe.model.device
    on_cuda = _cuda_available() if device == "auto" else device == "cuda"
    if not on_cuda:
        return recipe.scheduler, None
    raised = {k: v for k, v in CUDA_SCHEDULER_DEFAULTS.items() if not recipe.is_set("scheduler", k)}
    if not raised:
        return recipe.scheduler, None
    note = ", ".join(f"{k} {v}" for k, v in raised.items()) + " (CUDA defaults; the recipe may set them)"
    return dataclasses.replace(recipe.scheduler, **raised), note


def read_generation_config(path: Path) -> dict[str, Any]:
    """The sampling defaults generation_config.json sets, as SamplingParams fields, each checked:
    a bad value is a one-line error naming the file and the field."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, RecursionError, json.JSONDecodeError) as e:
        raise PagedrunError(f"{path}: cannot read JSON: {' '.join(str(e).split())}") from None
    if not isinstance(data, dict):
        raise PagedrunError(f"{path}: must be a JSON object, got {echo(data)}")
    out: dict[str, Any] = {}
    for name, ours in GENERATION_CONFIG_FIELDS.items():
        value = data.get(name)
        if value is None or (name in _HF_DEFAULTS and value == _HF_DEFAULTS[name] and not isinstance(value, bool)):
            continue
        try:
            out[ours] = check_field(ours, value)
        except InvalidValue as e:
            raise PagedrunError(f"{path}: {name}: {e}, got {echo(value)}") from None
    return out


def checkpoint_dtype(model_dir: Path | None) -> str:
    """config.json's torch_dtype (or `dtype`, or text_config's), float32 when it names none."""
    if model_dir is None:
        return _DEFAULT_MODEL_DTYPE
    try:
        data = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, RecursionError, json.JSONDecodeError):
        return "float32"  # the loader reports an unreadable config.json in its own words
    if not isinstance(data, dict):
        return "float32"
    text = data.get("text_config") if isinstance(data.get("text_config"), dict) else {}
    for d in (data, text):
        for key in ("torch_dtype", "dtype"):
            v = d.get(key)
            if isinstance(v, str):
                v = v.removeprefix("torch.")
                return {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32"}.get(v, v) \
                    if v in (*DTYPES, "bf16", "fp16", "half", "float") else "float32"
    return "float32"


def resolve_auto_dtype(model_dir: Path | None, device: str) -> tuple[str, str]:
    """(dtype, how) for dtype: auto on `device` (auto | cpu | cuda)."""
    ck = checkpoint_dtype(model_dir)
    on_cuda = _cuda_available() if device == "auto" else device == "cuda"
    if on_cuda:
        bf16 = _cuda_bf16()
        where = "CUDA with bf16" if bf16 else "CUDA without bf16"
        preferred = "bfloat16" if bf16 else "float16"
    else:
        bf16 = cpu_bf16_arithmetic()
        where = "a CPU with bf16 arithmetic" if bf16 else "a CPU without bf16 arithmetic"
        preferred = "bfloat16" if bf16 else "float32"
    forced = os.environ.get("PAGEDRUN_AUTO_DTYPE", "").strip().lower()
    if forced == "float32" and ck == "float32":
        return "float32", "auto: the checkpoint's float32 (PAGEDRUN_AUTO_DTYPE=float32)"
    if ck == "float32":
        dtype = preferred
    elif ck == "bfloat16" and on_cuda and not bf16:
        dtype = "float16"
    else:
        dtype = ck
    how = f"auto: the checkpoint's {ck}" if dtype == ck else f"auto: a {ck} checkpoint on {where}"
    return dtype, how


def cpu_bf16_arithmetic() -> bool:
    """Whether this CPU has bf16 dot products the kernels use (avx512_bf16 or AMX), within
    PAGEDRUN_KERNEL_ISA's cap."""
    from pagedrun.build.cpu import machine_flags

    try:
        flags = machine_flags()
    except Exception:  # a bad PAGEDRUN_KERNEL_ISA is reported where the kernels are built
        return False
    return "-mavx512bf16" in flags or "-mamx-bf16" in flags


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _cuda_bf16() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
