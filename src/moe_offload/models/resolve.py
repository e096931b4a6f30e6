"""``--model``: a checkpoint directory, or the name of a built-in model that is built into the cache on first use."""

from __future__ import annotations

import difflib
from pathlib import Path

from ..errors import MoeOffloadError

BUILTIN_MODELS = ("testbed", "testbed-sparse", "llada2-medium")


def closest_builtin(name: str) -> str | None:
    """The built-in model name closest to ``name`` (``difflib``), or None when none is close."""
    match = difflib.get_close_matches(name, BUILTIN_MODELS, n=1, cutoff=0.6)
    return match[0] if match else None


def resolve_model(name: str | None, progress: bool = True) -> Path:
    """A checkpoint directory for ``--model``: a path, or a built-in name (built into the cache on first use).

    Raises:
        MoeOffloadError: ``name`` is neither an existing path nor a built-in name (the message names the built-in
            models and, when one is close, suggests it), or an existing path that is not a checkpoint directory (a
            GGUF file, another file, a directory without config.json: ``checkpoint.not_a_checkpoint`` says which).
    """
    from .checkpoint import not_a_checkpoint

    name = name or "testbed"
    path = Path(name)
    if path.exists():
        if not path.is_dir() or not (path / "config.json").is_file():
            raise MoeOffloadError(not_a_checkpoint(path))
        return path
    if name == "llada2-medium":
        from .tiny import ensure_llada2_medium

        return ensure_llada2_medium(progress=progress)
    if name in BUILTIN_MODELS:
        from ..testbed.build import ensure_testbed

        return ensure_testbed(name, progress=progress)
    close = closest_builtin(name)
    hint = f"did you mean the built-in model {close}? " if close else ""
    raise MoeOffloadError(f"model directory not found: {name}; {hint}(built-in models: {', '.join(BUILTIN_MODELS)})")
