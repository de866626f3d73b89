"""Recipe: every setting of a run, loaded from YAML, checked before any work starts.

A recipe is plain dataclasses with the defaults embedded here (recipes/default.yaml repeats them with
comments, and a test keeps the two equal), so `load_recipe(None)` works without any file.
`--set key.path=value` overrides are applied after the file, the value parsed as YAML
(`--set cache.kv_cache_memory=2GiB`, `--set sampling.stop=[".", "\\n"]`).

Every error is one line naming where the bad value came from and its key path:
    recipe.yaml: cache.block_size: must be one of 8, 16, 32, got 12
    recipe.yaml: cache.blok_size: unknown key (did you mean block_size?)
    --set cache.block_size=abc: must be an integer (one of 8, 16, 32)
"""
from __future__ import annotations

import difflib
import hashlib
import json
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Iterable

import yaml

from pagedrun.errors import PagedrunError
from pagedrun.sampling_params import (
    FIELD_NAMES as SAMPLING_FIELDS,
    InvalidValue,
    SamplingParams,
    bool_check,
    check_field as check_sampling_field,
    cross_field_problem as sampling_cross_field_problem,
    float_check,
    int_check,
    is_int,
    optional,
    unknown_field_message as unknown_sampling_field,
)

DEFAULT_MODEL = "default"  # the embedded SmolLM2-135M-Instruct
BLOCK_SIZES = (8, 16, 32)  # the block sizes the CUDA kernels are compiled for
DEFAULT_CPU_KV_FRACTION = 0.25  # used when cache.kv_cache_memory is null
_MIN_KV_BYTES = 1 << 20


# ---------------------------------------------------------------- the recipe

@dataclass
class ModelConfig:
    path: str = DEFAULT_MODEL  # "default" or a local HF directory (absolute after loading)
    dtype: str = "float32"
    max_model_len: int | None = None  # None: min(max_position_embeddings, 8192), decided at load
    device: str = "auto"
    attention_backend: str = "auto"
    threads: int | None = None  # None: torch's default


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
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    preemption_mode: str = "recompute"


@dataclass
class OutputConfig:
    fsync_interval_s: float = 5.0
    report: bool = True


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
    source: Path | None = field(default=None, compare=False)  # the file it came from, if any

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        del d["source"]
        return d

    def fingerprint(self) -> str:
        """sha256 of the normalised settings, used by resume to refuse mixing outputs of two recipes.

        `output` and `distributed` are left out: how often we fsync, whether a report is written, or
        how many replicas share the work changes no token.
        """
        d = self.to_dict()
        del d["output"]
        del d["distributed"]
        blob = json.dumps(d, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return hashlib.sha256(blob.encode()).hexdigest()


_SECTIONS: dict[str, type] = {
    "model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
    "sampling": SamplingParams, "output": OutputConfig, "distributed": DistributedConfig,
}
_SCALARS = ("seed",)
_TOP_KEYS = (*_SECTIONS, *_SCALARS)


# ---------------------------------------------------------------- sizes

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(?:([kmgt])(i?)b?|b?)\s*$", re.IGNORECASE)
_POWERS = {"k": 1, "m": 2, "g": 3, "t": 4}


def parse_size(text: str) -> int:
    """'2GiB' -> 2147483648. KiB/MiB/GiB/TiB and bare K/M/G/T are powers of 1024; KB/MB/GB/TB of 1000.

    Raises ValueError for anything else.
    """
    m = _SIZE_RE.match(text) if isinstance(text, str) else None
    if m is None:
        raise ValueError(f"not a size like '2GiB' or '512MiB': {text!r}")
    number, unit, binary = m.group(1), m.group(2), m.group(3)
    if unit is None:
        base = 1
    else:
        decimal = text.strip().lower().endswith("b") and not binary
        base = (1000 if decimal else 1024) ** _POWERS[unit.lower()]
    return int(float(number) * base) if "." in number else int(number) * base


# ---------------------------------------------------------------- per-key checks
# Each returns the normalised value or raises InvalidValue("must be ..."). `base` is the directory
# relative model paths resolve against (the recipe's directory, or the CWD for --set).

def _choice(options: Iterable[Any], aliases: dict[str, str] | None = None) -> Callable[[Any], Any]:
    options = tuple(options)
    listed = ", ".join(str(o) for o in options)

    def check(v: Any) -> Any:
        if aliases and isinstance(v, str) and v.lower() in aliases:
            v = aliases[v.lower()]
        if all(is_int(o) for o in options) and not is_int(v):
            raise InvalidValue(f"must be an integer (one of {listed})")
        if v not in options or isinstance(v, bool):
            raise InvalidValue(f"must be one of {listed}")
        return v
    return check


def _kv_cache_memory(v: Any) -> int | float | None:
    msg = (f"must be a fraction 0 < x <= 1 of available memory, a size like '2GiB', "
           f"or a number of bytes >= {_MIN_KV_BYTES}")
    if v is None:
        return None
    if isinstance(v, float):
        if not 0 < v <= 1:
            raise InvalidValue(msg)
        return v
    if isinstance(v, str):
        try:
            v = parse_size(v)
        except ValueError:
            raise InvalidValue(msg) from None
    # An int is bytes: `kv_cache_memory: 1` is far more likely a fraction written without ".0".
    if not is_int(v) or v < _MIN_KV_BYTES:
        raise InvalidValue(msg)
    return v


def _non_empty_str(v: Any) -> str:
    if not isinstance(v, str) or not v.strip():
        raise InvalidValue("must be a non-empty string")
    return v


_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16",
                  "half": "float16"}

_CHECKS: dict[str, dict[str, Callable[[Any], Any]]] = {
    "model": {
        "path": _non_empty_str,  # resolved in _model_path
        "dtype": _choice(("float32", "bfloat16", "float16"), _DTYPE_ALIASES),
        "max_model_len": optional(int_check(lo=16)),
        "device": _choice(("auto", "cpu", "cuda")),
        "attention_backend": _choice(("auto", "torch", "cupy", "emulated")),
        "threads": optional(int_check(lo=1)),
    },
    "cache": {
        "block_size": _choice(BLOCK_SIZES),
        "kv_cache_memory": _kv_cache_memory,
        "gpu_memory_utilization": float_check("a number in (0, 1]", lambda x: 0 < x <= 1),
        "num_blocks": optional(int_check(lo=1)),
        "swap_space": float_check("a number of GiB >= 0", lambda x: x >= 0),
        "enable_prefix_caching": bool_check,
        "watermark": float_check("a number in [0, 1)", lambda x: 0 <= x < 1),
    },
    "scheduler": {
        "max_num_seqs": int_check(lo=1),
        "max_num_batched_tokens": int_check(lo=1),
        "preemption_mode": _choice(("recompute", "swap")),
    },
    "sampling": {name: (lambda v, name=name: check_sampling_field(name, v)) for name in SAMPLING_FIELDS},
    "output": {
        "fsync_interval_s": float_check("a number of seconds >= 0", lambda x: x >= 0),
        "report": bool_check,
    },
    "distributed": {
        "address": optional(_non_empty_str),
        "replicas": optional(int_check(lo=1)),
    },
    "": {"seed": int_check(lo=0, hi=2**64 - 1, desc="an integer in 0..2**64-1")},
}
for _name, _cls in _SECTIONS.items():  # the schema and the dataclasses must not drift apart
    assert set(_CHECKS[_name]) == {f.name for f in fields(_cls)}, _name


def _model_path(v: str, base: Path) -> str:
    if v == DEFAULT_MODEL:
        return v
    p = Path(v).expanduser()
    p = p if p.is_absolute() else base / p
    if not p.exists():
        raise InvalidValue(f'must be "{DEFAULT_MODEL}" or an existing model directory; {p} does not exist')
    return str(p.resolve())


def _did_you_mean(key: Any, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(str(key), list(known), n=1)
    return f" (did you mean {close[0]}?)" if close else ""


# ---------------------------------------------------------------- YAML

class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 floats (`1e-5` is a float, not a string) and duplicate-key errors."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                if key in seen:
                    raise _DuplicateKey(key, key_node.start_mark.line + 1, seen[key])
                seen[key] = key_node.start_mark.line + 1
            except TypeError:  # unhashable key: let SafeLoader report it
                pass
        return super().construct_mapping(node, deep)


class _DuplicateKey(Exception):
    def __init__(self, key: Any, line: int, first: int) -> None:
        self.key, self.line, self.first = key, line, first


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _key_lines(text: str) -> dict[str, int]:
    """1-based line of every `section` and `section.key` in the file, so errors can point at it."""
    lines: dict[str, int] = {}
    root = yaml.compose(text, Loader=_Loader)
    if not isinstance(root, yaml.MappingNode):
        return lines
    for key_node, value_node in root.value:
        section = str(key_node.value)
        lines[section] = key_node.start_mark.line + 1
        if isinstance(value_node, yaml.MappingNode):
            for sub_node, _ in value_node.value:
                lines[f"{section}.{sub_node.value}"] = sub_node.start_mark.line + 1
    return lines


def _read_yaml(path: Path) -> tuple[Any, dict[str, int]]:
    """The parsed file and the line of each key in it."""
    name = path.name
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise PagedrunError(f"{name}: recipe file not found ({path})") from None
    except IsADirectoryError:
        raise PagedrunError(f"{name}: is a directory, not a recipe file ({path})") from None
    except OSError as e:
        raise PagedrunError(f"{name}: cannot read recipe file: {e.strerror}") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise PagedrunError(f"{name}:{line}: not valid UTF-8 (byte 0x{data[e.start]:02x})") from None
    try:
        return yaml.load(text, Loader=_Loader), _key_lines(text)
    except _DuplicateKey as e:
        raise PagedrunError(f"{name}:{e.line}: {e.key}: duplicate key (first on line {e.first})") from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        loc = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
        raise PagedrunError(f"{name}{loc}: invalid YAML: {_one_line(e.problem or e)}") from None
    except yaml.YAMLError as e:
        raise PagedrunError(f"{name}: invalid YAML: {_one_line(e)}") from None


# ---------------------------------------------------------------- loading

class _Builder:
    """Collects checked values section by section, remembering where each came from."""

    def __init__(self) -> None:
        defaults = Recipe().to_dict()
        self.values: dict[str, Any] = defaults
        self.origin: dict[str, str] = {}  # "section.key" -> error prefix of whatever set it last

    def set_top(self, key: Any, value: Any, where: Callable[[str], str], base: Path) -> None:
        if key in _SECTIONS:
            if value is None:  # `cache:` with nothing under it
                return
            if not isinstance(value, dict):
                raise PagedrunError(f"{where(str(key))}: must be a mapping, got {value!r}")
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
        try:
            v = checks[key](value)
            if section == "model" and key == "path":
                v = _model_path(v, base)
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
            raise PagedrunError(f"{prefix}: {msg}, got {v['sampling'][name]!r}")
        return Recipe(
            model=ModelConfig(**v["model"]),
            cache=CacheConfig(**v["cache"]),
            scheduler=SchedulerConfig(**v["scheduler"]),
            sampling=SamplingParams(**v["sampling"]),
            output=OutputConfig(**v["output"]),
            seed=v["seed"],
            distributed=DistributedConfig(**v["distributed"]),
            source=source,
        )


def _got(where: Callable[[str], str], value: Any) -> str:
    # A --set item already shows the value the user typed; a file's value is not on screen.
    return "" if getattr(where, "is_override", False) else f", got {value!r}"


def _file_where(name: str, lines: dict[str, int]) -> Callable[[str], str]:
    def where(keypath: str) -> str:
        line = lines.get(keypath) or lines.get(keypath.split(".")[0])
        return f"{name}:{line}: {keypath}" if line else f"{name}: {keypath}"
    return where


def _override_where(item: str, own_keypath: str) -> Callable[[str], str]:
    def where(keypath: str) -> str:
        return f"--set {item}" if keypath == own_keypath else f"--set {item}: {keypath}"
    where.is_override = True  # type: ignore[attr-defined]
    return where


def load_recipe(path: Path | None, overrides: Iterable[str] = ()) -> Recipe:
    """Load and check a recipe (None = the built-in defaults), then apply `--set` overrides."""
    builder = _Builder()
    if path is not None:
        path = Path(path)
        raw, lines = _read_yaml(path)
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
    if not sep or not keypath:
        raise PagedrunError(f"--set {item}: expected key.path=value, e.g. cache.block_size=32")
    try:
        value = yaml.load(text, Loader=_Loader) if text.strip() else None
    except (yaml.YAMLError, _DuplicateKey) as e:
        problem = getattr(e, "problem", None) or e
        raise PagedrunError(f"--set {item}: value is not valid YAML: {_one_line(problem)}") from None
    where = _override_where(item, keypath)
    parts = keypath.split(".")
    if len(parts) == 1:
        builder.set_top(parts[0], value, where, Path.cwd())
    elif len(parts) == 2 and parts[0] in _SECTIONS:
        builder.set_key(parts[0], parts[1], value, where, Path.cwd())
    else:
        known = [f"{s}.{k}" for s in _SECTIONS for k in _CHECKS[s]] + list(_SCALARS)
        raise PagedrunError(f"--set {item}: unknown key {keypath}{_did_you_mean(keypath, known)}")
