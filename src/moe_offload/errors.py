"""User-facing errors: the CLI prints their message on one line and exits non-zero."""


class MoeOffloadError(Exception):
    """A problem with the user's input or environment, reported as one line without a traceback."""


class NotServedError(MoeOffloadError):
    """The checkpoint's model type is one the engine does not serve (``models.capability``, ``models.registry``): the
    message says why (no experts declared through ExpertsInterface, no text-generation class, an expert parameter
    layout the engine does not know, remote code, ...)."""
