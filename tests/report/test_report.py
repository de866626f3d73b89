"""The memory report against hand-computed cases: a tiny model, block_size 8, chosen prompt lengths,
ignore_eos and a fixed max_tokens, so every step's block count is known in advance.

Timeline of a request with prompt p and max_tokens m (no preemption, everything fits): step 0 computes
the prompt and samples token 1; step k computes token p + k - 1 and samples token k + 1; the step that
samples token m frees its blocks before the step is recorded. After step k < m - 1 it therefore holds
p + k computed tokens in ceil((p + k) / 8) blocks.
"""
from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("llama", seed=3)


def make_llm(model_dir, *extra):
    from pagedrun.llm import LLM

    return LLM(None, [f"model.path={model_dir}", "model.device=cpu", "model.max_model_len=64",
                      "cache.block_size=8", "cache.num_blocks=64", *extra])


def run(llm, prompts, max_tokens):
    from pagedrun.report.report import build_report
    from pagedrun.sampling_params import SamplingParams

    results = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return results, build_report(llm.engine, results, wall_s=2.0, load_s=0.5)


def distinct_prompts(lengths, start=10):
    out, nxt = [], start
    for n in lengths:
        out.append(list(range(nxt, nxt + n)))
        nxt += n
    return out


def test_hand_computed_blocks_utilisation_fragmentation_contiguous(model_dir):
    llm = make_llm(model_dir)
    results, r = run(llm, distinct_prompts([5, 8, 13]), max_tokens=4)
    steps = llm.engine.steps
    # tokens after steps 0..2: (5,8,13) (6,9,14) (7,10,15); step 3 samples the 4th token and frees.
    assert [s.blocks_in_use for s in steps] == [1 + 1 + 2, 1 + 2 + 2, 1 + 2 + 2, 0]
    assert [s.tokens_stored for s in steps] == [26, 29, 32, 0]
    assert [s.reserved_contiguous_tokens for s in steps] == [38, 38, 38, 0]
    assert r["num_steps"] == 4
    assert r["kv_capacity"] == {"blocks": 64, "block_size": 8, "tokens": 512,
                                "bytes": 64 * llm.engine.memory.block_bytes,
                                "bytes_per_token": llm.engine.memory.block_bytes // 8, "kv_cache_dtype": "float32"}
    assert r["blocks_in_use"]["peak"] == 5
    pages = r["kv_pages_committed"]  # a whole chunk of blocks ahead of the 5 used, or off
    if llm.engine.worker.populator.active:
        assert pages["blocks"] == llm.engine.worker.populator.populated >= 5 and pages["seconds"] > 0
        assert pages["bytes"] == pages["blocks"] * llm.engine.memory.block_bytes
    assert r["blocks_in_use"]["mean"] == pytest.approx(14 / 4)
    assert r["utilisation"]["tokens_stored_over_slots_allocated"] == pytest.approx(87 / 112)
    assert r["utilisation"]["at_peak"] == pytest.approx(29 / 40)  # first step reaching the peak
    # waste per step: 32-26, 40-29, 40-32, 0
    assert r["fragmentation"]["last_block_waste_tokens_mean"] == pytest.approx(25 / 4)
    assert r["fragmentation"]["last_block_waste_tokens_at_peak"] == 11
    assert r["fragmentation"]["last_block_waste_percent"] == pytest.approx(100 * 25 / 112)
    assert r["fragmentation"]["reserved_uncomputed_tokens_mean"] == 0
    c = r["contiguous"]["request_max"]
    assert c["peak_tokens"] == 9 + 12 + 17
    assert c["peak_bytes"] == 38 * r["kv_capacity"]["bytes_per_token"]
    assert c["utilisation"] == pytest.approx(87 / 114)
    assert c["peak_over_paged_peak"] == pytest.approx(38 / 40)
    cm = r["contiguous"]["max_model_len"]
    assert cm["peak_tokens"] == 3 * 64 and cm["utilisation"] == pytest.approx(87 / (3 * 3 * 64))
    assert r["prefix_cache"] == {"query_tokens": 26, "hit_tokens": 0, "hit_rate": 0.0, "cow_copies": 0}
    assert r["preemptions"] == {"recompute": 0, "swap": 0, "swap_fallbacks": 0}
    assert r["swap"]["in_blocks"] == r["swap"]["out_blocks"] == 0
    th = r["throughput"]
    assert (th["prompt_tokens"], th["output_tokens"], th["prefill_tokens_computed"]) == (26, 12, 26)
    assert th["output_tokens_per_s"] == pytest.approx(6.0) and th["total_tokens_per_s"] == pytest.approx(19.0)
    assert all(r["latency"][k]["p50"] is not None for k in ("ttft_s", "itl_s", "e2e_s"))
    assert len([x for o in results for x in o.metrics["itl_s"]]) == 3 * 3


def test_prefix_sharing_counts_shared_blocks_once(model_dir):
    llm = make_llm(model_dir)
    shared = list(range(100, 116))  # two full blocks
    _, r = run(llm, [shared + [7, 8, 9, 10], shared + [20, 21, 22, 23]], max_tokens=2)
    steps = llm.engine.steps
    # step 0: request 2 hits both blocks request 1 registered earlier in the same step
    assert [s.blocks_in_use for s in steps] == [2 + 1 + 1, 0]
    assert steps[0].tokens_stored == 16 + 4 + 4 and steps[0].tokens_logical == 40
    assert r["prefix_cache"]["query_tokens"] == 40 and r["prefix_cache"]["hit_tokens"] == 16
    assert r["prefix_cache"]["hit_rate"] == pytest.approx(0.4)
    assert r["throughput"]["prefill_tokens_computed"] == 40 - 16
    assert r["utilisation"]["tokens_stored_over_slots_allocated"] == pytest.approx(24 / 32)
    assert r["contiguous"]["request_max"]["peak_tokens"] == 2 * 22
    assert r["contiguous"]["request_max"]["utilisation"] == pytest.approx(40 / 44)


@pytest.mark.slow


def test_preemptions_are_counted_and_outputs_unchanged(model_dir, tmp_path):
    from pagedrun.report.plot import plot_blocks

    prompts = distinct_prompts([8, 8])
    ref, _ = run(make_llm(model_dir), prompts, max_tokens=12)
    llm = make_llm(model_dir, "cache.num_blocks=4")
    got, r = run(llm, prompts, max_tokens=12)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    assert r["preemptions"]["recompute"] >= 1
    assert r["preemptions"]["recompute"] == sum(o.num_preemptions for o in got)
    assert r["blocks_in_use"]["peak"] == 4 and r["blocks_in_use"]["peak_fraction_of_capacity"] == 1.0
    assert r["throughput"]["prefill_tokens_computed"] > 16  # the preempted prompt was computed again
    png = tmp_path / "blocks.png"
    plot_blocks(llm.engine, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_number_has_provenance(model_dir):
    from pagedrun.report.report import _leaves, provenance_prefix

    _, r = run(make_llm(model_dir), distinct_prompts([5, 9]), max_tokens=3)
    leaves = [p for p in _leaves(r) if not p.startswith("provenance.")]
    # One entry per described part: every number's longest described prefix, and nothing else.
    assert {provenance_prefix(p) for p in leaves} == set(r["provenance"])
    assert all(v.split(":")[0] in ("measured", "derived") for v in r["provenance"].values())
    assert len(r["provenance"]) < len(leaves) / 2  # compact: not a line per number
    json.dumps(r)  # serialisable


def test_percentiles_interpolate_like_numpy():
    from pagedrun.report.report import percentiles

    assert percentiles([]) == {"p50": None, "p90": None, "p99": None}
    p = percentiles([4.0, 1.0, 3.0, 2.0])
    assert p["p50"] == pytest.approx(2.5) and p["p90"] == pytest.approx(3.7) and p["p99"] == pytest.approx(3.97)


def test_generate_cli_writes_report_and_plot(model_dir, tmp_path):
    from typer.testing import CliRunner

    from pagedrun.cli.app import app

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_token_ids": p, "max_tokens": 3, "ignore_eos": True}) + "\n"
                               for p in distinct_prompts([6, 11])))
    out = tmp_path / "out.jsonl"
    res = CliRunner().invoke(app, ["generate", str(prompts), "-o", str(out), "--plot", str(tmp_path / "p.png"),
                                   "--set", f"model.path={model_dir}", "--set", "model.device=cpu",
                                   "--set", "cache.block_size=8", "--set", "cache.num_blocks=32",
                                   "--set", "model.max_model_len=64"])
    assert res.exit_code == 0, res.output
    rep = json.loads((tmp_path / "out.jsonl.report.json").read_text())
    assert rep["throughput"]["output_tokens"] == 6 and rep["prefix_cache"]["query_tokens"] == 17
    assert rep["blocks_in_use"]["peak"] == 1 + 2
    assert (tmp_path / "p.png").stat().st_size > 1000
    # What ran, where and when (issue 39): enough to tell two reports apart a month later.
    run = rep["run"]
    assert run["model"] == model_dir.name and run["pagedrun_version"] and run["machine"]["device"] == "cpu"
    assert run["recipe"]["cache"]["block_size"] == 8 and run["recipe"]["model"]["max_model_len"] == 64
    assert run["started_at"] <= run["ended_at"] and run["ended_at"].endswith("Z")
    assert rep["provenance"]["run"].startswith("measured: ")
    assert run["parameters"] == run["active_parameters"] > 0 and run["architecture"] == "LlamaForCausalLM"
