"""Constraints -> grammars -> one matcher per sequence, through llguidance (an optional extra).

Why llguidance rather than xgrammar (vLLM offers both; measured in
docs/log/2026-11-23-structured-outputs.md): llguidance is one 3.1 MB wheel with no dependencies,
where xgrammar's metadata pulls triton (a 286 MB wheel) and apache-tvm-ffi into a CPU install; it
compiled our schema set faster; it refuses the JSON Schema keywords it cannot enforce (not,
if/then, uniqueItems, dependentRequired) with an error naming them, where xgrammar compiled `not`
and did not enforce it. Filling 64 masks cost the same in both. Its view of the tokenizer knows the
model's special tokens, so `<|im_start|>` and friends never appear inside constrained text
(xgrammar's view of SmolLM2 lists none: docs/log/2026-11-23-structured-outputs.md).

The matcher of a sequence follows the sequence's output tokens: `Grammar.sync` compares the count
it has accepted with the sequence's and rolls back or feeds the difference, so whatever the
scheduler did (recompute, swap) no token is ever accepted twice or skipped.

A grammar that compiles can still exceed the engine's limits while it runs (an Earley row of more
than 2,000 items, a lexer that builds too many states for `a{1000000}`, a recursion that never
closes): the matcher then refuses a token or computes no mask. Nothing here raises for that: the
sequence's Grammar records why (`error`), its mask lets every token through so that the step stays
finite, and the engine turns the request into an error record (engine/engine.py), the others run on.
What can be checked up front is: a `choice` compiles to one lexer terminal, not an alternation of
parser items, so every list the validator allows (MAX_CHOICES) stays inside the engine's row limit.
"""
from __future__ import annotations

import json
from typing import Any

from pagedrun.errors import PagedrunError
from pagedrun.structured.params import kind_of
from pagedrun.structured.strict import strict_schema

INSTALL_HINT = 'pip install -e ".[structured]"  (or: pip install "llguidance>=1.0,<2")'
_MAX_CACHED = 4096  # distinct constraints remembered; a batch has a handful, a hostile file many


def llguidance_module():
    """The llguidance module, or a one-line error with the install command."""
    try:
        import llguidance
    except ImportError:
        raise PagedrunError(f"structured outputs need the grammar engine llguidance: {INSTALL_HINT}") from None
    return llguidance


def spec_key(spec: dict) -> str:
    return json.dumps(spec, sort_keys=True, separators=(",", ":"))


_compiled: dict[str, tuple[str | None, str | None]] = {}  # spec key -> (llguidance grammar, error)


def compile_spec(spec: dict, strict: bool = True) -> tuple[str | None, str | None]:
    """(the llguidance grammar text, None) or (None, why the engine refuses it), cached. `strict`:
    the default of the spec's `disable_additional_properties` (structured/strict.py).

    Needs no tokenizer: a schema's problems are found when the request is read, naming its line."""
    strict = is_strict(spec, strict)
    key = spec_key(spec) + ("" if strict else "|lenient")
    hit = _compiled.get(key)
    if hit is not None:
        return hit
    llg = llguidance_module()
    from llguidance import LLMatcher

    flexible = not spec.get("disable_any_whitespace", False)
    kind = kind_of(spec)
    try:
        if kind in ("json", "json_object"):
            schema = spec["json"] if kind == "json" else {"type": "object"}
            if strict and kind == "json":
                schema = strict_schema(schema)
            grammar = LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": flexible})
        elif kind == "regex":
            # \d and \w are ASCII, as in JSON Schema patterns (Rust's Unicode \d allows digits like 🯸).
            grammar = LLMatcher.grammar_from_lark("start: /" + llg.regex_to_lark(spec["regex"], "dw") + "/")
        elif kind == "choice":
            # One terminal, an alternation of JSON-quoted literals (JSON string escapes are Lark's): the
            # lexer matches it, so a long list never meets the parser's limit of 2,000 items per row.
            grammar = LLMatcher.grammar_from_lark("start: CHOICE\nCHOICE: "
                                                  + " | ".join(json.dumps(c) for c in spec["choice"]))
        else:
            from llguidance import grammar_from

            grammar = grammar_from("grammar", spec["grammar"])  # Lark, or GBNF/EBNF converted to Lark
        error = LLMatcher.validate_grammar(grammar) or None
    except Exception as e:  # llguidance raises ValueError / RuntimeError with the reason
        grammar, error = None, " ".join(str(e).split()) or type(e).__name__
    if error is not None:
        grammar, error = None, f"the grammar engine cannot compile this {kind}: {_short(error)}"
    if len(_compiled) >= _MAX_CACHED:
        _compiled.clear()
    _compiled[key] = (grammar, error)
    return grammar, error


def is_strict(spec: dict, default: bool = True) -> bool:
    """Whether a json spec is compiled strictly: its own disable_additional_properties, else `default`."""
    return bool(spec.get("disable_additional_properties", default))


def _short(msg: str) -> str:
    msg = " ".join(msg.split())
    return msg if len(msg) <= 300 else msg[:297] + "..."


class Grammar:
    """One sequence's matcher, how many of its output tokens it has accepted, and, once the grammar
    engine gave up on it, why (then nothing more is fed to the matcher); mask_vocab: the width of its
    token masks, the grammar engine's vocabulary (0: the model's)."""

    __slots__ = ("matcher", "num_accepted", "error", "mask_vocab")

    def __init__(self, matcher: Any, num_accepted: int = 0, error: str | None = None, mask_vocab: int = 0):
        self.matcher = matcher
        self.num_accepted = num_accepted
        self.error = error
        self.mask_vocab = mask_vocab

    def fail(self, why: object) -> None:
        if self.error is None:
            text = why if isinstance(why, str) else (" ".join(str(why).split()) or type(why).__name__)
            self.error = (f"structured_outputs: the grammar engine gave up on this request after "
                          f"{self.num_accepted} output tokens: {_short(text.split('<state>')[0])}")

    def accept(self, token_id: int) -> bool:
        """Feed one token; False (and `error` set) when the engine refuses it: a limit met mid-run."""
        if self.error is not None:
            return False
        try:
            ok = self.matcher.consume_token(token_id)
        except Exception as e:  # llguidance raises ValueError / RuntimeError with the reason
            self.fail(e)
            return False
        if not ok:
            self.fail(self.matcher.get_error() or f"token {token_id} refused")
            return False
        self.num_accepted += 1
        return True

    def sync(self, output_token_ids: list[int]) -> None:
        """Bring the matcher to exactly the sequence's output tokens (rollback or feed the gap)."""
        if self.error is not None:
            return
        n = len(output_token_ids)
        try:
            if self.num_accepted > n:
                self.matcher.rollback(self.num_accepted - n)
                self.num_accepted = n
        except Exception as e:
            self.fail(e)
            return
        while self.num_accepted < n and self.accept(output_token_ids[self.num_accepted]):
            pass

    def fork(self) -> Grammar:
        if self.error is not None:
            return Grammar(self.matcher, self.num_accepted, self.error, self.mask_vocab)
        try:
            return Grammar(self.matcher.deep_copy(), self.num_accepted, mask_vocab=self.mask_vocab)
        except Exception as e:
            self.fail(e)
            return Grammar(self.matcher, self.num_accepted, self.error, self.mask_vocab)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token accepted: nothing more may follow."""
        return self.error is None and self.matcher.is_stopped()


class StructuredOutputManager:
    """The engine's grammars, keyed by sequence id (the scheduler never sees them)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: set[int], strict: bool = True):
        llguidance_module()
        self.strict = strict  # the recipe's structured_outputs.disable_additional_properties
        import llguidance.hf

        if tokenizer is None:
            raise PagedrunError("structured outputs need the model's tokenizer; this model has none")
        # Slow for a large vocabulary (docs/log/2026-11-27-figures-from-code-comments.md): built once,
        # on the first constrained request.
        # The grammar engine's vocabulary covers every token the tokenizer knows: a tokenizer larger than
        # the model's output layer (added tokens past its vocab_size) is refused by llguidance otherwise.
        # Masks are that wide; the sampler uses their first vocab_size bits (bitmask.py).
        self.mask_vocab = max(vocab_size, len(tokenizer))
        self.ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=self.mask_vocab,
                                                         eos_token=sorted(eos_token_ids))
        self.eos_token_ids = set(eos_token_ids)
        self.grammars: dict[int, Grammar] = {}
        self._initial: dict[str, Any] = {}  # spec key -> a fresh matcher, deep-copied per sequence

    def add(self, seq_id: int, spec: dict) -> None:
        from llguidance import LLMatcher

        key = spec_key(spec) + ("" if is_strict(spec, self.strict) else "|lenient")
        initial = self._initial.get(key)
        if initial is None:
            text, error = compile_spec(spec, self.strict)
            if error is not None:
                raise PagedrunError(f"structured_outputs: {error}")
            initial = LLMatcher(self.ll_tokenizer, text, log_level=0)
            if initial.is_error():
                raise PagedrunError(f"structured_outputs: the grammar engine cannot compile this "
                                    f"{kind_of(spec)}: {_short(initial.get_error())}")
            if len(self._initial) >= _MAX_CACHED:
                self._initial.clear()
            self._initial[key] = initial
        self.grammars[seq_id] = Grammar(initial.deep_copy(), mask_vocab=self.mask_vocab)

    def get(self, seq_id: int) -> Grammar | None:
        return self.grammars.get(seq_id)

    def error_of(self, seq_id: int) -> str | None:
        """Why the grammar engine gave up on this sequence, or None."""
        g = self.grammars.get(seq_id)
        return g.error if g is not None else None

    def row_grammar(self, seq: Any) -> Grammar | None:
        """The grammar that masks this sequence's next token, at exactly its output tokens."""
        g = self.grammars.get(seq.seq_id)
        if g is not None and g.num_accepted != seq.num_output_tokens:  # compare first: no list copy
            g.sync(seq.output_token_ids)
        return g

    def after_token(self, seq: Any) -> None:
        """Accept the sequence's new token. Once the grammar is complete only the stop token is
        allowed; when it is sampled the sequence ends, even under ignore_eos or min_tokens."""
        g = self.grammars.get(seq.seq_id)
        if g is None:
            return
        if seq.is_finished:
            if seq.finish_reason == "length":  # cut by max_tokens / max_model_len: is the structure whole?
                seq.structured_incomplete = not self._complete_with(g, seq.token_ids[-1])
            return
        token = seq.token_ids[-1]
        if g.error is not None:  # the engine fails the request (error_of)
            return
        if g.is_terminated:  # nothing may follow (the mask allowed only the stop token)
            seq.finish("stop", None)
            return
        if not g.accept(token):
            return
        if token in self.eos_token_ids:  # allowed only where the grammar may end: it has ended
            seq.finish("stop", None)

    @staticmethod
    def _complete_with(g: Grammar, token: int) -> bool:
        """Whether the grammar accepts the output as it stands with `token`, its last one, fed: a
        finished sequence's matcher is not used again, so a refusal here fails nothing."""
        if g.error is not None:
            return False
        try:
            if g.matcher.is_stopped():
                return True
            if not g.matcher.consume_token(token):
                return False
            g.num_accepted += 1
            return bool(g.matcher.is_accepting())
        except Exception:
            return False

    def fork(self, parent_id: int, child_id: int) -> None:
        g = self.grammars.get(parent_id)
        if g is not None:
            self.grammars[child_id] = g.fork()

    def free(self, seq_id: int) -> None:
        self.grammars.pop(seq_id, None)
