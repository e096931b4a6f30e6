"""The ``moe-offload`` command: one module per command group, each a thin layer that parses, calls the library and
prints. Nothing below this package imports it (the floors, docs/architecture.md).

- ``entry``: the parser of every command, the entry point ``main``, one-line errors;
- ``args``: the parser class, argument types and validators, option groups shared by the commands;
- ``generate``, ``serve``, ``models``, ``export``, ``testbed``, ``trace``, ``simulate``, ``predictor``, ``bench``:
  the command groups.
"""

from .entry import build_parser, main

__all__ = ["build_parser", "main"]
