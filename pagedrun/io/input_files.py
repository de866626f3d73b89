"""Reading a user's input file (recipe, prompts), whole or line by line, with one-line errors that name it."""
from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

from pagedrun.errors import PagedrunError


def open_input(path: Path, kind: str) -> BinaryIO:
    """`path`, a `kind` ("recipe", "prompts") file, opened for reading bytes; one-line errors."""
    name = path.name
    try:
        return path.open("rb")
    except FileNotFoundError:
        raise PagedrunError(f"{name}: {kind} file not found ({path})") from None
    except IsADirectoryError:
        raise PagedrunError(f"{name}: is a directory, not a {kind} file ({path})") from None
    except OSError as e:
        raise PagedrunError(f"{name}: cannot read {kind} file: {e.strerror}") from None


def read_input(path: Path, kind: str, limit: int | None = None) -> bytes:
    """The bytes of `path`, a `kind` ("recipe", "prompts") file; at most limit + 1 bytes are read
    when a limit is given, so the caller can refuse a larger file without holding it."""
    with open_input(path, kind) as f:
        try:
            return f.read() if limit is None else f.read(limit + 1)
        except OSError as e:  # e.g. EIO, or a directory that open() accepted
            raise PagedrunError(f"{path.name}: cannot read {kind} file: {e.strerror}") from None
