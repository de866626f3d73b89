"""The profile pass runs the first PROFILE_LAYERS decoder layers, the final norm, the LM head and the
sampler on the worst step and on a decode step after it, and leaves the model as it found it."""
from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_model

from pagedrun.attention.registry import make_backend
from pagedrun.config.recipe import load_recipe
from pagedrun.llm import LLM
from pagedrun.models.loader import load_model
from pagedrun.worker import profiler


def test_profile_pass_runs_the_first_layers_and_restores_the_model(tmp_path):
    d = make_tiny_model("llama", tmp_path / "m", num_hidden_layers=5)
    model, cfg = load_model(d, torch.float32)
    layers = list(model.model.layers)
    ran: list[int] = []
    hooks = [layer.register_forward_hook(lambda m, a, o, i=i: ran.append(i)) for i, layer in enumerate(layers)]
    prof = profiler.run_profile(model, cfg, make_backend("torch", torch.device("cpu")), dtype=torch.float32,
                                device=torch.device("cpu"), block_size=8, max_num_batched_tokens=64,
                                max_num_seqs=4, max_model_len=128)
    # the worst prefill step, then a decode step of the same sequences (the kernels each path loads)
    assert ran == list(range(profiler.PROFILE_LAYERS)) * 2
    assert list(model.model.layers) == layers  # the same module objects, all five, in order
    assert prof.profile_tokens == 64 and prof.activation_peak_bytes >= 0
    for h in hooks:
        h.remove()


@pytest.mark.slow


def test_engine_after_profile_runs_every_layer(tmp_path):
    d = make_tiny_model("llama", tmp_path / "m", num_hidden_layers=5)
    llm = LLM(load_recipe(None, [f"model.path={d}", "cache.num_blocks=64"]))
    ran: list[int] = []
    for i, layer in enumerate(llm.engine.worker.model.model.layers):
        layer.register_forward_hook(lambda m, a, o, i=i: ran.append(i))
    llm.generate([[5, 6, 7]])
    assert ran[:5] == [0, 1, 2, 3, 4]
