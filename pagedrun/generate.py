"""The `pagedrun generate` job: recipe + prompts file -> outputs.jsonl (+ report), resumable.

Order of work: validate the recipe, check the prompts file exists, load the model, parse and check
every request, open the output (resuming if it holds finished requests of the same job), run with a
progress bar, rewrite the output in input order, print the summary and write the report.
"""
from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from pagedrun.errors import PagedrunError
from pagedrun.recipe import load_recipe

# Exit codes of a run that finished (a user error exits 2 before any work; a signal 128 + its number).
EXIT_OK = 0  # every request has an output
EXIT_SOME_FAILED = 3  # some requests are error records in the output
EXIT_ALL_FAILED = 4  # every request is an error record


def run_generate(*, prompts: Path, recipe_path: Path | None, output: Path, overrides: list[str], overwrite: bool,
                 skip_invalid: bool, plot: Path | None, quiet: bool, console: Console, stop, ray: bool = False,
                 ray_address: str | None = None, replicas: int | None = None) -> int:
    from pagedrun.fingerprint import file_sha256
    from pagedrun.io.outputs import OutputWriter

    recipe = load_recipe(recipe_path, overrides)
    if not prompts.is_file():
        raise PagedrunError(f"{prompts}: prompts file not found")
    if output.resolve() == prompts.resolve():
        raise PagedrunError(f"{output}: -o is the prompts file; choose another output path")
    # Checked before the model loads: a refused resume (other recipe or prompts) costs nothing.
    fingerprint = {"recipe": recipe.fingerprint(), "prompts": file_sha256(prompts)}
    # Also checks every path the run will write and takes the output's lock (io/output_files.py).
    writer = OutputWriter(output, fingerprint, overwrite=overwrite, fsync_interval_s=recipe.output.fsync_interval_s,
                          inputs=(prompts, recipe_path), report=recipe.output.report)
    if ray or ray_address is not None or replicas is not None or recipe.distributed.address is not None:
        # Data-parallel over a Ray cluster: the engines live in Ray actors (pagedrun/distributed/).
        from pagedrun.distributed import run_distributed

        stop.install()
        try:
            return run_distributed(recipe=recipe, prompts=prompts, writer=writer, output=output,
                                   skip_invalid=skip_invalid, plot=plot, quiet=quiet, console=console, stop=stop,
                                   address=ray_address, replicas=replicas)
        finally:
            writer.close()
            stop.restore()
    from pagedrun.engine.llm import LLM  # imports torch: seconds, so after the cheap checks

    t_load = time.perf_counter()
    with console.status("loading model…", spinner="dots"):
        llm = LLM(recipe)
    load_s = time.perf_counter() - t_load
    requests, invalid = llm.read_requests(prompts, skip_invalid=skip_invalid)
    if not quiet:
        print_startup(console, llm, load_s)

    # Error records are keyed by line, requests by id (see pagedrun/io/outputs.py): a duplicate-id
    # line's error record must not replace the request it duplicates.
    stop.install()
    try:
        return _run_and_write(llm, requests, invalid, writer, recipe=recipe, load_s=load_s, output=output,
                              plot=plot, quiet=quiet, console=console, stop=stop)
    finally:
        writer.close()
        stop.restore()


def open_output(writer, requests, invalid, *, output: Path, quiet: bool, console: Console):
    """Open the output of a run or a resumed one (also the Ray driver's): error records keyed by line,
    requests by id; what the output already holds is not run again.
    Returns (requests to run, every key in input order)."""
    from pagedrun.engine.llm import invalid_record
    from pagedrun.io.outputs import invalid_key, request_key

    writer.open()
    if writer.discarded and not quiet:
        console.print(f"{output}: dropped {writer.discarded} incomplete line(s) left by an interrupted run; "
                      "their requests will be redone", highlight=False, soft_wrap=True, markup=False)
    for bad in invalid:
        if invalid_key(bad.line) not in writer:
            rec = invalid_record(bad)
            writer.write({"id": rec["id"], "line": bad.line, **rec}, invalid_key(bad.line))
    pending = [r for r in requests if request_key(r.id) not in writer]
    order = [k for _, k in sorted([(r.line, request_key(r.id)) for r in requests]
                                  + [(b.line, invalid_key(b.line)) for b in invalid])]
    if writer.resumed and not quiet:
        console.print(f"resuming {output}: {writer.resumed} requests already done, {len(pending)} to go",
                      highlight=False, soft_wrap=True, markup=False)
    return pending, order


def _run_and_write(llm, requests, invalid, writer, *, recipe, load_s: float, output: Path, plot: Path | None,
                   quiet: bool, console: Console, stop) -> int:
    from pagedrun.engine.llm import output_record

    engine = llm.engine
    pending, order = open_output(writer, requests, invalid, output=output, quiet=quiet, console=console)
    if writer.resumed and not pending:
        # Nothing left to run: put the file in input order, keep the report of the run that did the work.
        writer.finalize(order)
        if not quiet:
            console.print(f"nothing to do: all {len(order)} requests are in {output}", highlight=False, soft_wrap=True,
                          markup=False)
        return job_exit_code(writer, order, output, console)

    total = sum(r.sampling.n for r in pending)
    t0 = time.perf_counter()
    counters = {"out_tokens": 0}
    progress = Progress(
        TextColumn("[bold]generating"), BarColumn(), MofNCompleteColumn(), TextColumn("completions"),
        TextColumn("{task.fields[tps]:>7.1f} tok/s"), TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
        console=console, disable=quiet, transient=False,
    )

    def on_output(o) -> None:
        writer.write(output_record(o))
        progress.advance(task, max(1, len(o.outputs)))

    def on_step(rec) -> None:
        counters["out_tokens"] += rec.num_sampled_tokens
        progress.update(task, tps=counters["out_tokens"] / max(time.perf_counter() - t0, 1e-9))

    with progress:
        task = progress.add_task("generate", total=total, tps=0.0)
        results = llm.run(pending, on_output=on_output, on_step=on_step, should_stop=stop)
    wall = time.perf_counter() - t0
    interrupted = stop.stop and any(k not in writer for k in order)  # a late signal interrupts nothing
    if interrupted:
        writer.close()  # every finished request is in the file; the rest are redone on resume
    else:
        writer.finalize(order)

    report = None
    if recipe.output.report:
        from pagedrun.report import build_report, write_report

        report = build_report(engine, results, wall_s=wall, load_s=load_s, interrupted=interrupted)
        report_file = write_report(report, output)
        if plot is not None:
            from pagedrun.report import plot_blocks

            plot_blocks(engine, plot)
    if not quiet:
        print_summary(console, results, wall, output, report, invalid)
        if report is not None:
            console.print(f"report: {report_file}" + (f", plot: {plot}" if plot is not None else ""), highlight=False)
    if interrupted:
        done = len(writer.done)
        console.print(f"stopped by {stop.signal_name}: {done} of {len(order)} requests are in {output}; "
                      "run the same command again (without --overwrite) to resume", style="yellow",
                      highlight=False, soft_wrap=True, markup=False)
        return stop.exit_code
    return job_exit_code(writer, order, output, console)


def job_exit_code(writer, order, output: Path, console: Console) -> int:
    """0 when every request of the job has an output, else 3 (some failed) or 4 (all failed), saying
    how many, even with --quiet. Counts the output file, so a resumed job counts its earlier runs."""
    failed = sum(1 for k in order if "error" in writer.done.get(k, {}))
    if not failed:
        return EXIT_OK
    code = EXIT_ALL_FAILED if failed == len(order) else EXIT_SOME_FAILED
    console.print(f"{failed} of {len(order)} requests failed (their error records are in {output}); exit code {code}",
                  style="yellow", highlight=False, soft_wrap=True, markup=False)
    return code


def print_startup(console: Console, llm, load_s: float) -> None:
    e = llm.engine
    m = e.memory
    cfg = e.model_config
    console.print(
        f"[bold]model[/] {e.model_dir.name} ({cfg.architecture}, {cfg.num_parameters() / 1e6:.1f}M params, "
        f"{e.recipe.model.dtype}, {e.device}) loaded in {load_s:.1f}s; attention backend: {e.backend.name}",
        highlight=False,
    )
    from pagedrun.report import cpu_kernels_status

    kernels = cpu_kernels_status(e)
    if kernels is not None:  # without them a CPU run is ~1.6x slower: never silently
        console.print(f"cpu kernels: {kernels}", highlight=False, markup=False, soft_wrap=True)
    # The short form of `pagedrun profile-memory`: what the profile measured, what the budget became.
    for line in m.summary():
        console.print(f"[bold]memory[/] {line}", highlight=False)


def print_summary(console: Console, results, wall: float, output: Path, report, invalid) -> None:
    from rich.table import Table

    n_ok = sum(1 for r in results if r.error is None)
    n_err = sum(1 for r in results if r.error is not None) + len(invalid)
    out_tokens = sum(len(c.token_ids) for r in results for c in r.outputs)
    prompt_tokens = sum(len(r.prompt_token_ids) for r in results)
    t = Table(title="pagedrun generate", show_header=False, box=None)
    t.add_row("requests", f"{n_ok} done" + (f", {n_err} errors" if n_err else ""))
    t.add_row("tokens", f"{prompt_tokens:,} prompt, {out_tokens:,} output")
    t.add_row("wall time", f"{wall:.2f} s")
    t.add_row("throughput", f"{out_tokens / max(wall, 1e-9):.1f} output tok/s, "
                            f"{(out_tokens + prompt_tokens) / max(wall, 1e-9):.1f} total tok/s")
    t.add_row("outputs", str(output))
    if report is not None:
        from pagedrun.report import summary_rows

        for k, v in summary_rows(report):
            t.add_row(k, v)
    console.print(t)
