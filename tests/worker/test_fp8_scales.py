"""fp8 KV scales are a function of the model, not of which requests came first (issue 40, item 3): they
are calibrated on a fixed prompt when the worker starts, so greedy tokens are the same alone or in a
batch, in any order, with any block count or batch budget, and across a resume."""
from __future__ import annotations

import math
import random

import pytest
import torch
from tiny_models import make_tiny_model

from pagedrun.config.recipe import load_recipe
from pagedrun.llm import LLM
from pagedrun.sampling_params import SamplingParams
from pagedrun.worker.worker import CALIBRATION_TOKENS, calibration_ids


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("fp8") / "m", seed=5)


def prompts(n: int = 10, seed: int = 2) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 300) for _ in range(rng.randrange(4, 24))] for _ in range(n)]


def run(model, ps, *sets, dtype: str = "fp8"):
    llm = LLM(load_recipe(None, [f"model.path={model}", f"cache.kv_cache_dtype={dtype}", "cache.block_size=8",
                                 *sets]))
    scales = llm.engine.worker.cache_engine.layer_scales.clone()  # before any request
    outs = llm.generate(ps, SamplingParams(max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert torch.equal(scales, llm.engine.worker.cache_engine.layer_scales)  # no request moved them
    return [o.outputs[0].token_ids for o in outs], scales


@pytest.mark.parametrize("dtype", ["fp8", "fp8_e5m2"])
def test_scales_are_set_at_start_up_and_the_same_for_any_settings(model, dtype):
    _, base = run(model, prompts(2), "cache.num_blocks=512", dtype=dtype)
    assert bool((base > 0).all())
    for sets in (["cache.num_blocks=24"], ["scheduler.max_num_batched_tokens=32", "cache.num_blocks=64"],
                 ["scheduler.max_num_seqs=1"]):
        assert torch.equal(run(model, prompts(3, seed=9), *sets, dtype=dtype)[1], base), sets


def test_greedy_tokens_do_not_depend_on_batch_order_blocks_or_resume(model):
    ps = prompts()
    full, _ = run(model, ps, "cache.num_blocks=512")
    alone = [run(model, [p], "cache.num_blocks=512")[0][0] for p in ps[:4]]
    assert alone == full[:4]
    reversed_order, _ = run(model, ps[::-1], "cache.num_blocks=512")
    assert reversed_order[::-1] == full
    few_blocks, _ = run(model, ps, "cache.num_blocks=24", "scheduler.max_num_batched_tokens=32")
    assert few_blocks == full
    # A resumed job: a new process-equivalent engine runs the second half only.
    second_half, _ = run(model, ps[5:], "cache.num_blocks=512")
    assert second_half == full[5:]


def test_recipe_scales_are_kept_and_one_unset_side_is_calibrated(model):
    _, both = run(model, prompts(1), "cache.k_scale=0.25", "cache.v_scale=0.5")
    assert both[:, 0].tolist() == [0.25] * len(both) and both[:, 1].tolist() == [0.5] * len(both)
    _, calibrated = run(model, prompts(1))
    _, only_k = run(model, prompts(2, seed=3), "cache.k_scale=0.25")
    assert only_k[:, 0].tolist() == [0.25] * len(only_k)
    # Layer 0's V comes before any quantized K is read; later layers see the other K scale's rounding.
    assert only_k[0, 1] == calibrated[0, 1] and bool((only_k[:, 1] > 0).all())


def test_a_cache_too_small_for_the_calibration_prompt_uses_vllms_default(model):
    llm = LLM(load_recipe(None, [f"model.path={model}", "cache.kv_cache_dtype=fp8", "cache.block_size=8",
                                 "cache.num_blocks=1"]))  # the 16 calibration tokens need 2 blocks of 8
    assert bool((llm.engine.worker.cache_engine.layer_scales == 1.0).all())


def test_calibration_ids_are_fixed_and_inside_the_vocabulary():
    class Tok:
        def encode(self, text, add_special_tokens=False):
            return [ord(c) for c in text[:5]]

    assert calibration_ids(Tok(), 1000) == [ord(c) for c in "The c"] * 3 + [ord("T")]
    assert len(calibration_ids(None, 50)) == CALIBRATION_TOKENS
    fixed = calibration_ids(None, 50)
    assert all(0 <= i < 50 for i in fixed) and fixed == calibration_ids(None, 50)


@pytest.mark.parametrize("key", ["k_scale", "v_scale"])
@pytest.mark.parametrize("value", ["1e39", "1e38", "1e21", "1e-21", "1e-45", "0", "-1", "inf", "nan", "1" + "0" * 400])
def test_recipe_scales_outside_the_float32_safe_range_are_one_line(key, value):
    from pagedrun.errors import PagedrunError

    with pytest.raises(PagedrunError) as e:
        load_recipe(None, ["cache.kv_cache_dtype=fp8", f"cache.{key}={value}"])
    assert f"cache.{key}" in str(e.value) and "must be a number in [1e-20, 1e+20]" in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("dtype", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("scale", ["1e-20", "1e20"])
def test_scales_at_the_bounds_run_to_finite_logprobs(model, dtype, scale):
    """Every value saturates (1e-20) or quantizes to 0 (1e20): useless numbers, but finite ones."""
    llm = LLM(load_recipe(None, [f"model.path={model}", f"cache.kv_cache_dtype={dtype}", "cache.num_blocks=64",
                                 f"cache.k_scale={scale}", f"cache.v_scale={scale}"]))
    (out,) = llm.generate(prompts(1), SamplingParams(max_tokens=4, ignore_eos=True, logprobs=1), use_tqdm=False)
    assert out.error is None and len(out.outputs[0].token_ids) == 4
    assert math.isfinite(out.outputs[0].cumulative_logprob)
