"""Result tables on the terminal: where they go and how wide they may be.

Results (the bench comparison, the memory profile) go to stdout, so they can be piped and saved;
progress, spinners and errors stay on stderr. Every table fits 80 columns without cutting a cell:
numbers never wrap (a cut number reads as another number), headers are short or on two lines, and
a table that would need more columns is stacked into two (docs/architecture.md, house rules).
"""
from __future__ import annotations

from rich.console import Console

WIDTH = 80  # the narrowest terminal the tables are designed for (tests/test_tables.py renders at it)


def results_console(console: Console) -> Console:
    """Where results go: stdout when `console` is the CLI's stderr console; otherwise `console`
    itself (a caller that captures the output, such as a test, gets everything in one place)."""
    return Console(highlight=False) if console.stderr else console
