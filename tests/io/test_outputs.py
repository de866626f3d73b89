"""OutputWriter: append, resume, torn lines, fingerprints, input order, signals during a write."""
from __future__ import annotations

import json
import os
import signal
import threading
from array import array
from pathlib import Path

import pytest

from pagedrun.errors import PagedrunError
from pagedrun.io import writer as outputs
from pagedrun.io.writer import OutputWriter, invalid_key, meta_path, record_key, request_key

FP = {"recipe": "r1", "prompts": "p1"}


def rec(i: int, **extra) -> dict:
    return {"id": f"r{i}", "token_ids": [i, i + 1], "text": f"café {i}\nsecond line", **extra}


def lines(path: Path) -> list[dict]:
    data = path.read_bytes()
    assert data == b"" or data.endswith(b"\n")
    return [json.loads(x) for x in data.splitlines()]


def opened(path: Path, fp: dict = FP, **kw) -> OutputWriter:
    w = OutputWriter(path, fp, **kw)
    w.open()
    return w


def test_append_then_finalize_in_input_order(tmp_path):
    out = tmp_path / "sub" / "out.jsonl"  # the parent is created
    w = opened(out)
    for i in (2, 0, 1):
        w.write(rec(i))
    assert [r["id"] for r in lines(out)] == ["r2", "r0", "r1"]  # on disk as they finish
    w.finalize([request_key(f"r{i}") for i in range(3)])
    assert lines(out) == [rec(0), rec(1), rec(2)]
    assert json.loads(meta_path(out).read_text())["fingerprint"] == FP
    assert (out.parent / "out.jsonl.lock").is_file()  # held until close(): the report is written next
    w.close()
    assert sorted(p.name for p in out.parent.iterdir()) == ["out.jsonl", "out.jsonl.meta.json"]


def test_resume_keeps_done_records_and_appends(tmp_path):
    out = tmp_path / "out.jsonl"
    w = opened(out)
    w.write(rec(0))
    w.write(rec(3))
    w.close()  # killed here: no finalize
    w2 = OutputWriter(out, FP)
    assert w2.resumed == 2 and w2.discarded == 0
    assert request_key("r0") in w2 and request_key("r3") in w2 and request_key("r1") not in w2
    w2.open()
    w2.write(rec(1))
    w2.finalize([request_key(f"r{i}") for i in range(4)])
    assert [r["id"] for r in lines(out)] == ["r0", "r1", "r3"]


@pytest.mark.parametrize("tail", [b'{"id": "r9", "tok', b"{", b"   ", b'{"id": "r9"}'])
def test_torn_last_line_is_dropped_and_redone(tmp_path, tail):
    # b'{"id": "r9"}' parses but has no newline: the write that died was the newline's, so it is
    # not known to be the whole record; it is redone like any torn line.
    out = tmp_path / "out.jsonl"
    w = opened(out)
    w.write(rec(0))
    w.close()
    with open(out, "ab") as f:
        f.write(tail)
    w2 = OutputWriter(out, FP)
    assert list(w2.done) == [request_key("r0")]
    assert out.read_bytes().endswith(tail)  # nothing changes before open()
    w2.open()
    assert lines(out) == [rec(0)]  # cut off at once, so appends start on a fresh line
    w2.write(rec(9))
    w2.close()
    assert lines(out) == [rec(0), rec(9)]


def test_garbage_and_repeated_lines_are_dropped(tmp_path):
    out = tmp_path / "out.jsonl"
    w = opened(out)
    w.close()
    good = [json.dumps(rec(i)).encode() for i in range(3)]
    out.write_bytes(b"\n".join([good[0], b"\x00\x00\x00", b"\xff not json", b"[1, 2]", b'{"no": "id"}',
                                good[1], good[0], b"", good[2]]) + b"\n")
    w2 = OutputWriter(out, FP)
    assert list(w2.done) == [request_key(f"r{i}") for i in range(3)]
    assert w2.discarded == 5
    w2.open()
    assert lines(out) == [rec(0), rec(1), rec(2)]


def test_records_are_keyed_by_line_for_invalid_input(tmp_path):
    # --skip-invalid turns a duplicate-id line into an error record with the same id as the request
    # it duplicates: neither may replace the other, now or on resume.
    out = tmp_path / "out.jsonl"
    w = opened(out)
    bad = {"id": "a", "line": 2, "error": "p.jsonl:2: id: duplicate id 'a' (first used on line 1)"}
    w.write(bad, invalid_key(2))
    w.write({"id": "a", "token_ids": [1]})
    w.close()
    w2 = OutputWriter(out, FP)
    assert set(w2.done) == {request_key("a"), invalid_key(2)}
    w2.open()
    w2.finalize([request_key("a"), invalid_key(2)])
    assert lines(out) == [{"id": "a", "token_ids": [1]}, bad]
    assert record_key(bad) == invalid_key(2)
    assert record_key({"id": 7, "error": "engine failed"}) == request_key("7")  # runtime errors: by id
    assert record_key([1]) is None and record_key({"text": "x"}) is None


@pytest.mark.parametrize("changed, word", [({"recipe": "r2", "prompts": "p1"}, "recipe"),
                                           ({"recipe": "r1", "prompts": "p2"}, "prompts file")])
def test_other_recipe_or_prompts_is_refused_unless_overwrite(tmp_path, changed, word):
    out = tmp_path / "out.jsonl"
    w = opened(out)
    w.write(rec(0))
    w.close()
    before = out.read_bytes()
    with pytest.raises(PagedrunError) as e:
        OutputWriter(out, changed)
    msg = str(e.value)
    assert msg.startswith(f"{out}: ") and f"different {word}" in msg and "--overwrite" in msg
    assert "\n" not in msg
    assert out.read_bytes() == before  # a refusal changes nothing
    w2 = opened(out, changed, overwrite=True)
    assert not w2.done and out.read_bytes() == b""
    w2.close()
    assert json.loads(meta_path(out).read_text())["fingerprint"] == changed


def test_foreign_file_and_bad_meta_are_refused(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text("my own notes\n")
    with pytest.raises(PagedrunError, match="not written by pagedrun.*--overwrite"):
        OutputWriter(out, FP)
    meta_path(out).write_text("{not json")  # not ours: refused even with --overwrite
    for overwrite in (False, True):
        with pytest.raises(PagedrunError, match=r"meta\.json: the meta file of -o .* was not written by pagedrun"):
            OutputWriter(out, FP, overwrite=overwrite)
    (tmp_path / "d").mkdir()
    with pytest.raises(PagedrunError, match="is a directory"):
        OutputWriter(tmp_path / "d", FP)
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")  # e.g. created by the shell's redirection: nothing to lose
    opened(empty).close()


def test_stale_temporary_files_are_removed(tmp_path):
    out = tmp_path / "out.jsonl"
    opened(out).close()
    (tmp_path / ".out.jsonl.12345.tmp").write_text('{"id": "half a rewrite')  # a killed run's
    (tmp_path / ".out.jsonl.meta.json.12345.tmp").write_text("{")
    (tmp_path / "out.jsonl.tmp").write_text("the user's own file")  # not a name pagedrun uses
    w = opened(out)
    w.finalize([])
    w.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl", "out.jsonl.meta.json", "out.jsonl.tmp"]


def test_unwritable_output_is_a_one_line_error(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(PagedrunError) as e:
        opened(tmp_path / "file" / "out.jsonl")  # its "directory" is a file: even root cannot
    assert str(e.value).startswith(f"{tmp_path / 'file' / 'out.jsonl'}: cannot write: ")


def test_a_signal_during_a_write_waits_for_the_whole_line(tmp_path, monkeypatch):
    """The CLI's second Ctrl-C raises KeyboardInterrupt from the handler; it must not land between
    the two halves of a line. Simulate a write that the kernel splits and a SIGINT in between."""
    out = tmp_path / "out.jsonl"
    w = opened(out)
    real_write = os.write
    calls = []

    def split_write(fd, data):
        calls.append(len(data))
        if len(calls) == 1:
            # Aimed at this thread, which blocks it: it waits until the line is whole.
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            return real_write(fd, bytes(data[: len(data) // 2]))
        return real_write(fd, data)

    def handler(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, handler)
    monkeypatch.setattr(outputs.os, "write", split_write)
    try:
        with pytest.raises(KeyboardInterrupt):
            w.write(rec(5))
    finally:
        signal.signal(signal.SIGINT, previous)
        monkeypatch.undo()
    assert len(calls) == 2  # the handler ran only after the second half was written
    assert lines(out) == [rec(5)]
    assert request_key("r5") in w
    w.close()


def test_an_exit_requested_mid_line_waits_for_the_whole_line(tmp_path, monkeypatch):
    """A signal delivered to another thread runs its Python handler in the main thread between two
    bytecodes, possibly between the halves of a split write: the CLI's second-Ctrl-C exit is deferred."""
    out = tmp_path / "out.jsonl"
    w = opened(out)
    real_write = os.write
    events = []

    def split_write(fd, data):
        events.append("write")
        if len(events) == 1:
            outputs.exit_when_line_complete(130, lambda code: events.append(f"exit {code}"))
            return real_write(fd, bytes(data[: len(data) // 2]))
        return real_write(fd, data)

    monkeypatch.setattr(outputs.os, "write", split_write)
    try:
        w.write(rec(6))
    finally:
        monkeypatch.undo()
        outputs._pending_exit = None
    assert events == ["write", "write", "exit 130"]
    assert lines(out) == [rec(6)]
    w.close()


def test_the_writer_keeps_offsets_not_records_and_finalizes_from_a_generator(tmp_path):
    out = tmp_path / "out.jsonl"
    w = opened(out)
    for i in (3, 1, 0, 2):
        w.write(rec(i))
    w.write({"id": "x", "line": 9, "error": "p.jsonl:9: bad"}, invalid_key(9))
    # Where each line is, not the line: three 8-byte columns (input line, offset, length).
    assert all(isinstance(col, array) for col in w.done.values) and len(w.done.values) == 3
    assert set(w.failed) == {invalid_key(9)} and len(w.failed) == 1
    w.finalize(request_key(f"r{i}") for i in range(4))  # read once; the key it does not name goes last
    assert [r["id"] for r in lines(out)] == ["r0", "r1", "r2", "r3", "x"]
    assert lines(out)[:4] == [rec(i) for i in range(4)]
    w.close()
    w2 = OutputWriter(out, FP)  # the index of a resumed file points into it too
    assert set(w2.failed) == {invalid_key(9)} and len(w2.failed) == 1 and len(w2.done) == 5


def test_finalize_orders_by_the_input_line_each_record_answers(tmp_path):
    """No input is read at the end: records written now carry their line, a resume's are located."""
    out = tmp_path / "out.jsonl"
    w = opened(out)
    w.write(rec(5), input_line=9)
    w.write(rec(1), input_line=2)
    w.close()  # interrupted
    w = OutputWriter(out, FP)
    w.locate(request_key("r5"), 9)  # what pass 1 does for the records a previous run left
    w.locate(request_key("r1"), 2)
    w.locate(request_key("nope"), 1)  # not in the file: nothing
    w.open()
    w.write(rec(3), input_line=7)
    w.write(rec(0), invalid_key(1), input_line=1)
    w.write(rec(8))  # no line known: after the others
    w.finalize()
    assert [r["id"] for r in lines(out)] == ["r0", "r1", "r3", "r5", "r8"]
    w.close()


@pytest.mark.parametrize("n", [50, 5000])  # sorted() below 4096 records, the counting sort above
@pytest.mark.parametrize("tie", [False, True])
def test_input_order_by_line_with_unknown_lines_last_and_ties_in_file_order(tmp_path, n, tie):
    import random

    rng = random.Random(n)
    lines_of = list(range(1, n + 1))
    rng.shuffle(lines_of)
    lines_of[::7] = [0] * len(lines_of[::7])  # no line known: after the others, in file order
    if tie:  # two records answering one line (not what a run writes): they keep their file order
        lines_of[3], lines_of[5] = 0, 0
        lines_of[1] = lines_of[2] = n + 5
    w = opened(tmp_path / "out.jsonl")
    for i, line in enumerate(lines_of):
        w.write({"id": f"r{i}", "text": "t"}, input_line=line)
    expected = sorted((i for i in range(n) if lines_of[i]), key=lines_of.__getitem__)
    expected += [i for i in range(n) if not lines_of[i]]
    assert w.input_order() == [request_key(f"r{i}") for i in expected if lines_of[i]]
    w.finalize()
    assert [r["id"] for r in lines(tmp_path / "out.jsonl")] == [f"r{i}" for i in expected]
    w.close()