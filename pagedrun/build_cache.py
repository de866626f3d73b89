"""Housekeeping shared by the two compile caches ($PAGEDRUN_CACHE/cudaemu, $PAGEDRUN_CACHE/cpu_kernels).

Both publish a build by renaming a `<key>.tmp.<pid>` work directory into place; a compile killed
half way leaves that directory behind.
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path


def remove_stale_builds(root: Path, max_age_s: float = 3600.0) -> None:
    """Delete work directories of killed compiles (older than max_age_s, so never a live build's)."""
    now = time.time()
    for p in root.glob("*.tmp.*"):
        try:
            if now - p.stat().st_mtime > max_age_s:
                shutil.rmtree(p, ignore_errors=True)
        except OSError:
            pass
