"""Streaming a large batch file: time to the first output line and peak RSS of `pagedrun generate`
at two file sizes (docs/results.md, "Streaming large inputs"). Not a test: wall times depend on
the machine and whatever else runs on it.

    python benchmarks/stream_bench.py --sizes 10000 200000 [--max-tokens 4] [--format openai|jsonl]
                                      [--time-limit 600]
    python benchmarks/stream_bench.py --rewrite-only --sizes 200000    # the final rewrite alone

The model is `pagedrun bench`'s 29M random Llama with a word-level tokenizer added (4000 words), so
requests are text: each line is tokenized, as a real file's are. Each size runs in its own process;
a run longer than --time-limit gets SIGINT (pagedrun stops after the step, keeps what finished)
and the table says so. Peak RSS is the child's ru_maxrss (os.wait4), the first line is polled.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPECIALS = ["[UNK]", "<s>", "</s>"]


def bench_model(root: Path) -> Path:
    """The bench's tiny model plus a word-level tokenizer (w0 .. w3996), in `root`/model."""
    sys.path.insert(0, str(ROOT))
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from pagedrun.bench.workloads import TINY_LLAMA, tiny_llama_dir

    target = root / "model"
    if (target / "tokenizer.json").is_file():
        return target
    target.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_llama_dir() / name, target / name)
    vocab = SPECIALS + [f"w{i}" for i in range(TINY_LLAMA["vocab_size"] - len(SPECIALS))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.add_special_tokens(SPECIALS[1:])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="[UNK]").save_pretrained(target)
    return target


def write_requests(path: Path, n: int, fmt: str, max_tokens: int, seed: int = 0) -> None:
    """n short text requests (6-12 words), ignore_eos so each makes max_tokens tokens."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            text = " ".join(f"w{rng.randrange(3, 3990)}" for _ in range(rng.randrange(6, 13)))
            if fmt == "openai":
                line = {"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                        "body": {"model": "tiny", "prompt": text, "max_tokens": max_tokens, "ignore_eos": True}}
            else:
                line = {"id": f"r{i}", "prompt": text, "max_tokens": max_tokens, "ignore_eos": True}
            f.write(json.dumps(line) + "\n")


def run_one(model: Path, prompts: Path, out: Path, sets: list[str], time_limit: float) -> dict:
    cmd = [sys.executable, "-m", "pagedrun", "generate", str(prompts), "-o", str(out), "-q", "--overwrite",
           "--set", f"model.path={model}", *[x for s in sets for x in ("--set", s)]]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out.unlink(missing_ok=True)  # an earlier run's output would count as this run's first line
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    first_line = None
    stopped = False
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        now = time.perf_counter() - t0
        if first_line is None and out.exists() and out.stat().st_size > 0:
            first_line = now
        if now > time_limit and not stopped:
            proc.send_signal(signal.SIGINT)
            stopped = True
        time.sleep(0.02)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    done = sum(1 for _ in open(out, "rb")) if out.exists() else 0
    # The KV pages the run committed: a job too short to fill its cache commits fewer, which is not
    # memory per request (the two sizes' peaks compare fairly once it is taken off).
    report = Path(f"{out}.report.json")
    kv = json.loads(report.read_text())["kv_pages_committed"]["bytes"] / 2**20 if report.exists() else None
    peak = usage.ru_maxrss / 1024
    return {"exit": proc.returncode, "first_line_s": first_line, "wall_s": wall, "peak_rss_mib": peak,
            "kv_committed_mib": kv, "peak_rss_less_kv_mib": None if kv is None else peak - kv,
            "lines_written": done, "stopped_at_time_limit": stopped, "stderr_tail": proc.stderr.read().decode()[-300:]}


def rewrite_only(workdir: Path, n: int, fmt: str, max_tokens: int) -> dict:
    """The final in-order rewrite alone, at n lines: pass 1 over the file, n output lines of the
    Batch API's shape (about 600 bytes) appended in reverse order, then finalize; peak RSS of this
    process (ru_maxrss) before and after the rewrite. In-process: no model, so the numbers are the
    streaming machinery's own."""
    import resource

    from pagedrun.io.openai_batch import BatchJob
    from pagedrun.io.stream import RequestStream
    from pagedrun.io.writer import OutputWriter, request_key
    from pagedrun.models.loader import load_tokenizer
    from pagedrun.sampling_params import SamplingParams

    prompts = workdir / f"requests-{n}.{fmt}.jsonl"
    if not prompts.exists():
        write_requests(prompts, n, fmt, max_tokens)
    job = BatchJob("0" * 64, "tiny", 0)
    stream = RequestStream(prompts, SamplingParams(), vocab_size=4000, max_model_len=2048,
                           tokenizer=load_tokenizer(bench_model(workdir)), batch_job=job)
    stream.validate()
    out = workdir / f"rewrite-{n}.jsonl"
    writer = OutputWriter(out, {"prompts": str(n)}, overwrite=True, fsync_interval_s=60)
    writer.open()
    pad = "w1 " * 150
    for i in reversed(range(n)):
        cid = f"r{i}"
        writer.write({"id": job.line_id(cid), "custom_id": cid, "response": {"status_code": 200, "request_id": "x",
                      "body": {"choices": [{"text": pad}]}}, "error": None}, request_key(job.line_id(cid)),
                     input_line=i + 1)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t0 = time.perf_counter()
    writer.finalize()  # in input order, from the lines the writes recorded
    rewrite_s = time.perf_counter() - t0
    writer.close()
    return {"lines": n, "output_mib": out.stat().st_size / 2**20, "peak_rss_before_rewrite_mib": before,
            "peak_rss_after_rewrite_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "rewrite_s": rewrite_s}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 200_000])
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--format", choices=("openai", "jsonl"), default="openai")
    ap.add_argument("--time-limit", type=float, default=600.0)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/pagedrun-stream-bench"))
    ap.add_argument("--set", action="append", default=[], help="recipe override, as for pagedrun generate")
    ap.add_argument("--rewrite-only", action="store_true", help="measure the final rewrite alone (one size)")
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.rewrite_only:
        print(json.dumps(rewrite_only(args.workdir, args.sizes[0], args.format, args.max_tokens)))
        return
    model = bench_model(args.workdir)
    sets = ["cache.kv_cache_memory=256MiB", "model.threads=2", *args.set]
    rows = []
    for n in args.sizes:
        prompts = args.workdir / f"requests-{n}.{args.format}.jsonl"
        if not prompts.exists():
            write_requests(prompts, n, args.format, args.max_tokens)
        row = {"requests": n, "format": args.format, "max_tokens": args.max_tokens,
               **run_one(model, prompts, args.workdir / f"out-{n}.jsonl", sets, args.time_limit)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if len(rows) > 1 and all(r["peak_rss_less_kv_mib"] for r in rows):
        a, b = rows[0], rows[-1]
        print(f"peak RSS {b['requests']:,} / {a['requests']:,} requests: {b['peak_rss_mib'] / a['peak_rss_mib']:.3f}x; "
              f"less the committed KV pages {b['peak_rss_less_kv_mib'] / a['peak_rss_less_kv_mib']:.3f}x")


if __name__ == "__main__":
    main()
