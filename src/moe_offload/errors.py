"""User-facing errors: the CLI prints their message on one line and exits non-zero."""


class MoeOffloadError(Exception):
    """A problem with the user's input or environment, reported as one line without a traceback."""
