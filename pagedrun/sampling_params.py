"""SamplingParams: how one request is sampled, with vLLM's field names.

The recipe's `sampling:` section gives the defaults for every request; a JSONL line may override any
field at its top level (`{"prompt": "...", "temperature": 0.7, "seed": 1}`). Both go through
`SamplingParams.from_dict`, so a bad value is reported with the same words wherever it came from.
"""
from __future__ import annotations

import difflib
import math
import warnings
from dataclasses import InitVar, asdict, dataclass, field, fields
from typing import Any, Callable

from pagedrun.errors import PagedrunError, clip, echo
from pagedrun.structured.params import SpecError, check_structured_outputs

# vLLM treats temperatures this small as greedy: dividing logits by ~0 overflows to inf/nan.
_GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20
_SEED_LIMIT = 2**64  # torch.Generator.manual_seed accepts seeds up to 2**64 - 1
# Bounds far above any real request; beyond them a value would overflow a tensor mid-run (top_k)
# or cost work per token (thousands of stop strings). n of 100-200 is usual for pass@k.
MAX_N = 10_000
_MAX_COUNT = 2**31 - 1  # max_tokens, min_tokens, top_k: anything above max_model_len or the vocab
MAX_STOPS = 1024  # stop strings, stop token ids
MAX_LOGIT_BIAS = 1024  # entries of logit_bias (OpenAI documents none; vLLM none either)

# vLLM fields users will try; naming them avoids a bare "unknown field" for a well-known option.
_VLLM_UNSUPPORTED = frozenset({"best_of", "logits_processors", "detokenize", "output_kind"})
MAX_BAD_WORDS = 1024
MAX_ALLOWED_TOKEN_IDS = 1 << 20  # more than any vocabulary
# vLLM's legacy guided-decoding names, read as structured_outputs (vLLM's own migration) with a
# one-line note: `guided_decoding` is a whole structured_outputs object, the others one kind of it.
GUIDED_ALIASES = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar", "guided_decoding": None}
# Fields added after resumable jobs existed (issue 39): left out of the recipe's fingerprint while they
# hold their default, so that a job started before they existed still resumes (config/recipe.py).
LATER_FIELDS = ("prompt_logprobs", "include_stop_str_in_output", "skip_special_tokens",
                "spaces_between_special_tokens", "truncate_prompt_tokens", "allowed_token_ids", "bad_words")


class InvalidValue(ValueError):
    """A field check failed; `str()` is the "must be ..." part, without location or value."""


@dataclass
class SamplingParams:
    n: int = 1
    # vLLM's default is 16, a frequent complaint: answers get cut mid-sentence. 256 fits a short answer.
    max_tokens: int = 256
    min_tokens: int = 0
    # Greedy by default so that evaluation runs are reproducible without seeds.
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1, normalised to 0) = off
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs of each sampled token
    # Penalties (pagedrun/sample/penalties.py): OpenAI's presence/frequency over the generated tokens,
    # vLLM/HF's multiplicative repetition penalty over prompt + generated; logit_bias added first.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    structured_outputs: dict | None = None  # {"json": schema} | {"regex": ...} | ... (structured/params.py)
    # vLLM's fields, with vLLM's meaning (docs/guide/requests-and-outputs.md):
    prompt_logprobs: int | None = None  # top-N logprobs at every prompt position (and the prompt token's own)
    include_stop_str_in_output: bool = False  # keep the stop string that ended the text in it
    skip_special_tokens: bool = True  # leave special tokens out of the text
    spaces_between_special_tokens: bool = True  # (slow tokenizers only, as in vLLM)
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens (-1: all that fit)
    allowed_token_ids: list[int] | None = None  # sample only among these tokens
    bad_words: list[str] = field(default_factory=list)  # word sequences never generated
    # vLLM's older name of structured_outputs, accepted from Python with a one-line note (not a field).
    guided_decoding: InitVar[dict | None] = None

    def __post_init__(self, guided_decoding: dict | None = None) -> None:
        if guided_decoding is not None:
            if self.structured_outputs is not None:
                raise PagedrunError("SamplingParams: guided_decoding, structured_outputs: give one of them")
            warnings.warn(guided_note("guided_decoding"), stacklevel=3)
            self.structured_outputs = guided_decoding
        # Constructing directly (from Python) gets the same checks as from_dict.
        for f in fields(self):
            value = getattr(self, f.name)
            try:
                setattr(self, f.name, check_field(f.name, value))
            except InvalidValue as e:
                raise PagedrunError(f"SamplingParams: {f.name}: {e}, got {echo(value)}") from None
        problem = cross_field_problem(self.to_dict())
        if problem is not None:
            name, msg = problem
            raise PagedrunError(f"SamplingParams: {name}: {msg}, got {echo(getattr(self, name))}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        """Anything that changes the logits before sampling (sample/penalties.py)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.allowed_token_ids is not None or self.bad_words)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str) -> SamplingParams:
        """Validate `d` (types, ranges, unknown keys) and build; errors name `where` and the field."""
        if not isinstance(d, dict):
            raise PagedrunError(f"{where}: must be a mapping of sampling fields, got {echo(d)}")
        values: dict[str, Any] = {}
        d = resolve_aliases(d, where)
        for name, value in d.items():
            if name not in FIELD_NAMES:
                raise PagedrunError(f"{where}: {clip(str(name))}: {unknown_field_message(name)}")
            try:
                values[name] = check_field(name, value)
            except InvalidValue as e:
                raise PagedrunError(f"{where}: {name}: {e}, got {echo(value)}") from None
        full = {**cls().to_dict(), **values}
        problem = cross_field_problem(full)
        if problem is not None:
            name, msg = problem
            raise PagedrunError(f"{where}: {name}: {msg}, got {echo(full[name])}")
        return cls(**full)


FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in fields(SamplingParams))


def merged(defaults: SamplingParams, overrides: dict[str, Any], where: str) -> SamplingParams:
    """`defaults` with the fields in `overrides` replaced (a request's fields over the recipe's)."""
    if not overrides:
        return defaults
    base = defaults.to_dict()
    overrides = resolve_aliases(overrides, where)
    # Check the override keys first so an error names the field the user wrote.
    for name in overrides:
        if name not in FIELD_NAMES:
            raise PagedrunError(f"{where}: {clip(str(name))}: {unknown_field_message(name)}")
    base.update(overrides)
    return SamplingParams.from_dict(base, where)


def resolve_aliases(d: dict[str, Any], where: str) -> dict[str, Any]:
    """`d` with vLLM's legacy guided_* fields turned into structured_outputs (one of them at most)."""
    given = [k for k in GUIDED_ALIASES if k in d]
    if not given:
        return d
    if len(given) > 1 or "structured_outputs" in d:
        names = ", ".join(given + (["structured_outputs"] if "structured_outputs" in d else []))
        raise PagedrunError(f"{where}: {names}: give one of them (guided_* are the old names of structured_outputs)")
    name = given[0]
    out = {k: v for k, v in d.items() if k != name}
    kind, value = GUIDED_ALIASES[name], d[name]
    out["structured_outputs"] = value if kind is None or value is None else {kind: value}
    return out


def guided_note(name: str) -> str:
    """The one-line deprecation note for a legacy guided_* field."""
    kind = GUIDED_ALIASES[name]
    new = "structured_outputs" if kind is None else f'structured_outputs: {{"{kind}": ...}}'
    return f"{name} is deprecated (as in vLLM); read as {new}"


def bad_words_token_ids(words: list[str], tokenizer: Any) -> tuple[tuple[int, ...], ...]:
    """vLLM's tokenization of bad_words: each word as written (less leading spaces) and with one
    leading space, the second kept only where it is another token sequence of the same length."""
    out: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if plain:
            out.append(plain)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return tuple(out)


def unknown_field_message(name: str, noun: str = "field") -> str:
    if name in _VLLM_UNSUPPORTED:
        return f"unknown {noun}: a vLLM sampling field that pagedrun does not support"
    close = difflib.get_close_matches(str(name), FIELD_NAMES, n=1) if len(str(name)) <= 64 else []
    hint = f" (did you mean {close[0]}?)" if close else ""
    return f"unknown {noun}{hint}"


# ---------------------------------------------------------------- field checks
# Each check returns the normalised value or raises InvalidValue("must be ..."); config/recipe.py reuses them.

def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # True is an int in Python, not here


def int_check(lo: int | None = None, hi: int | None = None, desc: str | None = None,
              cap: int | None = None) -> Callable[[Any], int]:
    """`cap`: a sanity bound, reported on its own ("must be at most N") only when it is exceeded."""
    def check(v: Any) -> int:
        if cap is not None and is_int(v) and v > cap:
            raise InvalidValue(f"must be at most {cap}")
        if not is_int(v) or (lo is not None and v < lo) or (hi is not None and v > hi):
            if desc:
                raise InvalidValue(f"must be {desc}")
            if lo is not None and hi is not None:
                raise InvalidValue(f"must be an integer in {lo}..{hi}")
            if lo is not None:
                raise InvalidValue(f"must be an integer >= {lo}")
            raise InvalidValue("must be an integer")
        return v
    return check


def float_check(desc: str, ok: Callable[[float], bool], cap: float | None = None) -> Callable[[Any], float]:
    def check(v: Any) -> float:
        try:
            x = float(v) if is_int(v) or isinstance(v, float) else math.nan
        except OverflowError:  # an integer too large for a float
            x = math.nan
        if not math.isfinite(x) or not ok(x):
            raise InvalidValue(f"must be {desc}")
        if cap is not None and x > cap:
            raise InvalidValue(f"must be at most {cap}")
        return x
    return check


def bool_check(v: Any) -> bool:
    if not isinstance(v, bool):
        raise InvalidValue("must be true or false")
    return v


def optional(check: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def opt(v: Any) -> Any:
        if v is None:
            return None
        try:
            return check(v)
        except InvalidValue as e:
            raise InvalidValue(f"{e} or null") from None
    return opt


def _top_k(v: Any) -> int:
    if not is_int(v) or v < -1:
        raise InvalidValue("must be an integer >= 0 (0 or -1 = off)")
    if v > _MAX_COUNT:
        raise InvalidValue(f"must be at most {_MAX_COUNT}")
    return 0 if v == -1 else v  # one spelling of "off" so the sampler tests `top_k > 0`


def _stop(v: Any) -> list[str]:
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v):
        raise InvalidValue("must be a non-empty string or a list of non-empty strings")
    if len(v) > MAX_STOPS:
        raise InvalidValue(f"must hold at most {MAX_STOPS} stop strings")
    return list(v)


def _logit_bias(v: Any) -> dict[int, float]:
    # JSON object keys are strings: OpenAI's own files write {"50256": -100}.
    if not isinstance(v, dict):
        raise InvalidValue("must be a mapping of token id -> bias in [-100, 100]")
    if len(v) > MAX_LOGIT_BIAS:
        raise InvalidValue(f"must hold at most {MAX_LOGIT_BIAS} token ids")
    out: dict[int, float] = {}
    for k, b in v.items():
        tok = int(k) if isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= 12 else k
        if not is_int(tok) or tok < 0:
            raise InvalidValue(f"must map non-negative integer token ids to biases; key {echo(k)} is not one")
        if not (is_int(b) or isinstance(b, float)) or not math.isfinite(float(b)) or not -100 <= b <= 100:
            raise InvalidValue(f"must map token ids to biases in [-100, 100]; {tok} -> {echo(b)}")
        out[tok] = float(b)
    return out


def _stop_token_ids(v: Any) -> list[int]:
    if not isinstance(v, list) or not all(is_int(t) and t >= 0 for t in v):
        raise InvalidValue("must be a list of non-negative integer token ids")
    if len(v) > MAX_STOPS:
        raise InvalidValue(f"must hold at most {MAX_STOPS} token ids")
    return list(v)


def _structured_outputs(v: Any) -> dict | None:
    try:
        return check_structured_outputs(v)
    except SpecError as e:
        raise InvalidValue(str(e)) from None


def _allowed_token_ids(v: Any) -> list[int] | None:
    if v is None:
        return None
    if not isinstance(v, list) or not v or not all(is_int(t) and t >= 0 for t in v):
        raise InvalidValue("must be a non-empty list of non-negative integer token ids or null")
    if len(v) > MAX_ALLOWED_TOKEN_IDS:
        raise InvalidValue(f"must hold at most {MAX_ALLOWED_TOKEN_IDS} token ids")
    return list(v)


def _truncate_prompt_tokens(v: Any) -> int:
    if not is_int(v) or (v < 1 and v != -1):
        raise InvalidValue("must be an integer >= 1 (or -1: as many as max_model_len allows)")
    if v > _MAX_COUNT:
        raise InvalidValue(f"must be at most {_MAX_COUNT}")
    return v


def _bad_words(v: Any) -> list[str]:
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) and s.strip() for s in v):
        raise InvalidValue("must be a list of non-empty strings")
    if len(v) > MAX_BAD_WORDS:
        raise InvalidValue(f"must hold at most {MAX_BAD_WORDS} words")
    return list(v)


_CHECKS: dict[str, Callable[[Any], Any]] = {
    "n": int_check(lo=1, cap=MAX_N),
    "max_tokens": int_check(lo=1, cap=_MAX_COUNT),
    "min_tokens": int_check(lo=0, cap=_MAX_COUNT),
    "temperature": float_check("a number >= 0 (0 = greedy)", lambda x: x >= 0),
    "top_p": float_check("a number in (0, 1]", lambda x: 0 < x <= 1),
    "top_k": _top_k,
    "min_p": float_check("a number in [0, 1]", lambda x: 0 <= x <= 1),
    "seed": optional(int_check(lo=0, hi=_SEED_LIMIT - 1, desc="an integer in 0..2**64-1")),
    "stop": _stop,
    "stop_token_ids": _stop_token_ids,
    "ignore_eos": bool_check,
    "logprobs": optional(int_check(lo=0, hi=MAX_LOGPROBS)),
    "presence_penalty": float_check("a number in [-2, 2]", lambda x: -2 <= x <= 2),
    "frequency_penalty": float_check("a number in [-2, 2]", lambda x: -2 <= x <= 2),
    # vLLM accepts any value > 0; 1 = off, > 1 discourages repeats, < 1 encourages them. Bounded both ways
    # (1/100..100): the penalty divides or multiplies float32 logits, and 1e-300 is 0 there, making a row NaN.
    "repetition_penalty": float_check("a number in [0.01, 100] (1 = off)", lambda x: 0.01 <= x <= 100),
    "logit_bias": _logit_bias,
    "structured_outputs": _structured_outputs,
    "prompt_logprobs": optional(int_check(lo=0, hi=MAX_LOGPROBS)),
    "include_stop_str_in_output": bool_check,
    "skip_special_tokens": bool_check,
    "spaces_between_special_tokens": bool_check,
    "truncate_prompt_tokens": optional(_truncate_prompt_tokens),
    "allowed_token_ids": _allowed_token_ids,
    "bad_words": _bad_words,
}
assert set(_CHECKS) == set(FIELD_NAMES), "every SamplingParams field needs a check"


def check_field(name: str, value: Any) -> Any:
    """Check one field; returns the normalised value, raises InvalidValue("must be ...")."""
    return _CHECKS[name](value)


def cross_field_problem(d: dict[str, Any]) -> tuple[str, str] | None:
    """(field, "must be ...") for a constraint between fields of a full, checked dict, or None."""
    if d["min_tokens"] > d["max_tokens"]:
        return "min_tokens", f"must be <= max_tokens ({d['max_tokens']})"
    return None
