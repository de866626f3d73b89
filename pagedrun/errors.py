class PagedrunError(Exception):
    """An error the user can fix; the CLI prints str(err) on one line, no traceback."""
