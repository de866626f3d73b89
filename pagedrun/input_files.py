"""Reading a user's input file (recipe, prompts) whole, with one-line errors that name it."""
from __future__ import annotations

from pathlib import Path

from pagedrun.errors import PagedrunError


def read_input(path: Path, kind: str, limit: int | None = None) -> bytes:
    """The bytes of `path`, a `kind` ("recipe", "prompts") file; at most limit + 1 bytes are read
    when a limit is given, so the caller can refuse a larger file without holding it."""
    name = path.name
    try:
        with path.open("rb") as f:
            return f.read() if limit is None else f.read(limit + 1)
    except FileNotFoundError:
        raise PagedrunError(f"{name}: {kind} file not found ({path})") from None
    except IsADirectoryError:
        raise PagedrunError(f"{name}: is a directory, not a {kind} file ({path})") from None
    except OSError as e:
        raise PagedrunError(f"{name}: cannot read {kind} file: {e.strerror}") from None
