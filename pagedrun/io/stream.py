"""A prompts file of any size, streamed: checked whole up front, tokenized in a window as the engine
pulls, and put in input order at the end by the line each record carries, so memory does not grow with
its outputs.

    stream = RequestStream(path, ..., snapshot=InputSnapshot.open(path))
    stream.validate(done, locate) # pass 1: JSON, fields, values, unique ids; no tokenizer work. A bad
                                  # line fails here, naming file, line and field, before the model loads
    llm.run(stream.requests(done, on_invalid), window=...)   # pass 2: the lines still to run
    writer.finalize()             # in input order: each record's line is known (locate, Request.line)

Both passes read the snapshot (io/input_files.py): a private copy of the bytes the file held when
the run started, so nothing done to the file during the run changes what runs.
The final order is not read from the file again: pass 1 tells `locate(key, line)` the line of each
record a previous run left, and every record written now carries its line.

`done(key)` says whether the output already holds a line's record (a resumed run skips it). What
only tokenization can find (a prompt longer than max_model_len, a chat template that fails, token
ids outside the model's vocabulary) is found in pass 2 and becomes that line's error record, with or
without skip_invalid: the run has started by then. Each pass reads the file line by line; what is
kept per line is pass 1's id table (for duplicate ids, freed after it) and the line numbers of the
lines that cannot run.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from pagedrun.errors import PagedrunError
from pagedrun.io.input_files import InputSnapshot
from pagedrun.io.openai_batch import BatchJob
from pagedrun.io.requests import (
    OPENAI,
    InvalidRequest,
    LineChecker,
    LineFailure,
    Request,
)
from pagedrun.io.writer import Key, request_key
from pagedrun.sampling_params import SamplingParams


class RequestStream:
    def __init__(self, path: Path, defaults: SamplingParams, *, vocab_size: int, max_model_len: int,
                 tokenizer: Any, skip_invalid: bool = False, batch_job: BatchJob | None = None,
                 snapshot: InputSnapshot | None = None) -> None:
        self.path = Path(path)
        self._snapshot = snapshot
        self.defaults, self.vocab_size, self.max_model_len = defaults, vocab_size, max_model_len
        self.tokenizer, self.skip_invalid, self.batch_job = tokenizer, skip_invalid, batch_job
        self.format: str | None = None
        self.num_lines = 0  # non-blank lines: the job's requests
        self.num_pending = 0  # requests (lines that can run) not yet in the output
        self.pending_completions = 0  # their completions (n each)
        self.invalid: list[InvalidRequest] = []  # pass 1's lines that cannot run
        self.other_models: dict[str, int] = {}  # a batch body's model other than the recipe's -> first line
        self.deprecated: dict[str, int] = {}  # a legacy field used (guided_json, ...) -> its first line
        self.tokenized = 0  # requests pass 2 has tokenized so far (the window's tests read it)
        self._bad_lines: set[int] = set()  # pass 1's invalid lines

    def _lines(self) -> Iterator[tuple[int, bytes]]:
        """(line number, bytes) of each non-blank line of the snapshot, read a line at a time."""
        for lineno, raw in enumerate(self.snapshot.lines(), start=1):
            if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):  # a UTF-8 BOM some editors write
                raw = raw[3:]
            raw = raw.rstrip(b"\n")
            if raw.strip():
                yield lineno, raw

    @property
    def snapshot(self) -> InputSnapshot:
        if self._snapshot is None:  # taken at the first pass when the caller took none
            self._snapshot = InputSnapshot.open(self.path)
        return self._snapshot

    def _checker(self, unique_ids: bool = False) -> LineChecker:
        """Pass 1's checks ids for duplicates; the later passes skip the lines it refused, so keep no table."""
        return LineChecker(self.path.name, self.defaults, vocab_size=self.vocab_size, tokenizer=self.tokenizer,
                           batch_job=self.batch_job, unique_ids=unique_ids)

    # ---- pass 1 ---------------------------------------------------------------------------------
    def validate(self, done: Callable[[Key], bool] = lambda key: False,
                 locate: Callable[[Key, int], None] = lambda key, line: None) -> None:
        """Check every line; raises PagedrunError at the first bad one unless skip_invalid. locate(key,
        line) is told the input line of every record the output already holds."""
        from pagedrun.io.writer import invalid_key

        checker = self._checker(unique_ids=True)
        for lineno, raw in self._lines():
            self.num_lines += 1
            try:
                spec = checker.check(raw, lineno)
            except LineFailure as e:
                if not self.skip_invalid:
                    raise PagedrunError(str(e)) from None
                self.invalid.append(e.bad)
                self._bad_lines.add(lineno)
                continue
            key = request_key(spec.id)
            if done(key):
                locate(key, lineno)
            elif done(invalid_key(lineno)):  # failed tokenization in an earlier run (pagedrun's format)
                locate(invalid_key(lineno), lineno)
            else:
                self.num_pending += 1
                self.pending_completions += spec.sampling.n
        if not self.num_lines:
            raise PagedrunError(f"{self.path.name}: no requests")
        self.format, self.other_models = checker.format, checker.other_models
        self.deprecated = checker.deprecated
        if self.format == OPENAI:  # lines that failed before the first batch line decided the format
            for bad in self.invalid:
                if bad.line < checker.format_line:
                    bad.id = self.batch_job.error_line_id(bad.line)
        for bad in self.invalid:
            if done(self.key_of_invalid(bad)):
                locate(self.key_of_invalid(bad), bad.line)

    def key_of_invalid(self, bad: InvalidRequest) -> Key:
        """An error record's key: by line in pagedrun's format; a batch file's by its id (io/writer.py)."""
        from pagedrun.io.writer import invalid_key

        return request_key(bad.id) if self.format == OPENAI else invalid_key(bad.line)

    # ---- pass 2 ---------------------------------------------------------------------------------
    def requests(self, done: Callable[[Key], bool], on_invalid: Callable[[InvalidRequest], None]) -> Iterator[Request]:
        """The requests not yet done, in file order, each tokenized when it is pulled. A line that
        fails tokenization goes to on_invalid (unless its error record is done) and is not yielded."""
        checker = self._checker()
        for lineno, raw in self._lines():
            if lineno in self._bad_lines:
                continue
            try:
                spec = checker.check(raw, lineno)
            except LineFailure as e:  # cannot happen to a snapshot; were it to, that line's error, not the job's
                e.bad.error += " (the line changed during the run)"
                if not done(self.key_of_invalid(e.bad)):
                    on_invalid(e.bad)
                continue
            if done(request_key(spec.id)):
                continue
            try:
                request = checker.tokenize(spec, self.max_model_len)
            except LineFailure as e:
                if not done(self.key_of_invalid(e.bad)):
                    on_invalid(e.bad)
                continue
            self.tokenized += 1
            yield request
