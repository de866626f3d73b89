"""A gzip-compressed prompts file runs as its text would (issue 39): the same lines, outputs and job."""
from __future__ import annotations

import gzip
import json

import pytest
from typer.testing import CliRunner

from pagedrun.cli.app import app
from pagedrun.errors import PagedrunError
from pagedrun.io.input_files import InputSnapshot, read_input


def _lines(n: int) -> bytes:
    return "".join(json.dumps({"id": f"r{i}", "prompt_token_ids": [5, 6, i], "max_tokens": 2, "ignore_eos": True})
                   + "\n" for i in range(n)).encode()


def test_snapshot_of_gzip_is_the_text(tmp_path):
    text = _lines(5000)  # several MiB compressed in more than one read, members concatenated
    plain, packed = tmp_path / "p.jsonl", tmp_path / "p.jsonl.gz"
    plain.write_bytes(text)
    half = text.index(b"\n", len(text) // 2) + 1
    packed.write_bytes(gzip.compress(text[:half]) + gzip.compress(text[half:]))
    a, b = InputSnapshot.open(plain), InputSnapshot.open(packed)
    try:
        assert b"".join(b.lines()) == text and b.size == len(text)
        assert a.sha256 == b.sha256  # the same job
        assert b.change() is None
        packed.write_bytes(gzip.compress(text))
        assert "changed during the run" in b.change()
    finally:
        a.close(), b.close()
    assert read_input(packed, "prompts") == text


@pytest.mark.parametrize("damage", ["cut", "garbage"])
def test_broken_gzip_is_one_line(tmp_path, damage):
    data = gzip.compress(_lines(50))
    bad = tmp_path / "p.jsonl.gz"
    bad.write_bytes(data[: len(data) // 2] if damage == "cut" else data[:10] + b"\xff" * 40 + data[50:])
    for read in (lambda: InputSnapshot.open(bad).close(), lambda: read_input(bad, "prompts")):
        with pytest.raises(PagedrunError, match=r"^p\.jsonl\.gz: not a valid gzip file: "):
            read()


def test_generate_reads_gzip(tiny_model, tmp_path):
    text = _lines(4)
    (tmp_path / "p.jsonl").write_bytes(text)
    (tmp_path / "p.jsonl.gz").write_bytes(gzip.compress(text))
    outs = []
    for name in ("p.jsonl", "p.jsonl.gz"):
        out = tmp_path / f"{name}.out"
        res = CliRunner().invoke(app, ["generate", str(tmp_path / name), "-o", str(out), "-q", "--model",
                                       str(tiny_model("llama")), "--set", "model.device=cpu", "--set",
                                       "cache.num_blocks=32", "--max-model-len", "64"])
        assert res.exit_code == 0, res.output
        outs.append([json.loads(x)["token_ids"] for x in out.read_text().splitlines()])
    assert outs[0] == outs[1] and len(outs[0]) == 4
