"""LLM: the facade the CLI and Python users share.

    from pagedrun import LLM, SamplingParams
    llm = LLM()                                   # the default recipe and model
    outs = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16))
    print(outs[0].outputs[0].text)

It owns no tensors and no scheduling: it turns prompts into requests, feeds the engine, and hands
finished requests to a callback as they finish (so the CLI can write them at once).
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from pagedrun.config.recipe import Recipe, load_recipe
from pagedrun.engine.engine import LLMEngine
from pagedrun.outputs import RequestOutput
from pagedrun.errors import PagedrunError
from pagedrun.io.requests import InvalidRequest, LineChecker, LineFailure, Request, read_requests
from pagedrun.report.metrics import RunTally, StepRecord
from pagedrun.sampling_params import SamplingParams


class LLM:
    def __init__(self, recipe: Recipe | str | Path | None = None, overrides: Sequence[str] = ()):
        if not isinstance(recipe, Recipe):
            recipe = load_recipe(Path(recipe) if recipe is not None else None, list(overrides))
        self.recipe = recipe
        self.engine = LLMEngine(recipe)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    # ---- requests -----------------------------------------------------------------------------
    def read_requests(self, path: Path, skip_invalid: bool = False) -> tuple[list[Request], list[InvalidRequest]]:
        return read_requests(Path(path), self.tokenizer, self.recipe.sampling,
                             vocab_size=self.engine.model_config.vocab_size,
                             max_model_len=self.engine.max_model_len, skip_invalid=skip_invalid)

    def make_requests(self, prompts: Sequence[Any], sampling_params: SamplingParams | None = None) -> list[Request]:
        """Prompts as str, token-id lists, request dicts (the JSONL schema) or Requests."""
        defaults = sampling_params or self.recipe.sampling
        checker = LineChecker("prompts", defaults, vocab_size=self.engine.model_config.vocab_size,
                              tokenizer=self.tokenizer, unique_ids=False)  # a caller's ids are its own business
        out = []
        for i, p in enumerate(prompts):
            if isinstance(p, Request):
                out.append(p)
                continue
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
        while True:
            feed()
            if not engine.has_unfinished():
                break
            if should_stop is not None and should_stop():
                # Unfinished requests are dropped, not written: a resume redoes them from scratch.
                engine.scheduler.abort_all()
                break
            finished = engine.step()
            for o in finished:
                if tally is not None:
                    tally.add(o)
                else:
                    results.append(o)
                if on_output is not None:
                    on_output(o)
            if on_step is not None and engine.steps:
                on_step(engine.steps[-1])
        results.sort(key=lambda o: o.index)
        return results

    def generate(self, prompts: Sequence[Any], sampling_params: SamplingParams | None = None,
                 **kwargs) -> list[RequestOutput]:
        return self.run(self.make_requests(prompts, sampling_params), **kwargs)
