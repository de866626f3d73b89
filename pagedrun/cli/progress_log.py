"""Progress for a job nobody watches: timestamped lines at an interval when stderr is not a terminal.

Under Slurm or Kubernetes stderr is a file. rich's progress bar draws nothing there until the job
ends, so a log would show the start-up lines and then hours of silence. When the console is not a
terminal, the job writes instead one plain line every `interval_s` seconds (and one when the run
starts and ends), each stamped with UTC time, the way a log collector expects:

    2026-11-28T01:45:00Z generating: 1,234/10,000 completions (12.3%), 456.7 tok/s, 2m03s, eta 14m40s

On a terminal the bar does the job and nothing is logged; `--log-interval 0` turns the lines off.
"""
from __future__ import annotations

import time
from datetime import datetime, timezone

DEFAULT_INTERVAL_S = 30.0


def timestamp(now: float | None = None) -> str:
    """UTC time to the second, ISO 8601 with a Z."""
    moment = datetime.fromtimestamp(time.time() if now is None else now, tz=timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


class ProgressLog:
    """`tick(done, total, tok_per_s)` after each finished request; a line when the interval is up."""

    def __init__(self, console, interval_s: float, *, enabled: bool, clock=time.monotonic) -> None:
        self.console = console
        self.interval_s = interval_s
        self.enabled = enabled and interval_s > 0
        self.clock = clock
        self.t0 = clock()
        self.next_at = self.t0 + interval_s

    @classmethod
    def for_console(cls, console, interval_s: float | None, quiet: bool) -> ProgressLog:
        """On when the console is not a terminal (unless quiet or interval 0); None: the default."""
        interval = DEFAULT_INTERVAL_S if interval_s is None else interval_s
        return cls(console, interval, enabled=not quiet and not console.is_terminal)

    def line(self, text: str) -> None:
        if self.enabled:
            self.console.print(f"{timestamp()} {text}", highlight=False, markup=False, soft_wrap=True)

    def tick(self, done: int, total: int, tok_per_s: float) -> None:
        if not self.enabled:
            return
        now = self.clock()
        if now < self.next_at:
            return
        self.next_at = now + self.interval_s
        self.line(self.status(done, total, tok_per_s, now - self.t0))

    @staticmethod
    def status(done: int, total: int, tok_per_s: float, elapsed: float) -> str:
        share = f" ({100 * done / total:.1f}%)" if total else ""
        eta = f", eta {_duration(elapsed * (total - done) / done)}" if 0 < done < total else ""
        return (f"generating: {done:,}/{total:,} completions{share}, {tok_per_s:,.1f} tok/s, "
                f"{_duration(elapsed)}{eta}")
