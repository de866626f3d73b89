"""LLM: the facade the CLI and Python users share, shaped like vLLM's offline `LLM`.

    from pagedrun import LLM, SamplingParams
    llm = LLM()                                   # the default recipe and model
    llm = LLM(model="path/to/hf_dir", max_num_seqs=128, kv_cache_dtype="fp8")   # as with vLLM
    outs = llm.generate("The capital of France is", SamplingParams(max_tokens=16))
    print(outs[0].outputs[0].text)
    outs = llm.chat([{"role": "user", "content": "Hi"}], chat_template_kwargs={"enable_thinking": False})

It owns no tensors and no scheduling: it turns prompts into requests, feeds the engine, and hands
finished requests to a callback as they finish (so the CLI can write them at once).
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from pagedrun.config.engine_args import engine_args_overrides
from pagedrun.config.recipe import Recipe, load_recipe
from pagedrun.engine.engine import LLMEngine
from pagedrun.errors import PagedrunError
from pagedrun.io.openai_batch import BatchJob
from pagedrun.io.requests import InvalidRequest, LineChecker, LineFailure, Request, read_requests
from pagedrun.models.model_defaults import apply_model_defaults
from pagedrun.outputs import RequestOutput
from pagedrun.report.metrics import RunTally, StepRecord
from pagedrun.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: Recipe | str | Path | None = None, overrides: Sequence[str] = (), *,
                 recipe: Recipe | str | Path | None = None, **engine_args: Any):
        """LLM(model=HF_DIR, **vLLM engine args), or LLM(recipe.yaml) / LLM(recipe=...) with
        `--set`-style overrides; the keyword arguments are applied after the recipe, as `--set` is.

        The first positional argument is vLLM's `model`: a model directory (or "default"); a
        .yaml / .yml file or a Recipe there is read as the recipe, as earlier pagedrun versions did."""
        if isinstance(model, Recipe) or (model is not None and Path(model).suffix in (".yaml", ".yml")):
            if recipe is not None:
                raise PagedrunError("LLM(): a recipe given twice (first argument and recipe=)")
            model, recipe = None, model
        if model is not None:
            engine_args["model"] = model
        extra = engine_args_overrides(engine_args)
        if isinstance(recipe, Recipe):
            if overrides or extra:  # a built Recipe is final: rebuild it from its file to override
                raise PagedrunError("LLM(): overrides and engine arguments need a recipe path, not a Recipe")
        else:
            recipe = load_recipe(Path(recipe) if recipe is not None else None, [*overrides, *extra])
        # dtype: auto and the model's generation_config.json (models/model_defaults.py); a no-op for
        # a recipe the CLI already resolved.
        recipe = apply_model_defaults(recipe)
        self.recipe = recipe
        self.engine = LLMEngine(recipe)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        return self.engine.tokenizer

    # ---- requests -----------------------------------------------------------------------------
    def read_requests(self, path: Path, skip_invalid: bool = False,
                      batch_job: BatchJob | None = None) -> tuple[list[Request], list[InvalidRequest]]:
        """A prompts file's requests; an OpenAI batch file needs `batch_job` (the ids' seed, the model's name)."""
        return read_requests(Path(path), self.tokenizer, self.recipe.sampling,
                             vocab_size=self.engine.model_config.vocab_size,
                             max_model_len=self.engine.max_model_len, skip_invalid=skip_invalid, batch_job=batch_job)

    def make_requests(self, prompts: Sequence[Any],
                      sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[Request]:
        """Prompts as str, token-id lists, request dicts (the JSONL schema) or Requests; one
        SamplingParams for all of them (default: the recipe's) or one per prompt."""
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise PagedrunError(f"{len(sampling_params)} SamplingParams for {len(prompts)} prompts; "
                                    "give one for all, or one per prompt")
            per_prompt = list(sampling_params)
        else:
            per_prompt = [sampling_params] * len(prompts)
        checkers: dict[int, LineChecker] = {}
        out = []
        for i, (p, sp) in enumerate(zip(prompts, per_prompt)):
            if isinstance(p, Request):
                out.append(p)
                continue
            defaults = sp or self.recipe.sampling
            checker = checkers.get(id(defaults))
            if checker is None:  # a caller's ids are its own business: no id table
                checker = checkers[id(defaults)] = LineChecker(
                    "prompts", defaults, vocab_size=self.engine.model_config.vocab_size, tokenizer=self.tokenizer,
                    unique_ids=False)
            obj = {"prompt": p} if isinstance(p, str) else {"prompt_token_ids": list(p)} if isinstance(p, (list, tuple)) else dict(p)
            obj.setdefault("id", i)
            try:
                spec = checker.check(json.dumps(obj).encode(), i + 1)
                req = checker.tokenize(spec, self.engine.max_model_len)
            except LineFailure as e:  # too long included: a Python caller gets an exception, not a record
                raise PagedrunError(f"prompts[{i}]: {e.bad.error.removeprefix(f'prompts:{i + 1}: ')}") from None
            out.append(req)
        return out

    # ---- running ------------------------------------------------------------------------------
    def run(self, requests: Iterable[Request], on_output: Callable[[RequestOutput], None] | None = None,
            on_step: Callable[[StepRecord], None] | None = None,
            should_stop: Callable[[], bool] | None = None, window: int | None = None,
            tally: RunTally | None = None) -> list[RequestOutput]:
        """Run requests to completion; returns the finished ones in input order. should_stop is asked
        before every step; True ends the run after the step in progress (used for SIGINT/SIGTERM).

        `requests` may be an iterator that tokenizes as it goes (io/stream.py): with `window`
        it is pulled only while fewer than `window` requests wait for admission, so the requests
        tokenized ahead of the engine stay within window + the running batch. With `tally` the
        finished requests are counted there and not kept (the returned list is empty): memory does
        not grow with the number of requests."""
        engine = self.engine
        pending = iter(requests)
        more, index = True, 0

        def feed() -> None:
            nonlocal more, index
            while more and (window is None or len(engine.scheduler.waiting) < window):
                req = next(pending, None)
                if req is None:
                    more = False
                    return
                engine.add_request(req.id, index, req.prompt_token_ids, req.sampling)
                index += 1

        results: list[RequestOutput] = []

        def emit(finished: list[RequestOutput]) -> None:
            for o in finished:
                if tally is not None:
                    tally.add(o)
                else:
                    results.append(o)
                if on_output is not None:
                    on_output(o)

        while True:
            feed()
            if not engine.has_unfinished():
                break
            if should_stop is not None and should_stop():
                # What the step in flight finished is kept (async scheduling); unfinished requests are
                # dropped, not written: a resume redoes them from scratch.
                emit(engine.drain())
                engine.abort_all()
                break
            emit(engine.step())
            if on_step is not None and engine.steps:
                on_step(engine.steps[-1])
        results.sort(key=lambda o: o.index)
        return results

    def generate(self, prompts: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, **kwargs) -> list[RequestOutput]:
        """vLLM's generate: one prompt (a str, a list of token ids, a request dict) or a list of them;
        one SamplingParams for all or one per prompt; a progress bar on stderr unless use_tqdm=False.
        Outputs in the order of the prompts."""
        requests = self.make_requests(_as_prompt_list(prompts), sampling_params)
        return self._run_with_progress(requests, use_tqdm, **kwargs)

    def chat(self, messages: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, *, chat_template: str | None = None,
             chat_template_kwargs: dict[str, Any] | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None) -> list[RequestOutput]:
        """vLLM's chat: one conversation (a list of {"role", "content"}) or a list of them, rendered by
        the tokenizer's chat template with these arguments (transformers' apply_chat_template)."""
        from pagedrun.io.tokenize import LineError, chat_token_ids, check_vocab

        if add_generation_prompt and continue_final_message:
            raise PagedrunError("chat(): add_generation_prompt and continue_final_message exclude each other")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for i, conv in enumerate(conversations):
            try:
                text, ids = chat_token_ids(conv, self.tokenizer, self.engine.max_model_len,
                                           add_generation_prompt=add_generation_prompt,
                                           continue_final_message=continue_final_message, chat_template=chat_template,
                                           tools=tools, chat_template_kwargs=chat_template_kwargs)
                check_vocab(ids, self.engine.model_config.vocab_size, "messages")
            except LineError as e:
                raise PagedrunError(f"conversations[{i}]: {e.field}: {e.message}") from None
            prompts.append((text, ids))
        outs = self.generate([{"prompt_token_ids": ids} for _, ids in prompts], sampling_params, use_tqdm=use_tqdm)
        for o, (text, _) in zip(outs, prompts):
            o.prompt = text
        return outs

    def _run_with_progress(self, requests: list[Request], use_tqdm: bool, **kwargs) -> list[RequestOutput]:
        prompts = {r.id: r.prompt for r in requests if r.prompt is not None}
        user_on_output = kwargs.pop("on_output", None)
        progress = None
        if use_tqdm:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            progress = Progress(TextColumn("[bold]generating"), BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn(), console=Console(stderr=True), transient=True)
            task = progress.add_task("generate", total=len(requests))

        def on_output(o: RequestOutput) -> None:
            if progress is not None:
                progress.advance(task)
            if user_on_output is not None:
                user_on_output(o)

        if progress is None:
            outs = self.run(requests, on_output=on_output, **kwargs)
        else:
            with progress:
                outs = self.run(requests, on_output=on_output, **kwargs)
        for o in outs:
            o.prompt = prompts.get(o.request_id, o.prompt)
        return outs


def _as_prompt_list(prompts: Any) -> list[Any]:
    """One prompt or many, as a list: a str or a request dict is one prompt (vLLM's rule; a str is
    never iterated into characters), and so is a list of ints (token ids)."""
    if isinstance(prompts, (str, dict, Request)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(x, int) and not isinstance(x, bool) for x in prompts):
        return [prompts]
    return prompts
