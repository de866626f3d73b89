"""What a run does around the engine that a local run (cli/generate.py) and a Ray run
(cli/ray/driver.py) share: open the output (resume), print the summary, pick the exit code.

Below both, so neither imports the other (cli/generate.py imports cli/ray/ for --ray).
"""
from __future__ import annotations

from pathlib import Path

from rich.console import Console

# Exit codes of a run that finished (a user error exits 2 before any work; a signal 128 + its number).
EXIT_OK = 0  # every request has an output
EXIT_SOME_FAILED = 3  # some requests are error records in the output
EXIT_ALL_FAILED = 4  # every request is an error record


def open_output(writer, requests, invalid, *, output: Path, quiet: bool, console: Console):
    """Open the output of a run or a resumed one (also the Ray driver's): error records keyed by line,
    requests by id; what the output already holds is not run again.
    Returns (requests to run, every key in input order)."""
    from pagedrun.io.jsonl import invalid_record
    from pagedrun.io.writer import invalid_key, request_key

    writer.open()
    if writer.discarded and not quiet:
        console.print(f"{output}: dropped {writer.discarded} incomplete line(s) left by an interrupted run; "
                      "their requests will be redone", highlight=False, soft_wrap=True, markup=False)
    for bad in invalid:
        if invalid_key(bad.line) not in writer:
            writer.write(invalid_record(bad), invalid_key(bad.line))
    pending = [r for r in requests if request_key(r.id) not in writer]
    order = [k for _, k in sorted([(r.line, request_key(r.id)) for r in requests]
                                  + [(b.line, invalid_key(b.line)) for b in invalid])]
    if writer.resumed and not quiet:
        console.print(f"resuming {output}: {writer.resumed} requests already done, {len(pending)} to go",
                      highlight=False, soft_wrap=True, markup=False)
    return pending, order


def open_stream_output(writer, stream, records, *, output: Path, quiet: bool, console: Console) -> None:
    """open_output for a streamed run (io/stream.py): pass 1's error records are written now,
    the requests are pulled as the engine runs."""
    writer.open()
    if writer.discarded and not quiet:
        console.print(f"{output}: dropped {writer.discarded} incomplete line(s) left by an interrupted run; "
                      "their requests will be redone", highlight=False, soft_wrap=True, markup=False)
    for bad in stream.invalid:
        key = stream.key_of_invalid(bad)
        if key not in writer:
            writer.write(records.invalid(bad), key)
    if writer.resumed and not quiet:
        console.print(f"resuming {output}: {writer.resumed} requests already done, {stream.num_pending} to go",
                      highlight=False, soft_wrap=True, markup=False)


class OutputRecords:
    """The output lines of a run in its input's format: pagedrun's JSONL records, or, for an OpenAI
    batch file (`job` given), the Batch API's output lines (io/openai_batch.py)."""

    def __init__(self, job, tokenizer) -> None:
        self.job, self.tokenizer = job, tokenizer

    def invalid(self, bad) -> dict:
        from pagedrun.io.jsonl import invalid_record

        if self.job is None:
            return invalid_record(bad)
        from pagedrun.io.openai_batch import error_line

        return error_line(bad.id, bad.custom_id, bad.code, bad.error)

    def finished(self, o, batch) -> dict:
        from pagedrun.io.jsonl import output_record

        if self.job is None or batch is None:
            return output_record(o)
        from pagedrun.io.openai_batch import output_line

        return output_line(o, batch, self.job, self.tokenizer)


def job_exit_code(writer, order, output: Path, console: Console) -> int:
    """0 when every request of the job has an output, else 3 (some failed) or 4 (all failed), saying
    how many, even with --quiet. Counts the output file, so a resumed job counts its earlier runs."""
    total = failed = 0
    for k in order:  # may be a generator (io/stream.py): read once
        total += 1
        failed += k in writer.failed
    if not failed:
        return EXIT_OK
    code = EXIT_ALL_FAILED if failed == total else EXIT_SOME_FAILED
    console.print(f"{failed} of {total} requests failed (their error records are in {output}); exit code {code}",
                  style="yellow", highlight=False, soft_wrap=True, markup=False)
    return code


def print_summary(console: Console, results, wall: float, output: Path, report, invalid) -> None:
    from rich.table import Table

    from pagedrun.report.metrics import RunTally

    tally = RunTally.of(results)  # a list of RequestOutputs, or their tally
    n_ok = tally.num_ok
    n_err = tally.num_errors + (invalid if isinstance(invalid, int) else len(invalid))
    out_tokens = tally.output_tokens
    prompt_tokens = tally.prompt_tokens + tally.error_prompt_tokens
    t = Table(title="pagedrun generate", show_header=False, box=None)
    t.add_column(no_wrap=True)
    # Values wrap at their spaces; a word longer than the column (a long path) folds, never cut to "…".
    t.add_column(overflow="fold")
    t.add_row("requests", f"{n_ok} done" + (f", {n_err} errors" if n_err else ""))
    t.add_row("tokens", f"{prompt_tokens:,} prompt, {out_tokens:,} output")
    t.add_row("wall time", f"{wall:.2f} s")
    t.add_row("throughput", f"{out_tokens / max(wall, 1e-9):.1f} output tok/s, "
                            f"{(out_tokens + prompt_tokens) / max(wall, 1e-9):.1f} total tok/s")
    t.add_row("outputs", str(output))
    if report is not None:
        from pagedrun.report.report import summary_rows

        for k, v in summary_rows(report):
            t.add_row(k, v)
    console.print(t)
