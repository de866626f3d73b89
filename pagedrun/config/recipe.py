"""Recipe: every setting of a run, loaded from YAML, checked before any work starts.

A recipe is plain dataclasses with the defaults embedded here (recipes/default.yaml repeats them with
comments, and a test keeps the two equal), so `load_recipe(None)` works without any file.
`--set key.path=value` overrides are applied after the file, the value parsed as YAML
(`--set cache.kv_cache_memory=2GiB`, `--set sampling.stop=[".", "\\n"]`).

Every error is one line naming where the bad value came from and its key path:
    recipe.yaml: cache.block_size: must be one of 8, 16, 32, got 12
    recipe.yaml: cache.blok_size: unknown key (did you mean block_size?)
    --set cache.block_size=abc: must be an integer (one of 8, 16, 32)

The per-key checks live in config/checks.py, the YAML reading in config/yaml_loader.py.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Iterable

import yaml

from pagedrun.config.checks import (  # noqa: F401  (BLOCK_SIZES, parse_size: part of this module's API)
    BLOCK_SIZES,
    DEFAULT_CPU_KV_FRACTION,
    DEFAULT_MODEL,
    parse_size,
)
from pagedrun.config.checks import (
    CHECKS as _CHECKS,
)
from pagedrun.config.checks import (
    chat_template_path as _chat_template_path,
)
from pagedrun.config.checks import (
    did_you_mean as _did_you_mean,
)
from pagedrun.config.checks import (
    generation_config_path as _generation_config_path,
)
from pagedrun.config.checks import (
    model_path as _model_path,
)
from pagedrun.config.yaml_loader import DuplicateKey as _DuplicateKey
from pagedrun.config.yaml_loader import Loader as _Loader
from pagedrun.config.yaml_loader import one_line as _one_line
from pagedrun.config.yaml_loader import read_yaml
from pagedrun.errors import PagedrunError, clip, echo
from pagedrun.sampling_params import LATER_FIELDS as LATER_SAMPLING_FIELDS
from pagedrun.sampling_params import (
    InvalidValue,
    SamplingParams,
)
from pagedrun.sampling_params import (
    cross_field_problem as sampling_cross_field_problem,
)
from pagedrun.sampling_params import (
    unknown_field_message as unknown_sampling_field,
)

# ---------------------------------------------------------------- the recipe

# generation_config.json's fields that are sampling defaults (vLLM's ModelConfig.get_diff_sampling_param)
# -> the SamplingParams field each sets. A recipe's `sampling.<field>: null` leaves it to the model.
GENERATION_CONFIG_FIELDS = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens",
}
MODEL_DEFAULT_FIELDS = frozenset(GENERATION_CONFIG_FIELDS.values())
# scheduler keys whose default depends on the device (CUDA's: models/model_defaults.py); null = that default
DEVICE_DEFAULT_FIELDS = frozenset(("max_num_seqs", "max_num_batched_tokens", "admission_burst"))

@dataclass
class ModelConfig:
    path: str = DEFAULT_MODEL  # "default" or a local HF directory (absolute after loading)
    # auto: the checkpoint's torch_dtype, a float32 one run in bfloat16 where the device has bf16
    # arithmetic (CUDA, CPUs with avx512_bf16 or AMX), as vLLM does (models/model_defaults.py).
    dtype: str = "auto"
    max_model_len: int | None = None  # None: min(max_position_embeddings, 8192), decided at load
    device: str = "auto"
    attention_backend: str = "auto"
    # Decode steps replayed from CUDA graphs (worker/cuda_graphs.py): auto = where they apply (CUDA,
    # the cupy backend, no MoE, no fp8 cache), true = required (an error where they cannot), false = eager.
    cuda_graphs: str = "auto"
    threads: int | None = None  # None: torch's default
    # auto: generation_config.json's sampling fields are the defaults of requests and of the recipe's
    # sampling fields it leaves unset (vLLM's --generation-config auto); vllm: ignored; or a folder.
    generation_config: str = "auto"
    chat_template: str | None = None  # a Jinja file replacing the tokenizer's chat template (absolute after loading)


@dataclass
class CacheConfig:
    block_size: int = 16
    # CPU KV budget: a fraction of available memory (float), bytes (int), or None (= 0.25).
    kv_cache_memory: int | float | None = DEFAULT_CPU_KV_FRACTION
    gpu_memory_utilization: float = 0.9  # fraction of TOTAL GPU memory, as in vLLM
    num_blocks: int | None = None  # overrides the profiled number
    swap_space: float = 1.0  # GiB of CPU memory for swapped-out blocks
    enable_prefix_caching: bool = True
    watermark: float = 0.01
    # Sliding-window layers in KV cache groups of their own that give back the blocks the window
    # has left (kv/groups.py); false: one group, every block kept, the window in compute only.
    hybrid_kv: bool = True
    # auto = the model's dtype; fp8 (e4m3, e5m2) and int8 store 1 byte per element (attention/kv_cache_spec.py).
    kv_cache_dtype: str = "auto"
    k_scale: float | None = None  # fp8 scales for every layer; null: calibrated at start-up
    v_scale: float | None = None

    def kv_cache_bytes(self, available_bytes: int) -> int:
        """The CPU KV budget in bytes, given the memory available for it."""
        budget = self.kv_cache_memory
        if budget is None:
            budget = DEFAULT_CPU_KV_FRACTION
        if isinstance(budget, float):
            return int(available_bytes * budget)
        return budget


@dataclass
class SchedulerConfig:
    # The CPU's defaults; on CUDA, where unset, models/model_defaults.py raises them to vLLM's
    # (CUDA_SCHEDULER_DEFAULTS): a GPU step costs about the same at 64 rows as at 256.
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    preemption_mode: str = "recompute"
    # While sequences decode, waiting requests are admitted only once this many slots are free (or
    # as many as are waiting): fewer steps mix prefill with decode, which a GPU runs eagerly while
    # pure decode steps replay a CUDA graph. 1 = vLLM's (admit whenever a slot is free); CUDA's
    # default is 16 (models/model_defaults.py). It changes no token, only which steps they run in.
    admission_burst: int = 1
    # Schedule step n+1 while step n runs, its sampled ids fed to n+1 on the device (vLLM's
    # async_scheduling; engine/engine.py): the host's work hides behind the GPU's. auto = on CUDA.
    # Greedy and seeded tokens are the same either way.
    async_scheduling: str = "auto"


@dataclass
class OutputConfig:
    fsync_interval_s: float = 5.0
    report: bool = True


@dataclass
class StructuredOutputsConfig:
    # vLLM's StructuredOutputsConfig key, on by default as xgrammar's strict mode is: a JSON Schema
    # object allows no property it does not name unless it says so, an array no item past its
    # prefixItems (structured/strict.py); false: JSON Schema's own rules. A request's
    # structured_outputs may set it for itself.
    disable_additional_properties: bool = True


@dataclass
class DistributedConfig:
    address: str | None = None  # None, "auto" or a Ray address
    replicas: int | None = None


@dataclass
class Recipe:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    output: OutputConfig = field(default_factory=OutputConfig)
    seed: int = 0  # seeds the global sampler RNG for requests without their own seed
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    structured_outputs: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    source: Path | None = field(default=None, compare=False)  # the file it came from, if any
    # The sampling keys the recipe, --set or an engine argument set (null: left to the model's
    # generation config); None for a Recipe built in Python: its fields other than the defaults.
    explicit_sampling: frozenset[str] | None = field(default=None, compare=False, repr=False)
    # What models/model_defaults.py resolved (dtype: auto, generation_config.json): None until then.
    model_defaults: Any = field(default=None, compare=False, repr=False)
    # Every "section.key" the recipe file, --set, a flag or an engine argument set; None for a Recipe
    # built in Python (then a key counts as set when it differs from the default).
    explicit_keys: frozenset[str] | None = field(default=None, compare=False, repr=False)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("source", "explicit_sampling", "model_defaults", "explicit_keys"):
            del d[k]
        return d

    def is_set(self, section: str, key: str) -> bool:
        """Whether the recipe itself decides section.key (else a device default may replace it)."""
        if self.explicit_keys is not None:
            return f"{section}.{key}" in self.explicit_keys
        return getattr(getattr(self, section), key) != getattr(getattr(Recipe(), section), key)

    def sampling_set_by_recipe(self) -> frozenset[str]:
        """The sampling fields the recipe itself decides, which the model's generation config leaves alone."""
        if self.explicit_sampling is not None:
            return self.explicit_sampling
        default = SamplingParams().to_dict()
        return frozenset(k for k, v in self.sampling.to_dict().items() if v != default[k])

    def fingerprint(self) -> str:
        """sha256 of the normalised settings, used by resume to refuse mixing outputs of two recipes.

        `output`, `distributed`, cache.hybrid_kv, scheduler.admission_burst, scheduler.async_scheduling
        and model.cuda_graphs are left out: how often we fsync, whether a report is written, how many
        replicas share the work, whether sliding layers free their blocks, when waiting requests are
        admitted, whether a step is scheduled while the one before runs or whether decode steps
        replay CUDA graphs changes no token. model.generation_config is left out too:
        what it applied is in `sampling` (once models/model_defaults.py resolved it), so a job is
        another job exactly when a default it ran with changed, and a job started before the key
        existed still resumes.
        """
        d = self.to_dict()
        del d["output"]
        del d["distributed"]
        del d["cache"]["hybrid_kv"]
        del d["scheduler"]["admission_burst"]
        del d["scheduler"]["async_scheduling"]
        del d["model"]["generation_config"]
        del d["model"]["cuda_graphs"]  # how steps are launched; a job started before the key resumes
        if d["structured_outputs"] == asdict(StructuredOutputsConfig()):
            # The default, strict, is left out: a job started before the section existed resumes
            # (its constrained requests, if any, run strict from then on: docs/guide/structured-outputs.md).
            del d["structured_outputs"]
        # Keys added after resume existed count only when set: a job started before them resumes.
        default_sampling = SamplingParams().to_dict()
        for name in LATER_SAMPLING_FIELDS:
            if d["sampling"][name] == default_sampling[name]:
                del d["sampling"][name]
        template = d["model"].pop("chat_template")
        if template is not None:  # what the template says, not where it is: its text renders the prompts
            d["model"]["chat_template_sha256"] = _file_sha256(template)
        blob = json.dumps(d, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return hashlib.sha256(blob.encode()).hexdigest()


def _file_sha256(path: str) -> str:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError as e:
        raise PagedrunError(f"model.chat_template: cannot read {path}: {e.strerror}") from None


_SECTIONS: dict[str, type] = {
    "model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
    "sampling": SamplingParams, "output": OutputConfig, "distributed": DistributedConfig,
    "structured_outputs": StructuredOutputsConfig,
}
_SCALARS = ("seed",)
_TOP_KEYS = (*_SECTIONS, *_SCALARS)
for _name, _cls in _SECTIONS.items():  # the schema and the dataclasses must not drift apart
    assert set(_CHECKS[_name]) == {f.name for f in fields(_cls)}, _name


# ---------------------------------------------------------------- loading

class _Builder:
    """Collects checked values section by section, remembering where each came from."""

    def __init__(self) -> None:
        defaults = Recipe().to_dict()
        self.values: dict[str, Any] = defaults
        self.origin: dict[str, str] = {}  # "section.key" -> error prefix of whatever set it last
        self.explicit_sampling: set[str] = set()

    def set_top(self, key: Any, value: Any, where: Callable[[str], str], base: Path) -> None:
        if key in _SECTIONS:
            if value is None:  # `cache:` with nothing under it
                return
            if not isinstance(value, dict):
                raise PagedrunError(f"{where(str(key))}: must be a mapping, got {echo(value)}")
            for sub, v in value.items():
                self.set_key(key, sub, v, where, base)
        elif key in _SCALARS:
            self.set_key("", key, value, where, base)
        else:
            raise PagedrunError(f"{where(str(key))}: unknown key{_did_you_mean(key, _TOP_KEYS)}")

    def set_key(self, section: str, key: Any, value: Any, where: Callable[[str], str], base: Path) -> None:
        keypath = f"{section}.{key}" if section else str(key)
        checks = _CHECKS[section]
        if key not in checks:
            if section == "sampling":
                raise PagedrunError(f"{where(keypath)}: {unknown_sampling_field(key, 'key')}")
            raise PagedrunError(f"{where(keypath)}: unknown key{_did_you_mean(key, checks)}")
        if section == "scheduler" and key in DEVICE_DEFAULT_FIELDS and value is None:
            # null: the device's default (models/model_defaults.py raises it on CUDA)
            self.values[section][key] = getattr(SchedulerConfig(), key)
            self.origin.pop(keypath, None)
            return
        if section == "sampling" and key in MODEL_DEFAULT_FIELDS:
            if value is None:  # null: the model's generation config decides, else pagedrun's default
                self.values[section][key] = getattr(SamplingParams(), key)
                self.explicit_sampling.discard(key)
                self.origin.pop(keypath, None)
                return
            self.explicit_sampling.add(key)
        try:
            v = checks[key](value)
            if section == "model" and key == "path":
                v = _model_path(v, base)
            if section == "model" and key == "generation_config":
                v = _generation_config_path(v, base)
            if section == "model" and key == "chat_template":
                v = _chat_template_path(v, base)
        except InvalidValue as e:
            raise PagedrunError(f"{where(keypath)}: {e}{_got(where, value)}") from None
        if section:
            self.values[section][key] = v
        else:
            self.values[key] = v
        self.origin[keypath] = where(keypath)

    def build(self, source: Path | None) -> Recipe:
        v = self.values
        problem = sampling_cross_field_problem(v["sampling"])
        if problem is not None:
            name, msg = problem
            # Only a value the user set can break a constraint the defaults satisfy.
            prefix = self.origin.get(f"sampling.{name}", f"sampling.{name}")
            raise PagedrunError(f"{prefix}: {msg}, got {echo(v['sampling'][name])}")
        return Recipe(
            model=ModelConfig(**v["model"]),
            cache=CacheConfig(**v["cache"]),
            scheduler=SchedulerConfig(**v["scheduler"]),
            sampling=SamplingParams(**v["sampling"]),
            output=OutputConfig(**v["output"]),
            seed=v["seed"],
            distributed=DistributedConfig(**v["distributed"]),
            structured_outputs=StructuredOutputsConfig(**v["structured_outputs"]),
            source=source,
            explicit_sampling=frozenset(self.explicit_sampling),
            explicit_keys=frozenset(self.origin),
        )


def _got(where: Callable[[str], str], value: Any) -> str:
    # A --set item already shows the value the user typed; a file's value is not on screen.
    return "" if getattr(where, "is_override", False) else f", got {echo(value)}"


def _file_where(name: str, lines: dict[str, int]) -> Callable[[str], str]:
    def where(keypath: str) -> str:
        line = lines.get(keypath) or lines.get(keypath.split(".")[0])
        return f"{name}:{line}: {clip(keypath)}" if line else f"{name}: {clip(keypath)}"
    return where


def _override_where(item: str, own_keypath: str) -> Callable[[str], str]:
    item = clip(item)

    def where(keypath: str) -> str:
        return f"--set {item}" if keypath == own_keypath else f"--set {item}: {clip(keypath)}"
    where.is_override = True  # type: ignore[attr-defined]
    return where


def load_recipe(path: Path | None, overrides: Iterable[str] = ()) -> Recipe:
    """Load and check a recipe (None = the built-in defaults), then apply `--set` overrides."""
    builder = _Builder()
    if path is not None:
        path = Path(path)
        raw, lines = read_yaml(path)
        if raw is None:
            raw = {}  # an empty recipe means all defaults
        if not isinstance(raw, dict):
            raise PagedrunError(f"{path.name}: must be a mapping of sections "
                                f"({', '.join(_TOP_KEYS)}), got {type(raw).__name__}")
        where = _file_where(path.name, lines)
        base = path.resolve().parent
        for key, value in raw.items():
            builder.set_top(key, value, where, base)
    for item in overrides:
        _apply_override(builder, item)
    return builder.build(path)


def _apply_override(builder: _Builder, item: str) -> None:
    keypath, sep, text = item.partition("=")
    keypath = keypath.strip()
    shown = clip(item)
    if not sep or not keypath:
        raise PagedrunError(f"--set {shown}: expected key.path=value, e.g. cache.block_size=32")
    try:
        value = yaml.load(text, Loader=_Loader) if text.strip() else None
    except (yaml.YAMLError, _DuplicateKey) as e:
        problem = getattr(e, "problem", None) or e
        raise PagedrunError(f"--set {shown}: value is not valid YAML: {_one_line(problem)}") from None
    where = _override_where(item, keypath)
    parts = keypath.split(".")
    if len(parts) == 1:
        builder.set_top(parts[0], value, where, Path.cwd())
    elif len(parts) == 2 and parts[0] in _SECTIONS:
        builder.set_key(parts[0], parts[1], value, where, Path.cwd())
    else:
        known = [f"{s}.{k}" for s in _SECTIONS for k in _CHECKS[s]] + list(_SCALARS)
        raise PagedrunError(f"--set {shown}: unknown key {clip(keypath)}{_did_you_mean(keypath, known)}")
