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
# Shared with the Ray driver (distributed/), so below both; the exit codes (EXIT_*) are defined there.
from pagedrun.run_output import job_exit_code, open_output, print_summary


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
