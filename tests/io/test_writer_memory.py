"""The output writer's index costs a bounded number of bytes per finished request (issue 40): what a
200,000-request job keeps beyond a 10,000-request one, with no Python object per request. tracemalloc counts Python's allocations
exactly, whatever else runs on the machine."""
import gc
import tracemalloc

import pytest

from pagedrun.io.openai_batch import BatchJob
from pagedrun.io.writer import OutputWriter, request_key


@pytest.mark.parametrize("kind", ["jsonl", "batch"])
def test_index_bytes_per_finished_request(tmp_path, kind):
    job = BatchJob("0" * 64, "m", 0)
    n = 40_000

    def request_id(i: int) -> str:  # made as the run makes them: held by nothing but the writer
        return f"req-{i:07d}" if kind == "jsonl" else job.line_id(f"r{i}")

    writer = OutputWriter(tmp_path / "out.jsonl", {"x": 1})
    writer.open()
    try:
        gc.collect()
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            for i in range(n):
                rid = request_id(i)
                writer.write({"id": rid, "text": "t"}, request_key(rid), input_line=i + 1)
            del rid
            gc.collect()
            per_request = (tracemalloc.get_traced_memory()[0] - base) / n
        finally:
            tracemalloc.stop()
        assert request_key(request_id(0)) in writer and len(writer.done) == n
    finally:
        writer.close()
    # io/id_table.py: the 16-byte key, (line, offset, length) at 8 bytes each, a byte of marks and
    # 4-byte index slots at 0.3-0.6 load: 55 measured at 40,000 (52-61 from 40,000 to 100,000). A
    # dict of the keys (a 49-byte bytes object each, ~30 of dict) or any object per record goes past.
    assert per_request <= 70, per_request
