"""benchmarks/gpu_throughput.py's logic, run dry on the CPU (the emulated kernels, no graphs): every
mode runs, its numbers are there, tokens are compared, a planted difference fails the run."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import gpu_throughput as G  # noqa: E402


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="the CUDA-on-CPU harness needs g++")
def test_dry_run_on_the_cpu(tmp_path, capsys):
    out = tmp_path / "t.json"
    assert G.main(["--device", "cpu", "--tiny", "--requests", "3", "--tokens", "4", "--prompt", "5",
                   "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["requests"] == 3 and row["today_equal"] is True
    for mode in ("today", "eager", "async"):
        m = row["modes"][mode]
        assert m["decode_steps"] == 3 and m["out_tok_s"] > 0 and m["host_ms"] > 0 and m["gpu_ms"] is None
    assert "graphs need CUDA" in row["modes"]["graphs"]["skipped"]
    assert row["async_equal"] is True
    assert "async vs graphs True, today vs eager True" in capsys.readouterr().out


def test_table_and_failure_on_differing_tokens(monkeypatch, capsys):
    row = dict(shape="s", requests=64, graphs_line="cuda graphs: 11 buckets", today_equal=False, tokens_equal=False,
               async_equal=True,
               modes={"eager": dict(out_tok_s=100.0, step_ms=2.0, host_ms=1.0, gpu_ms=0.5, bw_share=0.42)})
    assert "42%" in G.table([row])
    monkeypatch.setattr(G, "run_case", lambda *a: row)
    monkeypatch.setattr(G, "random_model", lambda shape, d: d, raising=False)
    assert G.main(["--device", "cpu", "--tiny", "--requests", "64"]) == 1
    assert "tokens differ between graphs and eager in 1 case" in capsys.readouterr().out
