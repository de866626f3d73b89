"""One `pagedrun generate` job, local or on Ray: recipe + prompts file -> outputs (+ report), resumable.

Order of work, the same for both: validate the recipe, take a snapshot of the prompts file (a
private copy of its bytes, size and sha256 recorded: what every pass reads), open the output's
lock and read what a previous run finished, check every line of the snapshot (pass 1, no
tokenization: a bad line stops the job before the model loads or a cluster is joined), start the
executor (load the model, or join Ray and size the actor pool), run with a progress bar while the
requests are tokenized as they are pulled (pass 2), say in one line if the prompts file changed
meanwhile, rewrite the output in input order (by the input line each record carries: the prompts
are not parsed again), write the report, print the summary, pick the exit code.
The prompts file is pagedrun's JSONL or an OpenAI batch file; the output follows its format.

What differs is the executor: cli/generate.py's LocalRun (one engine in this process) or
cli/ray/driver.py's RayRun (engines in Ray actors). Each has:
    start(console, quiet, num_requests=, plot=)
                                           load or connect; print what was started
    run(requests, on_output, on_tokens, stop)
                                           run the pulled requests; on_output(o) writes one
                                           (False: already written, a retried Ray batch)
    report(wall_s, interrupted) -> dict    the report of what it measured
    summary(console, report) -> report     what the summary table shows (Ray prints its replicas)
    results                                the finished outputs, or their RunTally
    close()
"""
from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from pagedrun.cli.progress_log import ProgressLog, timestamp
from pagedrun.errors import PagedrunError
from pagedrun.io.stdout_writer import is_stdout
from pagedrun.sampling_params import guided_note

# Exit codes of a run that finished (a user error exits 2 before any work; a signal 128 + its number).
EXIT_OK = 0  # every request has an output
EXIT_SOME_FAILED = 3  # some requests are error records in the output
EXIT_ALL_FAILED = 4  # every request is an error record
EXIT_RUN_FAILED = 5  # an error once requests began to run: what finished is kept, a resume goes on


class RunFailed(PagedrunError):
    """An error after requests began to run: not exit code 2, "nothing ran" (it came after all the work once)."""

    exit_code = EXIT_RUN_FAILED


def open_stream_output(writer, stream, records, *, output: Path, quiet: bool, console: Console) -> None:
    """Open the output of a run or a resumed one (io/stream.py): pass 1's error records are written
    now, the requests are pulled as the engine runs; what the output already holds is not run again."""
    writer.open()
    if writer.discarded and not quiet:
        console.print(f"{output}: dropped {writer.discarded} incomplete line(s) left by an interrupted run; "
                      "their requests will be redone", highlight=False, soft_wrap=True, markup=False)
    for bad in stream.invalid:
        key = stream.key_of_invalid(bad)
        if key not in writer:
            writer.write(records.invalid(bad), key, bad.line)
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
        from pagedrun.io.batch_output import error_line

        return error_line(bad.id, bad.custom_id, bad.code, bad.error)

    def finished(self, o, batch) -> dict:
        from pagedrun.io.jsonl import output_record

        if self.job is None or batch is None:
            return output_record(o)
        from pagedrun.io.batch_output import output_line

        return output_line(o, batch, self.job, self.tokenizer)


def job_exit_code(writer, total: int, output: Path, console: Console) -> int:
    """0 when every one of the job's `total` requests has an output, else 3 (some failed) or 4 (all
    failed), saying how many, even with --quiet. Counts the output file, so a resumed job counts its
    earlier runs; a line with no record at all (its bytes gone from a file cut short meanwhile) failed."""
    failed = min(total, len(writer.failed) + max(0, total - len(writer.done)))
    if not failed:
        return EXIT_OK
    code = EXIT_ALL_FAILED if failed == total else EXIT_SOME_FAILED
    where = "stdout" if is_stdout(output) else output
    console.print(f"{failed} of {total} requests failed (their error records are in {where}); exit code {code}",
                  style="yellow", highlight=False, soft_wrap=True, markup=False)
    return code


def print_summary(console: Console, results, wall: float, output: Path, report, written: tuple[int, int]) -> None:
    """written: (records, error records) this run wrote: every line it answered, whichever pass failed it."""
    from rich.table import Table

    from pagedrun.report.metrics import RunTally

    tally = RunTally.of(results)  # a list of RequestOutputs, or their tally: the tokens and latencies
    n_err = written[1]
    n_ok = written[0] - n_err
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


def run_job(*, recipe, prompts: Path, recipe_path: Path | None, output: Path, overwrite: bool, skip_invalid: bool,
            plot: Path | None, quiet: bool, console: Console, stop, make_executor,
            log_interval_s: float | None = None) -> int:
    from pagedrun.io.input_files import InputSnapshot
    from pagedrun.io.stdout_writer import StdoutWriter, is_stdout
    from pagedrun.io.writer import OutputWriter

    if not prompts.is_file():
        raise PagedrunError(f"{prompts}: prompts file not found")
    to_stdout = is_stdout(output)
    if to_stdout and overwrite:
        raise PagedrunError("-o -: --overwrite has no meaning for stdout (nothing is resumed there)")
    if not to_stdout and output.resolve() == prompts.resolve():
        raise PagedrunError(f"{output}: -o is the prompts file; choose another output path")
    if plot is not None:  # by -o's rules, now: a bad --plot costs nothing (io/file_safety.py)
        check_plot_option(plot, output, (prompts, recipe_path))
    # The bytes this job is made of, whatever happens to the file while it runs (io/input_files.py).
    snapshot = InputSnapshot.open(prompts, spool_dir=output.parent)
    executor = writer = None
    try:
        # Checked before the model loads: a refused resume (other recipe or prompts) costs nothing.
        fingerprint = {"recipe": recipe.fingerprint(), "prompts": snapshot.sha256}
        # Also checks every path the run will write and takes the output's lock (io/file_safety.py).
        writer = StdoutWriter() if to_stdout else OutputWriter(
            output, fingerprint, overwrite=overwrite, fsync_interval_s=recipe.output.fsync_interval_s,
            inputs=(prompts, recipe_path), report=recipe.output.report)
        executor = make_executor()  # cheap; Ray's says in one line when Ray is not installed
        # Pass 1 over the prompts (io/stream.py): a bad line fails here, before the model loads.
        with console.status("checking requests…", spinner="dots"):
            stream = check_requests(recipe, snapshot, skip_invalid, writer)
        if stream.other_models and not quiet:
            names = ", ".join(repr(m) for m in list(stream.other_models)[:3])
            console.print(f"{prompts.name}:{min(stream.other_models.values())}: body.model: {names} asked for; "
                          f"every line runs on this recipe's model, {stream.batch_job.model!r} (the outputs say so)",
                          style="yellow", highlight=False, soft_wrap=True, markup=False)
        for name, line in (stream.deprecated.items() if not quiet else ()):
            console.print(f"{prompts.name}:{line}: {guided_note(name)}", style="yellow", highlight=False,
                          soft_wrap=True, markup=False)
        log = ProgressLog.for_console(console, log_interval_s, quiet)
        return _run(executor, stream, writer, recipe=recipe, output=output, plot=plot, quiet=quiet,
                    console=console, stop=stop, inputs=tuple(p for p in (prompts, recipe_path) if p is not None),
                    log=log)
    finally:
        if executor is not None:
            executor.close()
        if writer is not None:
            writer.close()
        snapshot.close()
        stop.restore()


def _run(executor, stream, writer, *, recipe, output: Path, plot: Path | None, quiet: bool, console: Console,
         stop, inputs: tuple[Path, ...] = (), log: ProgressLog | None = None) -> int:
    from pagedrun.io.writer import request_key

    records = OutputRecords(stream.batch_job if stream.format == "openai" else None, stream.tokenizer)
    done = writer.__contains__
    open_stream_output(writer, stream, records, output=output, quiet=quiet, console=console)
    if not stream.num_pending and (writer.resumed or executor.skips_empty_runs):
        # Nothing left to run: put the file in input order, keep the report of the run that did the work.
        writer.finalize()
        if not quiet:
            console.print(f"nothing to do: all {stream.num_lines} requests are in {output}", highlight=False,
                          soft_wrap=True, markup=False)
        return job_exit_code(writer, stream.num_lines, output, console)
    # From here a first Ctrl-C or SIGTERM ends the job cleanly (every finished output kept), a second
    # one at once: during the load or the cluster's start too.
    stop.install()
    started_at = timestamp()
    executor.start(console, quiet, num_requests=stream.num_pending, plot=plot)

    log = log or ProgressLog(console, 0, enabled=False)
    t0 = time.perf_counter()
    counters = {"out_tokens": 0, "done": 0}
    total = stream.pending_completions
    log.line(f"generating: {total:,} completions to go, into {output}")
    progress = Progress(
        TextColumn("[bold]generating"), BarColumn(), MofNCompleteColumn(), TextColumn("completions"),
        TextColumn("{task.fields[tps]:>7.1f} tok/s"), TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
        console=console, disable=quiet, transient=False,
    )
    in_flight: dict[str, tuple] = {}  # request id -> (its batch line (OpenAI side), its input line), until written

    def pulled():
        for r in stream.requests(done, on_invalid):
            in_flight[r.id] = (r.batch, r.line)
            yield r

    def on_invalid(bad) -> None:  # a line that failed tokenization: its error record now
        writer.write(records.invalid(bad), stream.key_of_invalid(bad), bad.line)
        advance(1)

    def advance(n: int) -> None:
        progress.advance(task, n)
        counters["done"] += n
        log.tick(counters["done"], total, tok_per_s())

    def tok_per_s() -> float:
        return counters["out_tokens"] / max(time.perf_counter() - t0, 1e-9)

    def on_output(o) -> bool:
        if request_key(o.request_id) in writer:
            return False  # a retried Ray batch whose first attempt did return: answered once only
        batch, line = in_flight.pop(o.request_id, (None, 0))
        writer.write(records.finished(o, batch), input_line=line)
        advance(max(1, len(o.outputs)))
        return True

    def on_tokens(n: int) -> None:
        counters["out_tokens"] += n
        progress.update(task, tps=tok_per_s())

    try:  # from here requests run: an error is not "nothing ran" (exit code 2), whatever it is
        with progress:
            task = progress.add_task("generate", total=total, tps=0.0)
            executor.run(pulled(), on_output, on_tokens, stop)
        log.line(ProgressLog.status(counters["done"], total, tok_per_s(), time.perf_counter() - t0)
                 + (" (stopped)" if stop.stop else " (done)"))
        return _finish(executor, stream, writer, recipe=recipe, output=output, plot=plot, quiet=quiet,
                       console=console, stop=stop, inputs=inputs, wall=time.perf_counter() - t0,
                       started_at=started_at)
    except RunFailed:
        raise
    except PagedrunError as e:
        if is_stdout(output):
            raise RunFailed(f"{e}; {len(writer.done)} of {stream.num_lines} requests were written to stdout") from None
        raise RunFailed(f"{e}; {len(writer.done)} of {stream.num_lines} requests are in {output}: run the same "
                        "command again to resume") from None


def _finish(executor, stream, writer, *, recipe, output: Path, plot: Path | None, quiet: bool, console: Console,
            stop, inputs: tuple[Path, ...], wall: float, started_at: str | None = None) -> int:
    """After the run: the output in input order (or closed, if stopped), the report, the summary, the exit code."""
    change = stream.snapshot.change()
    if change:  # the outputs answer the snapshot, not the file as it is now: said, even with --quiet
        console.print(change, style="yellow", highlight=False, soft_wrap=True, markup=False)
    # A late signal interrupts nothing: every line has its record.
    interrupted = stop.stop and len(writer.done) < stream.num_lines
    if interrupted:
        writer.close()  # every finished request is in the file; the rest are redone on resume
    else:
        writer.finalize()

    report = report_file = None
    to_stdout = is_stdout(output)
    if recipe.output.report:
        from pagedrun.report.report import add_run_metadata, write_report

        report = count_records(executor.report(wall, interrupted), writer)
        add_run_metadata(report, run_metadata(recipe, executor, started_at))
        report_file = None if to_stdout else write_report(report, output)  # -o -: the summary only
        if plot is not None and executor.plots:
            try:
                executor.plot(plot, output, inputs)
            except PagedrunError as e:  # every output is written by now: say it, keep the job's exit code
                console.print(f"error: --plot not written: {e}", style="red", highlight=False, soft_wrap=True,
                              markup=False)
                plot = None
    if not quiet:
        print_summary(console, executor.results, wall, output, executor.summary(console, report),
                      (writer.written, writer.written_errors))
        if report_file is not None:
            drawn = f", plot: {plot}" if plot is not None and executor.plots else ""
            console.print(f"report: {report_file}{drawn}", highlight=False)
    if interrupted and to_stdout:
        console.print(f"stopped by {stop.signal_name}: {len(writer.done)} of {stream.num_lines} requests were "
                      "written to stdout (-o - cannot be resumed)", style="yellow", highlight=False,
                      soft_wrap=True, markup=False)
        return stop.exit_code
    if interrupted:
        console.print(f"stopped by {stop.signal_name}: {len(writer.done)} of {stream.num_lines} requests are in "
                      f"{output}; run the same command again (without --overwrite) to resume", style="yellow",
                      highlight=False, soft_wrap=True, markup=False)
        return stop.exit_code
    return job_exit_code(writer, stream.num_lines, output, console)


def run_metadata(recipe, executor, started_at: str | None) -> dict:
    """The report's `run`: what ran where and when (report/report.py describes it)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        ours = version("pagedrun")
    except PackageNotFoundError:  # run from a source tree that was never installed
        ours = None
    info = executor.model_info() if hasattr(executor, "model_info") else {}
    return {"model": model_name(recipe), **info, "pagedrun_version": ours, "machine": executor.machine(),
            "recipe": recipe.to_dict(), "started_at": started_at, "ended_at": timestamp()}


def count_records(report: dict, writer) -> dict:
    """The report's request counts are the records this run wrote: the engine's tally misses the lines
    that failed before reaching it (at either pass), which the summary and the exit code count."""
    counts = report["total"] if report.get("mode") == "ray" else report
    counts["num_requests"], counts["num_errors"] = writer.written, writer.written_errors
    return report


def check_plot_option(plot: Path, output: Path, inputs) -> None:
    """--plot's path (the rules of -o's derived files) and the extra that draws it, before any work."""
    import importlib.util

    from pagedrun.io.file_safety import check_plot

    check_plot(plot, output, tuple(Path(p) for p in inputs if p is not None))
    if importlib.util.find_spec("matplotlib") is None:
        raise PagedrunError("--plot needs matplotlib: pip install 'pagedrun[plot]'")


def check_requests(recipe, snapshot, skip_invalid: bool, writer):
    """Pass 1 over the prompts file's snapshot, with the tokenizer and limits of the recipe's model (no
    weights); the writer learns the input line of each record a previous run left."""
    from pagedrun.io.openai_batch import BatchJob
    from pagedrun.io.stream import RequestStream

    tokenizer, cfg, max_model_len = request_checker(recipe)
    # Ids derive from the file's content; `created` is its mtime when OUT was started, kept in OUT's meta
    # file for every resume (io/writer.py): one value per output file.
    if writer.created is None:
        writer.created = snapshot.mtime
    job = BatchJob(input_sha256=snapshot.sha256, model=model_name(recipe), created=writer.created,
                   system_fingerprint="pagedrun-" + recipe.fingerprint()[:16])
    stream = RequestStream(snapshot.path, recipe.sampling, vocab_size=cfg.vocab_size, max_model_len=max_model_len,
                           tokenizer=tokenizer, skip_invalid=skip_invalid, batch_job=job, snapshot=snapshot)
    stream.validate(writer.__contains__, writer.locate)
    return stream


def request_checker(recipe):
    """The tokenizer and limits the requests are checked against, without loading weights (a Ray
    driver may have no GPU; its engines live in the actors)."""
    from pagedrun.models.config import resolve_max_model_len
    from pagedrun.models.loader import load_tokenizer, read_config, resolve_model_dir

    model_dir = resolve_model_dir(recipe.model.path)
    cfg = read_config(model_dir, recipe.model.max_model_len)
    tokenizer = load_tokenizer(model_dir, recipe.model.chat_template)
    return tokenizer, cfg, resolve_max_model_len(recipe.model.max_model_len, cfg)


def model_name(recipe) -> str:
    """The model's name in outputs and the report: a Hugging Face cache snapshot's id (Qwen/Qwen3-0.6B),
    else its directory's name (SmolLM2-135M-Instruct by default)."""
    from pagedrun.config.hf_cache import model_id_of
    from pagedrun.models.loader import resolve_model_dir

    folder = resolve_model_dir(recipe.model.path)
    return model_id_of(folder) or folder.name
