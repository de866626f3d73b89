"""Prompt -> token ids, with work bounded by what the model can take, not by what the line holds.

Text longer than max_model_len tokens of the longest vocabulary entry cannot fit, so at most that
many characters are tokenized. Every token id the tokenizer gives is checked against the model's
vocabulary: a tokenizer larger than the model is refused here, not by an IndexError mid-run.
"""
from __future__ import annotations

import weakref
from typing import Any

from pagedrun.errors import clip


class LineError(Exception):
    """What is wrong with one line: the field (None for the whole line) and why."""

    def __init__(self, field: str | None, message: str) -> None:
        self.field, self.message = field, message


class TooLong(LineError):
    """A prompt longer than max_model_len allows: an error record even without skip_invalid."""


def token_ids(kind: str, value: Any, tokenizer: Any, max_model_len: int, chat: dict | None = None) -> list[int]:
    """The prompt's token ids for a checked `prompt` (str) or `messages` line; `chat`: the line's
    chat-template arguments (check_chat_options)."""
    need_tokenizer(tokenizer, kind)
    if kind == "prompt":
        return _collapse_double_bos(_encode(value, tokenizer, max_model_len, kind, {}), tokenizer)
    return chat_token_ids(value, tokenizer, max_model_len, **(chat or {}))[1]


# A request's chat-template arguments (vLLM's names), as LLM.chat, JSONL lines and batch bodies give them.
CHAT_OPTIONS = ("chat_template", "chat_template_kwargs", "add_generation_prompt", "continue_final_message", "tools")
MAX_TEMPLATE_CHARS = 1_000_000


def check_chat_options(obj: dict, prefix: str = "") -> dict:
    """The chat-template arguments in `obj` (keys CHAT_OPTIONS), checked; raises LineError naming
    prefix + the field. Absent keys are left out (transformers' defaults apply)."""
    out: dict[str, Any] = {}
    for key in CHAT_OPTIONS:
        v = obj.get(key)
        if v is None:
            continue
        where = prefix + key
        if key == "chat_template":
            if not isinstance(v, str) or not v.strip():
                raise LineError(where, "must be a non-empty string (a Jinja chat template)")
            if len(v) > MAX_TEMPLATE_CHARS:
                raise LineError(where, f"must be at most {MAX_TEMPLATE_CHARS:,} characters")
        elif key == "chat_template_kwargs":
            if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
                raise LineError(where, "must be an object of template variables")
            clash = next((k for k in v if k in CHAT_OPTIONS or k in ("messages", "conversation", "tokenize")), None)
            if clash is not None:
                raise LineError(where, f"{clash!r} is a chat-template argument of its own; give it outside")
        elif key in ("add_generation_prompt", "continue_final_message"):
            if not isinstance(v, bool):
                raise LineError(where, "must be true or false")
        elif not isinstance(v, list) or not all(isinstance(t, dict) for t in v):
            raise LineError(where, "must be a list of tool objects")
        out[key] = v
    if out.get("add_generation_prompt") and out.get("continue_final_message"):
        raise LineError(prefix + "continue_final_message", "excludes add_generation_prompt: true (give one)")
    if out.get("continue_final_message") and "add_generation_prompt" not in out:
        out["add_generation_prompt"] = False  # vLLM's rule: continuing a message adds no new turn
    return out


def need_tokenizer(tokenizer: Any, kind: str) -> None:
    if tokenizer is None:
        raise LineError(kind, "needs a tokenizer; use prompt_token_ids (this model has no tokenizer)")


def chat_token_ids(messages: list[dict], tokenizer: Any, max_model_len: int, *, add_generation_prompt: bool = True,
                   continue_final_message: bool = False, chat_template: str | None = None,
                   tools: list[dict] | None = None, chat_template_kwargs: dict | None = None) -> tuple[str, list[int]]:
    """(the rendered prompt, its token ids) for a conversation, with transformers' template
    arguments (LLM.chat's, as vLLM's LLM.chat passes them)."""
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise LineError("messages", "the model's tokenizer has no chat template; use prompt")
    options = dict(chat_template_kwargs or {})
    if continue_final_message:
        options["continue_final_message"] = True
    if tools is not None:
        options["tools"] = tools
    if chat_template is not None:
        options["chat_template"] = chat_template
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                                             **options)
    except Exception as e:  # a Jinja error from the model's template, e.g. "roles must alternate"
        raise LineError("messages", f"chat template failed: {clip(' '.join(str(e).split()), 200)}") from None
    # The template writes the BOS itself; encoding with special tokens would add a second one.
    ids = _encode(text, tokenizer, max_model_len, "messages", {"add_special_tokens": False})
    return text, _collapse_double_bos(ids, tokenizer)


_TOKEN_CHARS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _max_token_chars(tokenizer: Any) -> int:
    """The most characters of text one token can stand for: its longest vocabulary entry (a
    byte-level entry spells one character per byte, and a character is at least one byte)."""
    try:
        return _TOKEN_CHARS[tokenizer]
    except (KeyError, TypeError):
        pass
    longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
    try:
        _TOKEN_CHARS[tokenizer] = longest
    except TypeError:  # not weak-referenceable: computed again next time
        pass
    return longest


def _encode(text: str, tokenizer: Any, max_model_len: int, field: str, kwargs: dict) -> list[int]:
    """tokenizer.encode(text), tokenizing little more than the characters max_model_len tokens cover.

    Each token covers at most _max_token_chars characters, so the first (max_model_len + 1) times
    that many make more than max_model_len tokens and only that head is tokenized, to count them.
    (A tokenizer that drops characters, e.g. whitespace, may make fewer: the head doubles until it
    makes too many tokens or is the whole text, so such text is still tokenized exactly.)"""
    head = (max_model_len + 1) * _max_token_chars(tokenizer)
    while len(text) > head:
        n = len(tokenizer.encode(text[:head], **kwargs))
        if n > max_model_len:  # cutting the text changes the count by a token at most
            raise TooLong(field, f"prompt has more than {max_model_len - 1} tokens: its first {head:,} of "
                                  f"{len(text):,} characters make {n:,}; max_model_len is {max_model_len}")
        head *= 2
    return list(tokenizer.encode(text, **kwargs))


def check_vocab(ids: list[int], vocab_size: int, field: str) -> None:
    top = max(ids)
    if top >= vocab_size or min(ids) < 0:
        i, t = next((i, t) for i, t in enumerate(ids) if not 0 <= t < vocab_size)
        raise LineError(field, f"the tokenizer gave token id {t} (token {i}), outside the model's vocabulary "
                                f"[0, {vocab_size}): the tokenizer does not match the model")


def _collapse_double_bos(ids: list[int], tokenizer: Any) -> list[int]:
    """Drop a doubled leading BOS (e.g. a prompt that starts with "<s>" plus the tokenizer's own)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None:
        while len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
            ids = ids[1:]
    return ids
