"""docs/design/architecture.md answers "where is X?": every module of pagedrun/ has its line there.

A module counts as named when its path appears in backquotes, whole (`worker/memory.py`) or
below its top-level package's heading (`cuda/kernels.py` under `attention/`). A new module
without a line fails here, in the same commit that adds it.
"""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "design" / "architecture.md"


def unnamed_modules(page: str) -> list[str]:
    missing = []
    for path in sorted((ROOT / "pagedrun").rglob("*.py")):
        rel = path.relative_to(ROOT / "pagedrun")
        parts = rel.parts
        if rel.name == "__init__.py" and len(parts) > 2:
            continue  # a subpackage's face (attention/cuda/__init__.py): its modules have the lines
        if rel.name == "__init__.py" and len(parts) == 2 and f"`{parts[0]}/`" in page:
            continue  # a package's face: the package's heading is its line
        suffixes = ["/".join(parts[i:]) for i in range(len(parts))]
        top_ok = len(parts) == 1 or f"`{parts[0]}/`" in page
        if not (top_ok and any(f"`{s}`" in page for s in suffixes)):
            missing.append(str(rel))
    return missing


def test_every_module_has_its_line():
    missing = unnamed_modules(PAGE.read_text())
    assert not missing, "modules without a line in docs/design/architecture.md:\n" + "\n".join(missing)


def test_the_check_sees_a_missing_module():
    page = PAGE.read_text()
    assert "engine/occupancy.py" not in unnamed_modules(page)
    assert "engine/occupancy.py" in unnamed_modules(page.replace("`occupancy.py`", "`occupancy`"))
