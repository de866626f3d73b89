"""Every result table pagedrun prints is readable at 80 columns: rendered with rich at width 80,
no cell is cut ('…'), no line is wider, every header and every number is there whole; results go
to stdout. The tables are filled with the widest values they are meant for (four engines, the
longest configs, GPU-sized throughputs and memory), not a run's, so nothing here is measured.
"""
from __future__ import annotations

import importlib.util
import io
import re
from pathlib import Path

from rich.console import Console
from rich.markdown import Markdown
from rich.table import Table

from pagedrun.attention import scratch as S
from pagedrun.bench.tables import bench_tables
from pagedrun.cli.profile_memory import plan_json, plan_table
from pagedrun.config.recipe import CacheConfig, load_recipe
from pagedrun.console import WIDTH, results_console
from pagedrun.worker.memory import GiB, MiB, plan_memory, requests_fit
from pagedrun.worker.profiler import CpuReadings, CudaReadings, cpu_profile, cuda_profile

ROOT = Path(__file__).resolve().parents[1]


def render(renderable, width: int = WIDTH) -> str:
    console = Console(file=io.StringIO(), width=width, color_system=None, legacy_windows=False)
    console.print(renderable)
    return console.file.getvalue()


def tables_in(renderable) -> list[Table]:
    if isinstance(renderable, Table):
        return [renderable]
    return [r for r in getattr(renderable, "renderables", []) if isinstance(r, Table)]


def assert_readable(renderable, *, unbroken: tuple[str, ...] = ()) -> str:
    """No '…', no line over WIDTH, every header word and every word of every cell present whole
    (text may wrap at its spaces; a word, and so a number, may not be cut), and `unbroken`
    strings (numbers with their unit) present on one line."""
    text = render(renderable)
    assert "…" not in text, text
    assert max(len(line) for line in text.splitlines()) <= WIDTH, text
    words = set(re.findall(r"\S+", text))
    for table in tables_in(renderable):
        for column in table.columns:
            for cell in [column.header, *column._cells]:
                for word in re.findall(r"\S+", re.sub(r"\[/?[a-z ]+\]", "", str(cell))):
                    assert word in words, (word, text)
    for s in unbroken:
        assert s in text, (s, text)
    return text


# ---------------------------------------------------------------- pagedrun bench

def _engine(engine, config, out, total, wall, rss_mib, util, ratio, roof, mismatches=0, load=987.65) -> dict:
    return {"engine": engine, "config": config, "output_tokens_per_s": out, "total_tokens_per_s": total,
            "wall_s": wall, "load_s": load, "e2e_s": load + wall, "peak_rss_bytes": rss_mib * 2**20, "kv_bytes": 4 * 2**30, "kv_peak_bytes": 3 * 2**30,
            "kv_utilisation": util, "ratio_to_pagedrun": {"output_tokens_per_s": ratio},
            "roofline_fraction": roof, "mismatches": mismatches}


BENCH = {
    "model": {"name": "default", "dtype": "bfloat16", "parameters": {"total": 134_515_008, "matmul": 106_200_000}},
    "workload": {"name": "shared-prefix", "quick": False, "requests": 64, "prompt_tokens": 9_216,
                 "max_output_tokens": 4_096},
    "machine": {"threads": 192, "load_average_start": [1.0, 2.0, 3.0], "load_average_end": [1.0, 2.0, 3.0]},
    "matmul_flops_per_s": 2.5e12,
    "engines": [
        _engine("pagedrun", "continuous, paged", 123_456.7, 1_234_567.8, 1_234.56, 123_456, 0.999, 1.0, 0.6123),
        _engine("hf-static", "batch 256", 2_712.3, 27_123.4, 12.34, 4_096, None, 0.02, 0.0123, 1234),
        _engine("hf-continuous", "max 256 requests/batch", 9_999.9, 99_999.9, 999.99, 65_536, 0.5, 12.34, 0.0012),
        _engine("vllm", "vLLM-CPU, paged", 54_321.0, 543_210.0, 3.21, 9_999, 1.0, 0.44, 0.25),
    ],
    "outputs_match": True, "mismatches": [], "pagedrun_report": None,
}


def test_bench_tables_fit_80_columns():
    text = assert_readable(bench_tables(BENCH), unbroken=("123,457", "1,234,568", "2,712.3", "123,456 MiB",
                                                          "1,235", "999.99", "12.34", "61.2%", "1234",
                                                          "987.65", "2,222"))
    assert text.count("hf-continuous") == 2  # stacked: throughput, then memory


def test_bench_table_of_few_columns_still_fits_a_wide_config():
    wide = {**BENCH, "engines": [_engine("hf-continuous", "max 1024 requests/batch", 1.0, 2.0, 0.01, 1, 1.0, 1.0, 1.0)]}
    assert_readable(bench_tables(wide))


def test_bench_markdown_tables_fit_80_columns():
    spec = importlib.util.spec_from_file_location("bench_table", ROOT / "benchmarks" / "bench_table.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    md = mod.table(BENCH)
    header_rows = [line for line in md.splitlines() if line.startswith("| engine")]
    assert len(header_rows) == 2 and all(len(line) <= WIDTH for line in header_rows)
    text = render(Markdown(md))
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= WIDTH, text
    words = set(re.findall(r"\S+", text))
    for line in md.splitlines():
        if line.startswith("| ") and not line.startswith("|---"):
            for cell in line.strip("|").split("|"):
                for word in cell.split():
                    assert word in words, (word, text)


# ---------------------------------------------------------------- pagedrun profile-memory

MODEL = {"path": "/m", "architecture": "LlamaForCausalLM", "dtype": "bfloat16", "num_layers": 30,
         "num_kv_heads": 3, "head_dim": 64}


def _cpu_plan():
    r = CpuReadings(mem_total=1024 * GiB, available_before=900 * GiB, available_after=900 * GiB,
                    rss_before=2 * GiB, peak_rss=3 * GiB, dummy_kv_bytes=100 * MiB,
                    method="VmHWM (peak RSS) during the profile pass")
    return plan_memory(profile=cpu_profile(r, 1 * GiB), block_bytes=23_040 * 16,
                       cache_cfg=CacheConfig(kv_cache_memory=0.5), max_model_len=8192, max_num_seqs=256, uses_swap=False, host_available_bytes=900 * GiB,
                       decode_gather=S.decode_gather_bytes(num_heads=9, num_kv_heads=3, head_size=64, elem_bytes=2,
                                                            block_size=16, max_model_len=8192, max_num_seqs=256))


def _cuda_plan():
    r = CudaReadings(total=80 * GiB, free_before=62 * GiB, free_after=62 * GiB, torch_allocated_before=17 * GiB,
                     torch_peak_allocated=19 * GiB, torch_reserved_after=int(16.5 * GiB), dummy_kv_bytes=1 * GiB,
                     cupy_pool_bytes=256 * MiB)
    return plan_memory(profile=cuda_profile(r, 16 * GiB, device="cuda:0"), block_bytes=2 * 32 * 8 * 128 * 16 * 2,
                       cache_cfg=CacheConfig(gpu_memory_utilization=0.9), max_model_len=8192, max_num_seqs=256,
                       uses_swap=False, host_available_bytes=100 * GiB)


def _profile(plan, prompts: str = "prompts.jsonl") -> dict:
    fit = {"path": prompts, "num_invalid": 0, **requests_fit([4, 8, 12, 100] * 1000, plan.num_gpu_blocks).__dict__}
    d = plan_json(plan, load_recipe(None, []), fit, model=MODEL)
    if plan.device == "cpu":
        d["measured"]["rss_after_start_bytes"] = 123_456_789_012
    return d


def test_profile_memory_table_fits_80_columns_on_cpu_and_cuda():
    for plan in (_cpu_plan(), _cuda_plan()):
        d = _profile(plan)
        text = assert_readable(plan_table(d), unbroken=(f"{d['derived']['num_blocks']:,}",
                                                        f"{d['derived']['token_capacity']:,}"))
        assert "peak in use" in text and "KV blocks" in text


def test_kv_dtype_table_fits_80_columns_and_scales_with_bytes():
    import types

    import torch

    from pagedrun.report.kv_dtype_table import kv_dtype_rows, kv_dtype_table
    from pagedrun.worker.memory import fmt_bytes

    plan = _cpu_plan()  # 30 layers x 3 kv heads x 64, bf16: 23,040 B per token
    cfg = types.SimpleNamespace(num_hidden_layers=30, num_key_value_heads=3, head_dim=64)
    rows = kv_dtype_rows(plan, cfg, torch.bfloat16, "bfloat16")
    by = {r["kv_cache_dtype"]: r for r in rows}
    assert by["bfloat16"]["source"] == "allocated" and by["bfloat16"]["num_blocks"] == plan.num_gpu_blocks
    assert by["fp8_e4m3"]["bytes_per_token"] == 11_520 and by["int8"]["bytes_per_token"] == 11_520 + 2 * 30 * 3 * 4
    for r in rows:  # the same budget, capped as the plan was
        assert r["num_blocks"] <= max(plan.num_gpu_blocks, plan.kv_budget_bytes // (r["bytes_per_token"] * 16))
    text = assert_readable(kv_dtype_table(rows, plan.kv_budget_bytes, 8192, fmt_bytes),
                           unbroken=tuple(f"{r['token_capacity']:,}" for r in rows))
    assert "fp8_e5m2" in text and "allocated" in text


def test_profile_memory_table_folds_a_long_path_rather_than_cut_it():
    d = _profile(_cpu_plan(), prompts="/data/" + "x" * 120 + "/prompts.jsonl")
    text = render(plan_table(d))
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= WIDTH, text
    assert "x" * 120 in re.sub(r"\s+", "", "".join(line[48:] for line in text.splitlines()))


def test_results_go_to_stdout_and_progress_stays_on_stderr(capsys):
    out = results_console(Console(stderr=True))
    out.print("the table")
    captured = capsys.readouterr()
    assert captured.out.strip() == "the table" and captured.err == ""
    mine = Console(file=io.StringIO())
    assert results_console(mine) is mine  # a caller that captures output keeps it in one place


# ---------------------------------------------------------------- the Ray run's replica table

def _replica_report(num_requests, prompt, output, wall_s, peak, blocks, preempted) -> dict:
    return {"num_requests": num_requests, "throughput": {"prompt_tokens": prompt, "output_tokens": output,
                                                         "wall_s": wall_s},
            "prefix_cache": {"hit_rate": 0.99}, "blocks_in_use": {"peak": peak}, "kv_capacity": {"blocks": blocks},
            "preemptions": {"recompute": preempted, "swap": 0}}


def test_replica_table_fits_80_columns():
    """A job of ~1M prompt tokens over 8 GPUs: two stacked tables, the work then the cache."""
    from pagedrun.cli.ray.replica_table import print_replicas, replica_tables

    one = _replica_report(12_345, 1_234_567, 123_456, 1234.56, 12_345, 16_384, 123)
    total = _replica_report(98_760, 9_876_536, 987_648, 1234.56, 98_760, 131_072, 984)
    report = {"num_replicas": 8, "total": total,
              "replicas": [{"replica": "0123abcd", "node": "0123456789ab", "device": "cuda:0", "batches": 123,
                            "report": one} for _ in range(8)]}
    console = Console(file=io.StringIO(), width=WIDTH, color_system=None)
    print_replicas(console, report)
    text = console.file.getvalue()
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= WIDTH, text
    for s in ("9,876,536", "987,648", "98,760/131,072", "0123abcd", "0123456789ab", "1,235", "984"):
        assert s in text, (s, text)
    assert text.count("0123abcd") == 16 and text.count("total") == 2  # stacked: every replica in both
    assert_readable(replica_tables(report))


def test_replica_table_fits_the_widest_job_and_folds_a_long_host_name():
    """10^7 requests and 10^10 prompt tokens per replica, 10^6 s, and a node shown by its host name."""
    from pagedrun.cli.ray.replica_table import replica_tables

    one = _replica_report(9_999_999, 9_999_999_999, 999_999_999, 999_999.0, 9_999_999, 9_999_999, 9_999_999)
    one["prefix_cache"]["hit_rate"] = None  # no prompt tokens looked up: "-"
    total = _replica_report(99_999_999, 99_999_999_999, 9_999_999_999, 999_999.0, 99_999_999, 99_999_999,
                            99_999_999)
    total["prefix_cache"]["hit_rate"] = 1.0
    host = "worker-gpu-node-17.us-east-1.compute.internal"
    report = {"num_replicas": 10, "total": total,
              "replicas": [{"replica": f"{i:08x}", "node": host, "device": "cpu", "batches": 99_999,
                            "report": one} for i in range(10)]}
    text = render(replica_tables(report))
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= WIDTH, text
    for s in ("9,999,999", "99,999,999", "9,999,999,999", "99,999,999,999", "999,999,999", "999,999",
              "9,999,999/9,999,999", "99,999,999/99,999,999", "999,990", "100%"):
        assert s in text.split(), (s, text)
    assert text.split().count("-") == 10  # each replica's hit rate: none looked up
    # The host name is folded onto the next line, not cut: every character is there, in order.
    lines = text.splitlines()
    rows = [i for i, line in enumerate(lines) if re.match(r"[0-9a-f]{8} ", line) and "/" in line]
    assert len(rows) == 10, text
    for i in rows:
        assert lines[i].split()[1] + lines[i + 1].strip() == host, text


# ---------------------------------------------------------------- pagedrun generate's summary

def _summary_report() -> dict:
    """What report.summary_rows reads, at the widest values a long GPU job gives."""
    big = 123_456_789_012
    pct = {"peak_tokens": big, "peak_bytes": 64 * 2**40, "utilisation": 0.123}
    return {
        "cpu_kernels": "off (the cache /home/someone/.cache/pagedrun/kernels is not owned by this user)",
        "kv_capacity": {"blocks": 12_345_678, "block_size": 16, "tokens": 197_530_848, "bytes": 64 * 2**40},
        "kv_pages_committed": {"blocks": 12_345_678, "bytes": 64 * 2**40, "seconds": 12_345.678},
        "blocks_in_use": {"peak": 12_345_678, "peak_fraction_of_capacity": 1.0, "mean": 9_876_543.2},
        "utilisation": {"tokens_stored_over_slots_allocated": 0.987, "at_peak": 0.999},
        "fragmentation": {"last_block_waste_tokens_mean": 7.5, "last_block_waste_percent": 0.4},
        "contiguous": {"request_max": pct, "max_model_len": pct, "max_model_len_tokens": 131_072},
        "prefix_cache": {"hit_tokens": big, "query_tokens": big, "hit_rate": 1.0, "cow_copies": 1_234_567},
        "preemptions": {"recompute": 1_234_567, "swap": 1_234_567, "swap_fallbacks": 1_234},
        "swap": {"out_blocks": 12_345_678, "out_bytes": 64 * 2**40, "in_blocks": 12_345_678, "in_bytes": 64 * 2**40},
        "throughput": {"prompt_tokens_per_s": 1_234_567.8, "output_tokens_per_s": 123_456.7},
        "latency": {"ttft_s": {"p50": 12.3, "p90": 123.4, "p99": 1234.5}, "itl_s": {"p50": 0.01, "p90": 0.1, "p99": 1.0}},
    }


def test_generate_summary_fits_80_columns_and_folds_a_long_path():
    from types import SimpleNamespace as NS

    from pagedrun.cli.job import print_summary

    results = [NS(error=None, outputs=[NS(token_ids=[0] * 5)], prompt_token_ids=[0] * 7, metrics={})] * 3
    path = Path("/data/" + "x" * 120 + "/outputs.jsonl")
    console = Console(file=io.StringIO(), width=WIDTH, color_system=None)
    print_summary(console, results, 123_456.78, path, _summary_report(), written=(3, 0))
    text = console.file.getvalue()
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= WIDTH, text
    words = set(re.findall(r"\S+", text))
    for s in ("123,456,789,012", "12,345,678", "197,530,848", "9,876,543.2", "1,234,567.8", "1234500.0",
              "(67,108,864.0", "max_model_len=131072;", "123456.78"):
        assert s in words, (s, text)
    assert "cpu kernels" in text and "contiguous would reserve" in text and "12345.68" in words
    assert str(path) in re.sub(r"\s+", "", "".join(line[27:] for line in text.splitlines())), text
