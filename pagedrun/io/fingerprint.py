"""Content hashes of input files: what resume compares to refuse mixing outputs of two prompts files.

Below both cli/app.py and cli/generate.py (and anything else that needs a file's digest), so neither imports
the other for it.
"""
from __future__ import annotations

import hashlib
from pathlib import Path


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):  # 1 MiB at a time: a large file never sits in memory
            h.update(chunk)
    return h.hexdigest()
