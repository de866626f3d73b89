"""pagedrun against itself at another commit, alternated on one machine.

    python3 benchmarks/ab_bench.py REF [--rounds N] [--out DIR] [-- pagedrun bench options]

e.g. on a GPU machine, the host work of 5ed32e4 against the code before it:

    python3 benchmarks/ab_bench.py 5ed32e4~1 --rounds 3 -- --model /tmp/pagedrun-random-smollm2 --dtype bfloat16

Timings from different machines, or from one machine minutes apart, do not compare on the lent
hosts (one code ran at 649-897 out tok/s on one H100 machine: docs/guide/gpu.md), so each round runs
`pagedrun bench --engines pagedrun` once at REF (its pagedrun/ and kernels/, exported from git
into a temporary folder) and once on this tree, the order swapped every round so that a drift
of the host weighs on both. Prints each run's out tok/s, the median ratio this tree / REF, and
whether pagedrun's greedy tokens agree between the two (the bench JSON keeps every output).
Writes DIR/ref_<i>.json and DIR/tree_<i>.json (default benchmarks/results/ab). Runs on a CPU or
a GPU, whichever the bench picks; needs git and REF in this clone's history, or REF a folder that
already holds pagedrun/ and kernels/ (a lent machine's copy of the tree may carry no history:
export there beforehand with `git archive REF pagedrun kernels | tar -x -C FOLDER`).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def export(ref: str, into: Path) -> Path:
    """REF's pagedrun/ and kernels/ (what `python -m pagedrun` imports and compiles) under `into`."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "pagedrun", "kernels"],
                             capture_output=True, check=False)
    if archive.returncode:
        raise SystemExit(f"ab_bench: git archive {ref}: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def ref_tree(ref: str, tmp: Path) -> Path:
    """REF's code: a folder that already holds pagedrun/ as it is, else the commit exported into tmp."""
    return Path(ref).resolve() if Path(ref, "pagedrun").is_dir() else export(ref, tmp)


def run(side: str, where: Path, json_path: Path, bench_args: list[str]) -> dict:
    cmd = [sys.executable, "-m", "pagedrun", "bench", "--engines", "pagedrun", "--json", str(json_path),
           *bench_args]
    # cwd first on sys.path with -m: REF's package, not the installed (editable) one
    proc = subprocess.run(cmd, cwd=where, env={**os.environ, "PYTHONPATH": str(where)}, capture_output=True,
                          text=True, check=False)
    if proc.returncode:
        raise SystemExit(f"ab_bench: {side} run failed ({proc.returncode}):\n{proc.stdout[-2000:]}"
                         f"{proc.stderr[-2000:]}")
    return json.loads(json_path.read_text())


def pagedrun_row(result: dict) -> dict:
    return next(e for e in result["engines"] if e["engine"] == "pagedrun")


def summarise(ref_runs: list[dict], tree_runs: list[dict]) -> dict:
    """Each side's out tok/s, the median of this tree / REF, and the greedy tokens compared: every
    run of either side against the first REF run (request by request)."""
    rates = {side: [pagedrun_row(r)["output_tokens_per_s"] for r in runs]
             for side, runs in (("ref", ref_runs), ("tree", tree_runs))}
    reference = pagedrun_row(ref_runs[0])["outputs"]
    differing = []
    for side, runs in (("ref", ref_runs), ("tree", tree_runs)):
        for i, r in enumerate(runs):
            outs = pagedrun_row(r)["outputs"]
            bad = sum(1 for a, b in zip(reference, outs) if a != b) + abs(len(reference) - len(outs))
            if bad:
                differing.append(f"{side} run {i + 1}: {bad} of {len(reference)} requests")
    return {"ref_tok_s": rates["ref"], "tree_tok_s": rates["tree"],
            "median_ratio": statistics.median(rates["tree"]) / statistics.median(rates["ref"]),
            "requests": len(reference), "differing": differing}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    bench_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, bench_args = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("ref", help="a commit, tag or branch of this clone, or a folder holding pagedrun/ and kernels/")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "ab")
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    ref_runs, tree_runs = [], []
    with tempfile.TemporaryDirectory(prefix="pagedrun-ab-") as tmp:
        ref_dir = ref_tree(a.ref, Path(tmp))
        for i in range(1, a.rounds + 1):
            order = [("ref", ref_dir), ("tree", ROOT)]
            for side, where in order if i % 2 else order[::-1]:
                result = run(side, where, a.out / f"{side}_{i}.json", bench_args)
                (ref_runs if side == "ref" else tree_runs).append(result)
                print(f"round {i} {side:4s}: {pagedrun_row(result)['output_tokens_per_s']:9.1f} out tok/s",
                      flush=True)
    s = summarise(ref_runs, tree_runs)
    print(f"this tree / {a.ref}: {s['median_ratio']:.3f} (median out tok/s {statistics.median(s['tree_tok_s']):.1f} "
          f"vs {statistics.median(s['ref_tok_s']):.1f}, {a.rounds} alternated rounds)")
    if s["differing"]:
        print("greedy tokens differ from the first REF run: " + "; ".join(s["differing"]))
        return 1
    print(f"greedy tokens: every run equal ({s['requests']} requests)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
