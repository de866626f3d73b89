"""The input file is a snapshot (issue 40, item 2): a run reads the bytes its prompts file held when it
started, says in one line if the file changed meanwhile, and puts its output in input order without
parsing the prompts again, so no change to the file during a run stops it or loses a finished output."""
from __future__ import annotations

import json
import os

import pytest
from typer.testing import CliRunner

from pagedrun.cli.app import app
from pagedrun.cli.generate import LocalRun
from pagedrun.io.input_files import InputSnapshot

N = 6


def line(i: int, **extra) -> str:
    return json.dumps({"id": f"r{i}", "prompt_token_ids": [5, 6, i], **extra}) + "\n"


@pytest.fixture
def job(tiny_model, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(line(i) for i in range(N)))
    out = tmp_path / "out.jsonl"
    args = ["generate", str(prompts), "-o", str(out), "--model", str(tiny_model("llama")), "--set",
            "model.device=cpu", "--set", "cache.num_blocks=32", "--max-model-len", "64", "--set",
            "sampling.max_tokens=2", "--set", "sampling.ignore_eos=true", "-q"]
    return prompts, out, args


def during_the_run(monkeypatch, change, after_run: bool = False) -> None:
    """Apply `change` once pass 1 has checked the file: as the engine starts (before pass 2 reads a
    line) or, with after_run, when every request has run (before the final rewrite)."""
    real = LocalRun.run

    def run(self, *a, **kw):
        if not after_run:
            change()
        real(self, *a, **kw)
        if after_run:
            change()

    monkeypatch.setattr(LocalRun, "run", run)


def ids(out) -> list[str]:
    return [json.loads(x)["id"] for x in out.read_text().splitlines()]


def edit_in_place(path, old: bytes, new: bytes) -> None:
    data = path.read_bytes()
    assert len(old) == len(new) and old in data
    with open(path, "r+b") as f:  # the same file, the same size: only the bytes differ
        f.seek(data.index(old))
        f.write(new)


CHANGES = {
    "append-valid": lambda p: p.open("a").write(line(100)),
    "append-duplicate-id": lambda p: p.open("a").write(line(1)),
    "append-bad-line": lambda p: p.open("a").write('{"prompt_token_ids": [5], "temperature": -1}\n'),
    "append-torn-line": lambda p: p.open("a").write('{"prompt_tok'),
    "editor-save": lambda p: (p.with_suffix(".new").write_text(line(9) + p.read_text()),
                              os.replace(p.with_suffix(".new"), p)),
    "removed": lambda p: p.unlink(),
    "truncated-then-rewritten": lambda p: p.write_text(line(7)),  # `cp` or `>` over it: the same file
    "truncated": lambda p: p.write_bytes(b""),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_file_changed_during_the_run_runs_as_it_was_and_says_so(job, monkeypatch, change):
    prompts, out, args = job
    snapshot_text = prompts.read_text()
    during_the_run(monkeypatch, lambda: CHANGES[change](prompts))
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "Traceback" not in res.output
    said = [x for x in res.output.splitlines() if x.startswith("p.jsonl: ")]
    assert len(said) == 1 and "changed during the run" in said[0], res.output
    assert f"used the {len(snapshot_text)} bytes" in said[0]
    assert ids(out) == [f"r{i}" for i in range(N)]  # exactly the snapshot's requests, in its order


@pytest.mark.parametrize("edit", ["made-invalid", "other-id", "duplicate-id"])
def test_a_line_edited_in_place_before_it_runs_runs_as_it_was_checked(job, monkeypatch, edit):
    prompts, out, args = job
    old = line(3).encode()
    new = {"made-invalid": old.replace(b"[5, 6, 3]", b"[5, 6, -]"), "other-id": old.replace(b'"r3"', b'"x3"'),
           "duplicate-id": old.replace(b'"r3"', b'"r0"')}[edit]
    during_the_run(monkeypatch, lambda: edit_in_place(prompts, old, new))
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "p.jsonl: changed during the run (modified)" in res.output and "Traceback" not in res.output
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["id"] for r in recs] == [f"r{i}" for i in range(N)] and all("error" not in r for r in recs)


@pytest.mark.parametrize("edit", ["invalid-json", "other-id", "duplicate-id"])
def test_editing_finished_lines_never_breaks_the_final_rewrite(job, monkeypatch, edit):
    prompts, out, args = job
    old = line(2).encode()
    new = {"invalid-json": b"{" + old[1:], "other-id": old.replace(b'"r2"', b'"x2"'),
           "duplicate-id": old.replace(b'"r2"', b'"r0"')}[edit]
    during_the_run(monkeypatch, lambda: edit_in_place(prompts, old, new), after_run=True)
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "p.jsonl: changed during the run (modified)" in res.output and "Traceback" not in res.output
    assert ids(out) == [f"r{i}" for i in range(N)]


def test_a_resume_after_the_file_changed_is_another_job(job, monkeypatch):
    prompts, _, args = job
    during_the_run(monkeypatch, lambda: CHANGES["append-valid"](prompts))
    assert CliRunner().invoke(app, args).exit_code == 0
    monkeypatch.undo()
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2 and "different prompts file" in res.output, res.output


def test_the_snapshot_reads_its_bytes_only(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_bytes(b"a\nbb\nccc")
    snap = InputSnapshot.open(p)
    with open(p, "ab") as f:
        f.write(b"c\nappended\n")
    assert list(snap.lines()) == [b"a\n", b"bb\n", b"ccc"]
    assert "now 19 bytes" in snap.change()
    with open(p, "r+b") as f:
        f.write(b"X")  # in place
    p.write_bytes(b"")  # truncated
    assert list(snap.lines()) == [b"a\n", b"bb\n", b"ccc"]
    p.unlink()
    assert list(snap.lines()) == [b"a\n", b"bb\n", b"ccc"] and "(removed)" in snap.change()
    snap.close()
    big = tmp_path / "big.jsonl"
    rows = [b"x" * (3 << 20) + b"\n", b"y\n", b"z" * 10]  # lines longer than a read, and short ones
    big.write_bytes(b"".join(rows))
    snap = InputSnapshot.open(big)
    assert list(snap.lines()) == rows and snap.change() is None
    snap.close()
