"""`pagedrun bench` on a tiny model in-process (seconds): the JSON holds every engine's throughput,
the ratios to pagedrun, the roofline fraction, and a mismatch fails the run."""
from __future__ import annotations

import io
import json

import pytest
from rich.console import Console


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("llama", seed=5)


@pytest.fixture()
def prompts(tmp_path):
    lines = [{"id": f"r{i}", "prompt_token_ids": list(range(10 + i, 10 + i + n)), "max_tokens": m, "ignore_eos": ie}
             for i, (n, m, ie) in enumerate([(5, 6, True), (17, 3, True), (9, 8, False), (12, 5, True)])]
    p = tmp_path / "w.jsonl"
    p.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return p


def bench(model_dir, prompts, tmp_path, engines=("pagedrun", "hf-static", "hf-continuous")):
    from pagedrun.bench.run import run_bench

    out = tmp_path / "bench.json"
    console = Console(file=io.StringIO(), width=200)
    code = run_bench(workload=str(prompts), model=str(model_dir), quick=True, json_path=out, dtype="float32",
                     engines=list(engines), overrides=["cache.block_size=8", "model.max_model_len=128"],
                     console=console, isolate=False, static_batch_sizes=[2, 4], continuous_max_requests=[4])
    return code, json.loads(out.read_text()), console.file.getvalue()


@pytest.mark.slow


def test_bench_json_has_throughput_ratios_and_roofline(model_dir, prompts, tmp_path):
    code, res, text = bench(model_dir, prompts, tmp_path)
    assert code == 0, text
    assert res["outputs_match"] is True and res["mismatches"] == []
    assert [(e["engine"], e["config"]) for e in res["engines"]] == [
        ("pagedrun", "continuous, paged"), ("hf-static", "batch 2"), ("hf-static", "batch 4"),
        ("hf-continuous", "max 4 requests/batch")]
    assert res["matmul_flops_per_s"] > 0
    assert res["model"]["parameters"]["matmul"] < res["model"]["parameters"]["total"]  # untied: embedding excluded
    for e in res["engines"]:
        assert e["prompt_tokens"] == 5 + 17 + 9 + 12
        assert e["output_tokens_per_s"] > 0 and e["total_tokens_per_s"] > e["output_tokens_per_s"]
        assert 0 < e["roofline_fraction"] and 0 < e["executed_roofline_fraction"]
        assert 0 < e["kv_utilisation"] <= 1 and e["peak_rss_bytes"] > 0
        assert set(e["ratio_to_pagedrun"]) >= {"output_tokens_per_s", "total_tokens_per_s", "wall_s",
                                               "peak_rss_bytes", "roofline_fraction"}
        assert e["mismatches"] == 0
    pg = res["engines"][0]
    assert pg["ratio_to_pagedrun"]["output_tokens_per_s"] == pytest.approx(1.0)
    # Committing KV pages happens inside pagedrun's timed run (vLLM's at load): measured, and said so.
    assert 0 <= pg["kv_populate_s"] < pg["wall_s"] and pg["kv_populate_s_kind"].startswith("measured")
    assert set(res["best"]) == {"pagedrun", "hf-static", "hf-continuous"}
    # Same tokens everywhere: the ignore_eos requests produce exactly max_tokens.
    assert len({e["output_tokens"] for e in res["engines"]}) == 1
    assert res["pagedrun_report"]["kv_capacity"]["block_size"] == 8
    assert res["machine"]["threads"] >= 1 and res["versions"]["transformers"]
    # Static batching pads: batch 4 runs every row to 8 new tokens over a 17-wide prompt.
    b4 = res["engines"][2]
    assert b4["executed_tokens"] == 4 * (17 + 8 - 1)
    assert "hf-continuous" in text and "tok/s" in text and "RSS" in text  # the two stacked tables
    assert _check_module().check(res) == []  # what CI runs on `pagedrun bench --quick --json`


def _check_module():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "check_bench.py"
    spec = importlib.util.spec_from_file_location("check_bench", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_mismatch_is_reported_and_fails(model_dir, prompts, tmp_path, monkeypatch):
    import pagedrun.bench.engines as engines_mod

    real = engines_mod._run_hf_static

    def corrupt(spec, requests):
        row = real(spec, requests)
        row["outputs"][1] = [t + 1 for t in row["outputs"][1]]
        return row

    monkeypatch.setattr(engines_mod, "_run_hf_static", corrupt)
    code, res, _ = bench(model_dir, prompts, tmp_path, engines=("pagedrun", "hf-static"))
    assert code == 1
    assert res["outputs_match"] is False
    assert any("outputs differ" in p for p in _check_module().check(res))
    assert res["mismatches"] == [
        {"request": "r1", "engine": "hf-static", "config": c, "first_difference_at": 0,
         "reference_tokens": 3, "tokens": 3} for c in ("batch 2", "batch 4")]


def test_workloads_are_deterministic_and_shaped_as_specified():
    from pagedrun.bench.workloads import make_workload

    std = make_workload("standard", 4000, quick=False)
    assert len(std) == 64 and std == make_workload("standard", 4000, quick=False)
    assert all(16 <= len(r.prompt_token_ids) <= 256 and 16 <= r.max_tokens <= 128 and r.ignore_eos for r in std)
    assert all(3 <= t < 4000 for r in std for t in r.prompt_token_ids)
    assert make_workload("standard", 4000, quick=False, seed=1) != std
    sp = make_workload("shared-prefix", 4000, quick=False)
    assert len(sp) == 32 and all(r.max_tokens == 64 for r in sp)
    prefix = sp[0].prompt_token_ids[:256]
    assert all(r.prompt_token_ids[:256] == prefix and 16 <= len(r.prompt_token_ids) - 256 <= 64 for r in sp)
    assert len({tuple(r.prompt_token_ids[256:]) for r in sp}) == 32
