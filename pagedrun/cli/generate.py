"""`pagedrun generate`: the job (cli/job.py) run by one engine in this process, or by Ray actors.

LocalRun is the local executor: it loads the model once the requests have been checked, feeds the
engine from the request stream in a window (tokenized as pulled, so memory does not grow with the
file), and reports what that engine measured.
"""
from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console

from pagedrun.cli.job import run_job
from pagedrun.config.recipe import load_recipe


def run_generate(*, prompts: Path, recipe_path: Path | None, output: Path, overrides: list[str], overwrite: bool,
                 skip_invalid: bool, plot: Path | None, quiet: bool, console: Console, stop, ray: bool = False,
                 ray_address: str | None = None, replicas: int | None = None,
                 log_interval_s: float | None = None) -> int:
    from pagedrun.models.model_defaults import apply_model_defaults

    recipe = load_recipe(recipe_path, overrides)
    on_ray = ray or ray_address is not None or replicas is not None or recipe.distributed.address is not None
    # Before the job's fingerprint: the defaults the model contributes (generation_config.json,
    # dtype: auto) are part of what the job is. Resolved here, once, for Ray too: every replica runs
    # the same dtype (this machine's reading of auto; --dtype names another), and a job started
    # locally resumes on Ray and the other way round.
    recipe = apply_model_defaults(recipe)
    if on_ray:
        # Data-parallel over a Ray cluster: the engines live in Ray actors (pagedrun/cli/ray/).
        from pagedrun.cli.ray import RayRun

        def make_executor():
            return RayRun(recipe, address=ray_address, replicas=replicas)
    else:
        def make_executor():
            return LocalRun(recipe)
    return run_job(recipe=recipe, prompts=prompts, recipe_path=recipe_path, output=output, overwrite=overwrite,
                   skip_invalid=skip_invalid, plot=plot, quiet=quiet, console=console, stop=stop,
                   make_executor=make_executor, log_interval_s=log_interval_s)


class LocalRun:
    skips_empty_runs = False  # a fresh job with nothing to run still loads the model and writes its report
    plots = True

    def __init__(self, recipe) -> None:
        from pagedrun.report.metrics import RunTally

        self.recipe = recipe
        self.llm = None
        self.load_s = 0.0
        self.results = RunTally()  # counted, not kept: memory does not grow with the outputs

    def start(self, console: Console, quiet: bool, *, num_requests: int, plot: Path | None) -> None:
        from pagedrun.llm import LLM  # imports torch: seconds, so after the cheap checks

        t_load = time.perf_counter()
        with console.status("loading model…", spinner="dots"):
            self.llm = LLM(self.recipe)
        self.load_s = time.perf_counter() - t_load
        if not quiet:
            print_startup(console, self.llm, self.load_s)

    def run(self, requests, on_output, on_tokens, stop) -> None:
        self.llm.run(requests, on_output=on_output, on_step=lambda rec: on_tokens(rec.num_sampled_tokens),
                     should_stop=stop, window=request_window(self.recipe), tally=self.results)

    def report(self, wall_s: float, interrupted: bool) -> dict:
        from pagedrun.report.report import build_report

        return build_report(self.llm.engine, self.results, wall_s=wall_s, load_s=self.load_s,
                            interrupted=interrupted)

    def machine(self) -> dict:
        import torch

        from pagedrun.report.machine import machine_info

        device = self.llm.engine.worker.device
        return machine_info(str(torch.device(device).type), torch.get_num_threads())

    def model_info(self) -> dict:
        """The architecture and its parameter counts (an MoE token computes with the active ones)."""
        cfg = self.llm.engine.model_config
        return {"architecture": cfg.architecture, "parameters": cfg.num_parameters(),
                "active_parameters": cfg.active_parameters()}

    def plot(self, path: Path, output: Path, inputs: tuple[Path, ...]) -> None:
        from pagedrun.report.plot import plot_blocks

        plot_blocks(self.llm.engine, path, output, inputs)

    def summary(self, console: Console, report: dict | None) -> dict | None:
        return report

    def close(self) -> None:
        pass


def request_window(recipe) -> int:
    """Requests tokenized ahead of the engine, waiting for admission: enough to refill the running batch
    twice over between steps, few enough that a file of any size costs the same memory."""
    return 2 * recipe.scheduler.max_num_seqs


def print_startup(console: Console, llm, load_s: float) -> None:
    from pagedrun.config.hf_cache import model_id_of

    e = llm.engine
    m = e.memory
    cfg = e.model_config
    dtype = str(e.worker.dtype).removeprefix("torch.")
    defaults = getattr(llm.recipe, "model_defaults", None)
    if defaults is not None and defaults.dtype_note:
        dtype = f"{dtype} (dtype {defaults.dtype_note})"
    active = cfg.active_parameters()
    active = f" ({active / 1e6:.1f}M active)" if active != cfg.num_parameters() else ""
    console.print(
        f"[bold]model[/] {model_id_of(e.worker.model_dir) or e.worker.model_dir.name} ({cfg.architecture}, {cfg.num_parameters() / 1e6:.1f}M params"
        f"{active}, {dtype}, {e.worker.device}) loaded in {load_s:.1f}s; attention backend: {e.worker.backend.name}",
        highlight=False,
    )
    if defaults is not None:
        console.print(defaults.generation_line(), highlight=False, markup=False, soft_wrap=True)
        if defaults.scheduler_note:
            console.print(f"scheduler: {defaults.scheduler_note}", highlight=False, markup=False, soft_wrap=True)
    from pagedrun.report.report import cpu_kernels_status

    kernels = cpu_kernels_status(e)
    # Without them a CPU run is much slower (docs/log/2026-11-27-figures-from-code-comments.md):
    # never silently.
    if kernels is not None:
        console.print(f"cpu kernels: {kernels}", highlight=False, markup=False, soft_wrap=True)
    # The short form of `pagedrun profile-memory`: what the profile measured, what the budget became.
    for line in m.summary():
        console.print(f"[bold]memory[/] {line}", highlight=False)
    if e.worker.device.type == "cuda":  # whether decode steps replay CUDA graphs, and if not why
        console.print(e.worker.cuda_graphs_line, highlight=False, markup=False, soft_wrap=True)
    if e.worker.device.type == "cuda" or e.async_scheduling:  # whether a step is scheduled while one runs
        console.print(e.async_line, highlight=False, markup=False, soft_wrap=True)
