"""pagedrun: offline batch LLM inference through a paged KV cache, with a memory report you can read."""
from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]


def __getattr__(name: str):
    # Lazy, so `pagedrun --help` and error paths do not pay for importing torch.
    if name == "LLM":
        from pagedrun.llm import LLM

        return LLM
    if name == "SamplingParams":
        from pagedrun.sampling_params import SamplingParams

        return SamplingParams
    if name in ("RequestOutput", "CompletionOutput"):
        from pagedrun import outputs

        return getattr(outputs, name)
    raise AttributeError(name)
