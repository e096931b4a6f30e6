"""``--model``: a checkpoint directory, the name of a built-in model that is built into the cache on first use, or a
Hugging Face Hub name ``ORG/NAME[@REVISION]`` (``models.hub``) — in that order, so a local directory named like a Hub
name wins."""

from __future__ import annotations

import difflib
from pathlib import Path

from ..errors import MoeOffloadError

BUILTIN_MODELS = ("testbed", "testbed-sparse", "testbed-sparse-wide", "llada2-medium")


def closest_builtin(name: str) -> str | None:
    """The built-in model name closest to ``name`` (``difflib``), or None when none is close."""
    match = difflib.get_close_matches(name, BUILTIN_MODELS, n=1, cutoff=0.6)
    return match[0] if match else None


def resolve_model(name: str | None, progress: bool = True) -> Path:
    """A checkpoint directory for ``--model``: a path, a built-in name (built into the cache on first use), or a Hub
    name ``ORG/NAME[@REVISION]`` (its snapshot in the Hugging Face cache, downloaded when missing: ``hub.snapshot``).

    Raises:
        MoeOffloadError: ``name`` is neither an existing path, a built-in name nor a Hub name (the message names the
            built-in models and, when one is close, suggests it), an existing path that is not a checkpoint directory
            (a GGUF file, another file, a directory without config.json: ``checkpoint.not_a_checkpoint`` says which),
            or a Hub name that cannot be fetched (``hub.snapshot``: malformed, unknown, gated, offline and not cached,
            no safetensors).
    """
    from ..models.checkpoint import not_a_checkpoint

    name = name or "testbed"
    path = Path(name)
    if path.exists():
        if not path.is_dir() or not (path / "config.json").is_file():
            raise MoeOffloadError(not_a_checkpoint(path))
        return path
    if name == "llada2-medium":
        from .llada2_medium import ensure_llada2_medium

        return ensure_llada2_medium(progress=progress)
    if name == "testbed-sparse-wide":
        from .widen import ensure_wide

        return ensure_wide(progress=progress)
    if name in BUILTIN_MODELS:
        from .build import ensure_testbed

        return ensure_testbed(name, progress=progress)
    from ..models.hub import looks_like_hub_name, snapshot

    if looks_like_hub_name(name):
        return snapshot(name, progress=progress)
    close = closest_builtin(name)
    hint = f"did you mean the built-in model {close}? " if close else ""
    raise MoeOffloadError(f"model directory not found: {name}; {hint}(built-in models: {', '.join(BUILTIN_MODELS)}; "
                          "a Hugging Face Hub model: ORG/NAME[@REVISION])")
