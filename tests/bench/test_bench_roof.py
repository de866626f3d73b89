"""The bench's roof (the measured FMA peak), its useful-FLOP count, its model cache, and the vLLM
peer's plumbing that runs without vLLM installed (CI has none: the peer itself is run by hand,
docs/results.md)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from tiny_models import make_tiny_model

from pagedrun.bench.run import count_params, finish_row, kv_bytes_per_token
from pagedrun.bench.workloads import BenchRequest
from pagedrun.build import cpu as cpu_build
from pagedrun.errors import PagedrunError


@pytest.mark.skipif(shutil.which(cpu_build.compiler()) is None, reason="no C++ compiler")
def test_fma_peak_counts_the_isa_it_was_built_for():
    from pagedrun.bench import fma_peak

    fp32 = fma_peak.measure("float32", 1, seconds=0.05)
    bf16 = fma_peak.measure("bfloat16", 1, seconds=0.05)
    assert fp32["flops_per_s"] > 0 and bf16["flops_per_s"] > 0
    flags = cpu_build.machine_flags()
    assert fp32["lanes"] == (16 if "-mavx512f" in flags else 8 if "-mfma" in flags else 4)
    # bf16 dot products only where the build has avx512_bf16; otherwise bf16 runs on the fp32 roof.
    assert bf16["bf16_dot"] == ("-mavx512bf16" in flags)
    assert fp32["bf16_dot"] is False
    # AMX tiles only where the build has them (and the kernel grants the tile state: then the bf16
    # GEMM runs on them too).
    assert fp32["amx"] is False
    if "-mamx-bf16" not in flags:
        assert bf16["amx"] is False
    if bf16["amx"]:
        # a tile op is 16 x 16 x 32 products: far above any vector roof
        assert bf16["flops_per_s"] > 4 * fp32["flops_per_s"]


@pytest.mark.parametrize("dot,fmas,want", [(100.0, 200.0, "FMAs"), (300.0, 200.0, "vdpbf16ps")])
def test_bf16_roof_without_amx_is_the_faster_of_its_two_arithmetics(monkeypatch, dot, fmas, want):
    """With avx512_bf16 and no AMX the bf16 GEMM takes vdpbf16ps or FMAs on widened bf16, whichever
    is faster on the machine (kernels/cpu/bf16_gemm.h), so the roof is the higher of the two: on a
    Sapphire Rapids-class core vdpbf16ps's alone was half the FMAs' (an engine could pass 100%)."""
    from pagedrun.bench import fma_peak

    class Lib:  # a build with vdpbf16ps and no tiles, whatever this machine has
        fma_peak_run = staticmethod(lambda *a: 0.0)
        fma_peak_lanes = staticmethod(lambda: 16)
        fma_peak_has_bf16_dot = staticmethod(lambda: 1)
        fma_peak_has_amx = staticmethod(lambda: 0)

    monkeypatch.setattr(fma_peak.cpu_build, "build", lambda source: source)
    monkeypatch.setattr(fma_peak, "load_library", lambda path: Lib())
    monkeypatch.setattr(fma_peak, "_best_rate", lambda lib, threads, bf16, seconds: dot if bf16 else fmas)
    m = fma_peak.measure("bfloat16", 2)
    assert m["flops_per_s"] == max(dot, fmas) and want in m["isa"] and m["bf16_dot"] is True
    assert fma_peak.measure("float32", 2)["flops_per_s"] == fmas


def test_machine_flags_follow_cpuinfo(monkeypatch):
    monkeypatch.delenv("PAGEDRUN_KERNEL_ISA", raising=False)  # no cap: the cpuinfo alone decides
    base = "flags : fpu sse2 avx2 fma f16c"
    assert cpu_build.machine_flags(base) == ["-mavx2", "-mfma", "-mf16c"]
    wide = base + " avx512f avx512bw avx512vl avx512dq"
    assert "-mavx512f" in cpu_build.machine_flags(wide) and "-mavx512bf16" not in cpu_build.machine_flags(wide)
    assert "-mavx512bf16" in cpu_build.machine_flags(wide + " avx512_bf16")
    amx = cpu_build.machine_flags(wide + " avx512_bf16 amx_tile amx_bf16")
    assert amx[-2:] == ["-mamx-tile", "-mamx-bf16"]
    assert "-mamx-tile" not in cpu_build.machine_flags(wide + " avx512_bf16 amx_bf16")  # both, or neither
    # AVX-512 without AVX2 + FMA is no machine we build for: nothing wide then.
    assert cpu_build.machine_flags("flags : sse2 avx512f avx512bw avx512vl avx512dq") == []


def test_kernel_isa_cap_takes_away_everything_above_it(monkeypatch):
    from pagedrun.build.cache import CacheError

    full = "flags : sse2 avx2 fma f16c avx512f avx512bw avx512vl avx512dq avx512_bf16 amx_tile amx_bf16"
    monkeypatch.setenv("PAGEDRUN_KERNEL_ISA", "avx2")
    assert cpu_build.machine_flags(full) == ["-mavx2", "-mfma", "-mf16c"]
    monkeypatch.setenv("PAGEDRUN_KERNEL_ISA", "avx512_bf16")
    assert "-mavx512bf16" in cpu_build.machine_flags(full) and "-mamx-tile" not in cpu_build.machine_flags(full)
    monkeypatch.setenv("PAGEDRUN_KERNEL_ISA", "native")
    assert "-mamx-bf16" in cpu_build.machine_flags(full)
    # a cap never adds what the CPU lacks
    monkeypatch.setenv("PAGEDRUN_KERNEL_ISA", "avx512")
    assert cpu_build.machine_flags("flags : sse2 avx2 fma") == ["-mavx2", "-mfma"]
    monkeypatch.setenv("PAGEDRUN_KERNEL_ISA", "avx9000")
    with pytest.raises(CacheError, match="PAGEDRUN_KERNEL_ISA"):
        cpu_build.machine_flags(full)


@pytest.mark.parametrize("tied", [False, True])
def test_lm_head_flops_count_only_where_logits_are_computed(tmp_path, tied):
    d = make_tiny_model("llama", tmp_path / "m", seed=1, tie_word_embeddings=tied)
    p = count_params(d)
    assert 0 < p["head"] < p["matmul"]
    reqs = [BenchRequest("a", [5] * 40, 10), BenchRequest("b", [6] * 20, 30)]
    row = {"outputs": [[1] * 10, [2] * 30], "wall_s": 2.0, "executed_tokens": 60 + 40}
    finish_row(row, reqs, p, flops=1e9)
    body = p["matmul"] - p["head"]
    assert row["useful_flops_per_s"] == 2 * (body * (60 + 40) + p["head"] * 40) / 2.0
    assert row["roofline_fraction"] == row["useful_flops_per_s"] / 1e9
    # Prompt tokens the engine's prefix cache served are not work it did: on the shared-prefix
    # workload counting them put engines above the peak.
    hit = {"outputs": [[1] * 10, [2] * 30], "wall_s": 2.0, "executed_tokens": 60 + 40 - 32,
           "prefix_hit_tokens": 32}
    finish_row(hit, reqs, p, flops=1e9)
    assert hit["useful_flops_per_s"] == 2 * (body * (60 - 32 + 40) + p["head"] * 40) / 2.0


def test_kv_bytes_per_token_from_config():
    cfg = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "num_hidden_layers": 30}
    assert kv_bytes_per_token(cfg, "float32") == 2 * 30 * 3 * 64 * 4
    assert kv_bytes_per_token({**cfg, "head_dim": 128}, "bfloat16") == 2 * 30 * 3 * 128 * 2


def test_vllm_engine_without_its_interpreter_is_one_line(tmp_path):
    from pagedrun.bench.vllm_peer import check_python

    with pytest.raises(PagedrunError, match="needs --vllm-python.*vllm_cpu_venv.sh"):
        check_python(None)
    with pytest.raises(PagedrunError, match="does not exist"):
        check_python(str(tmp_path / "nope" / "python"))
    # An interpreter without vllm (this one, in CI) is refused before any engine runs.
    import sys

    try:
        import vllm  # noqa: F401
    except ImportError:
        with pytest.raises(PagedrunError, match="cannot import vllm"):
            check_python(sys.executable)


def test_tiny_model_in_an_unwritable_cache_is_one_line(tmp_path):
    from pagedrun.bench.workloads import tiny_llama_dir

    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(PagedrunError, match="cannot write the tiny model.*PAGEDRUN_CACHE"):
        tiny_llama_dir(blocker / "cache")


def test_nothing_beside_the_vllm_worker_hides_what_it_imports():
    """The worker runs by path, so its folder is first on vLLM's sys.path: a module there named like
    a package it imports (bench/vllm.py once) is imported instead, and the vLLM peer cannot start."""
    import ast

    from pagedrun.bench import vllm_worker

    folder = Path(vllm_worker.__file__).parent
    imported = set()
    for node in ast.walk(ast.parse(Path(vllm_worker.__file__).read_text())):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            imported.add(node.module.split(".")[0])
    assert "vllm" in imported
    assert not [m for m in imported if (folder / f"{m}.py").exists() or (folder / m).is_dir()]


def test_room_for_all_is_the_same_bytes_in_a_hybrid_caches_blocks(tiny_model):
    """The bench gives pagedrun and vLLM the bytes that hold every request with every block kept;
    with KV cache groups a block holds fewer layers, so those bytes are more blocks."""
    from pagedrun.bench.run import layers_per_block, room_for_all
    from pagedrun.bench.workloads import BenchRequest
    from pagedrun.config.recipe import load_recipe

    reqs = [BenchRequest("a", list(range(40)), 24), BenchRequest("b", list(range(9)), 7)]
    assert room_for_all(reqs, 16) == "cache.num_blocks=6"  # 64 and 16 tokens: 4 + 1 blocks, + 1
    d = tiny_model("gemma3", seed=1)  # 3 sliding layers, 1 full: groups of 1 layer
    assert layers_per_block(d, load_recipe(None, [])) == (4, 1)
    assert room_for_all(reqs, 16, layers_per_block(d, load_recipe(None, []))) == "cache.num_blocks=24"
    assert layers_per_block(d, load_recipe(None, ["cache.hybrid_kv=false"])) == (4, 4)
