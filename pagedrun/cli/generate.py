"""The `pagedrun generate` job: recipe + prompts file -> outputs.jsonl (+ report), resumable.

Order of work: validate the recipe, check the prompts file exists, open the output's lock and read
what a previous run finished, check every line of the prompts file (pass 1, no tokenization: a bad
line stops the job before the model loads), load the model, run with a progress bar while the
requests are tokenized in a window ahead of the engine (pass 2), rewrite the output in input order
(pass 3 reads the order from the prompts file again), print the summary and write the report.
The prompts file is pagedrun's JSONL or an OpenAI batch file; the output follows its format.
"""
from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

# Shared with the Ray driver (cli/ray/), so below both; the exit codes (EXIT_*) are defined there.
from pagedrun.cli.job import job_exit_code, open_stream_output, print_summary
from pagedrun.config.recipe import load_recipe
from pagedrun.errors import PagedrunError


def run_generate(*, prompts: Path, recipe_path: Path | None, output: Path, overrides: list[str], overwrite: bool,
                 skip_invalid: bool, plot: Path | None, quiet: bool, console: Console, stop, ray: bool = False,
                 ray_address: str | None = None, replicas: int | None = None) -> int:
    from pagedrun.io.fingerprint import file_sha256
    from pagedrun.io.writer import OutputWriter

    recipe = load_recipe(recipe_path, overrides)
    if not prompts.is_file():
        raise PagedrunError(f"{prompts}: prompts file not found")
    if output.resolve() == prompts.resolve():
        raise PagedrunError(f"{output}: -o is the prompts file; choose another output path")
    # Checked before the model loads: a refused resume (other recipe or prompts) costs nothing.
    fingerprint = {"recipe": recipe.fingerprint(), "prompts": file_sha256(prompts)}
    # Also checks every path the run will write and takes the output's lock (io/file_safety.py).
    writer = OutputWriter(output, fingerprint, overwrite=overwrite, fsync_interval_s=recipe.output.fsync_interval_s,
                          inputs=(prompts, recipe_path), report=recipe.output.report)
    if ray or ray_address is not None or replicas is not None or recipe.distributed.address is not None:
        # Data-parallel over a Ray cluster: the engines live in Ray actors (pagedrun/cli/ray/).
        from pagedrun.cli.ray import run_distributed

        stop.install()
        try:
            return run_distributed(recipe=recipe, prompts=prompts, writer=writer, output=output,
                                   skip_invalid=skip_invalid, plot=plot, quiet=quiet, console=console, stop=stop,
                                   address=ray_address, replicas=replicas)
        finally:
            writer.close()
            stop.restore()
    # Pass 1 over the prompts (io/stream.py): a bad line fails here, before the model loads.
    with console.status("checking requests…", spinner="dots"):
        stream = _check_requests(recipe, prompts, fingerprint["prompts"], skip_invalid, writer)
    if stream.other_models and not quiet:
        names = ", ".join(repr(m) for m in list(stream.other_models)[:3])
        console.print(f"{prompts.name}:{min(stream.other_models.values())}: body.model: {names} asked for; "
                      f"every line runs on this recipe's model, {stream.batch_job.model!r} (the outputs say so)",
                      style="yellow", highlight=False, soft_wrap=True, markup=False)
    from pagedrun.llm import LLM  # imports torch: seconds, so after the cheap checks

    t_load = time.perf_counter()
    with console.status("loading model…", spinner="dots"):
        llm = LLM(recipe)
    load_s = time.perf_counter() - t_load
    if not quiet:
        print_startup(console, llm, load_s)

    stop.install()
    try:
        return _run_and_write(llm, stream, writer, recipe=recipe, load_s=load_s, output=output,
                              plot=plot, quiet=quiet, console=console, stop=stop)
    finally:
        writer.close()
        stop.restore()


def _check_requests(recipe, prompts: Path, prompts_sha256: str, skip_invalid: bool, writer):
    """Pass 1 over the prompts file, with the tokenizer and limits of the recipe's model (no weights)."""
    from pagedrun.cli.ray.driver import request_checker
    from pagedrun.io.openai_batch import BatchJob
    from pagedrun.io.stream import RequestStream

    tokenizer, cfg, max_model_len = request_checker(recipe)
    # Ids derive from the file's content; `created` is its mtime: both stable when a job is re-run.
    job = BatchJob(input_sha256=prompts_sha256, model=model_name(recipe), created=int(prompts.stat().st_mtime),
                   system_fingerprint="pagedrun-" + recipe.fingerprint()[:16])
    stream = RequestStream(prompts, recipe.sampling, vocab_size=cfg.vocab_size, max_model_len=max_model_len,
                           tokenizer=tokenizer, skip_invalid=skip_invalid, batch_job=job)
    stream.validate(lambda key: key in writer)
    return stream


def model_name(recipe) -> str:
    """The model's name in a batch file's outputs: its directory's (SmolLM2-135M-Instruct by default)."""
    from pagedrun.models.loader import resolve_model_dir

    return resolve_model_dir(recipe.model.path).name


def _run_and_write(llm, stream, writer, *, recipe, load_s: float, output: Path, plot: Path | None,
                   quiet: bool, console: Console, stop) -> int:
    from pagedrun.cli.job import OutputRecords
    from pagedrun.report.metrics import RunTally

    engine = llm.engine
    records = OutputRecords(stream.batch_job if stream.format == "openai" else None, llm.tokenizer)
    done = writer.__contains__
    open_stream_output(writer, stream, records, output=output, quiet=quiet, console=console)
    if writer.resumed and not stream.num_pending:
        # Nothing left to run: put the file in input order, keep the report of the run that did the work.
        writer.finalize(stream.order(done))
        if not quiet:
            console.print(f"nothing to do: all {stream.num_lines} requests are in {output}", highlight=False,
                          soft_wrap=True, markup=False)
        return job_exit_code(writer, stream.order(done), output, console)

    t0 = time.perf_counter()
    counters = {"out_tokens": 0}
    progress = Progress(
        TextColumn("[bold]generating"), BarColumn(), MofNCompleteColumn(), TextColumn("completions"),
        TextColumn("{task.fields[tps]:>7.1f} tok/s"), TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
        console=console, disable=quiet, transient=False,
    )
    in_flight: dict[str, object] = {}  # request id -> its batch line (OpenAI side), until written

    def pulled():
        for r in stream.requests(done, on_invalid):
            in_flight[r.id] = r.batch
            yield r

    def on_invalid(bad) -> None:  # a line that failed tokenization: its error record now
        writer.write(records.invalid(bad), stream.key_of_invalid(bad))
        progress.advance(task, 1)

    def on_output(o) -> None:
        writer.write(records.finished(o, in_flight.pop(o.request_id, None)))
        progress.advance(task, max(1, len(o.outputs)))

    def on_step(rec) -> None:
        counters["out_tokens"] += rec.num_sampled_tokens
        progress.update(task, tps=counters["out_tokens"] / max(time.perf_counter() - t0, 1e-9))

    tally = RunTally()
    with progress:
        task = progress.add_task("generate", total=stream.pending_completions, tps=0.0)
        llm.run(pulled(), on_output=on_output, on_step=on_step, should_stop=stop,
                window=request_window(recipe), tally=tally)
    wall = time.perf_counter() - t0
    # A late signal interrupts nothing: every line has its record.
    interrupted = stop.stop and len(writer.done) < stream.num_lines
    if interrupted:
        writer.close()  # every finished request is in the file; the rest are redone on resume
    else:
        writer.finalize(stream.order(done))

    report = None
    if recipe.output.report:
        from pagedrun.report.report import build_report, write_report

        report = build_report(engine, tally, wall_s=wall, load_s=load_s, interrupted=interrupted)
        report_file = write_report(report, output)
        if plot is not None:
            from pagedrun.report.report import plot_blocks

            plot_blocks(engine, plot)
    if not quiet:
        print_summary(console, tally, wall, output, report, len(stream.invalid))
        if report is not None:
            console.print(f"report: {report_file}" + (f", plot: {plot}" if plot is not None else ""), highlight=False)
    if interrupted:
        console.print(f"stopped by {stop.signal_name}: {len(writer.done)} of {stream.num_lines} requests are in "
                      f"{output}; run the same command again (without --overwrite) to resume", style="yellow",
                      highlight=False, soft_wrap=True, markup=False)
        return stop.exit_code
    return job_exit_code(writer, stream.order(done), output, console)


def request_window(recipe) -> int:
    """Requests tokenized ahead of the engine, waiting for admission: enough to refill the running batch
    twice over between steps, few enough that a file of any size costs the same memory."""
    return 2 * recipe.scheduler.max_num_seqs


def print_startup(console: Console, llm, load_s: float) -> None:
    e = llm.engine
    m = e.memory
    cfg = e.model_config
    console.print(
        f"[bold]model[/] {e.worker.model_dir.name} ({cfg.architecture}, {cfg.num_parameters() / 1e6:.1f}M params, "
        f"{e.recipe.model.dtype}, {e.worker.device}) loaded in {load_s:.1f}s; attention backend: {e.worker.backend.name}",
        highlight=False,
    )
    from pagedrun.report.report import cpu_kernels_status

    kernels = cpu_kernels_status(e)
    if kernels is not None:  # without them a CPU run is ~1.6x slower: never silently
        console.print(f"cpu kernels: {kernels}", highlight=False, markup=False, soft_wrap=True)
    # The short form of `pagedrun profile-memory`: what the profile measured, what the budget became.
    for line in m.summary():
        console.print(f"[bold]memory[/] {line}", highlight=False)
