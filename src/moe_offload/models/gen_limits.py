"""Where generation stops, resolved once per loaded model and shared by every generation loop (FullLoad and
offloaded, batch 1, continuous batching, the server's workers, graph mode, block diffusion):

- **EOS ids** (``eos_token_ids``): the generation config's ``eos_token_id`` (an int or a list; read from the
  checkpoint's ``generation_config.json`` exactly as transformers' ``from_pretrained`` reads it, else derived from
  ``config.json``; ``load_generation_config``), else the model config's, plus the tokenizer's ``eos_token_id``;
- **position limit** (``position_limit``): the text config's ``max_position_embeddings``; a request uses at most
  that many positions (prompt + new tokens, as the server's ``max_context``), so generation stops there with
  finish reason "length" (``new_token_budget``).
"""

from __future__ import annotations

from pathlib import Path

from ..errors import MoeOffloadError


def load_generation_config(path: str | Path, config=None):
    """The ``transformers.GenerationConfig`` that ``from_pretrained(path)`` gives a model: ``generation_config.json``
    when the checkpoint has one, else one derived from ``config.json`` (transformers'
    ``GenerationMixin.adjust_generation_fn``). Reads one small JSON file; no network (``path`` is a directory).

    Args:
        path: the checkpoint directory.
        config: the model's ``PretrainedConfig``: the fallback (``GenerationConfig.from_model_config``) when neither
            file gives a generation config.
    Returns:
        A ``GenerationConfig``, or None when none can be made (no file and no ``config``).
    Raises:
        MoeOffloadError: ``generation_config.json`` exists but is not a valid generation config.
    """
    from transformers import GenerationConfig

    path = Path(path)
    if (path / "generation_config.json").exists():
        try:
            return GenerationConfig.from_pretrained(path)
        except Exception as e:  # noqa: BLE001 - a broken file: one line, not a traceback
            why = (str(e).strip().splitlines() or [""])[0][:200]
            raise MoeOffloadError(f"cannot read {path / 'generation_config.json'}: {type(e).__name__}: {why}") from None
    try:
        return GenerationConfig.from_pretrained(path, config_file_name="config.json", _from_model_config=True)
    except Exception:  # noqa: BLE001 - e.g. a config.json transformers cannot read as a generation config
        return GenerationConfig.from_model_config(config) if config is not None else None


def _as_ids(value) -> list[int]:
    """An ``eos_token_id`` value (None, an int, or a list / tuple of ints) as a list of non-negative ints."""
    if value is None:
        return []
    values = value if isinstance(value, (list, tuple)) else [value]
    return [int(v) for v in values if v is not None and int(v) >= 0]


def eos_token_ids(generation_config, config, tokenizer) -> frozenset[int]:
    """The token ids that end a generation: the generation config's ``eos_token_id`` (int or list) when it names
    any, else the model config's (its text config's for a composite model), plus the tokenizer's
    ``eos_token_id``. Any argument may be None.

    Returns:
        A frozenset of token ids (possibly empty: the model then stops only at ``max_new_tokens`` / its limit).
    """
    from .capability import text_config

    ids = _as_ids(getattr(generation_config, "eos_token_id", None))
    if not ids and config is not None:
        ids = _as_ids(getattr(config, "eos_token_id", None)) or _as_ids(
            getattr(text_config(config), "eos_token_id", None))
    if tokenizer is not None:
        ids += _as_ids(getattr(tokenizer, "eos_token_id", None))
    return frozenset(ids)


def position_limit(config) -> int | None:
    """Most positions one sequence may use: the text config's ``max_position_embeddings`` (None when it has
    none)."""
    from .capability import text_config

    limit = getattr(text_config(config), "max_position_embeddings", None)
    if limit is None:
        limit = getattr(config, "max_position_embeddings", None)
    return int(limit) if isinstance(limit, int) and limit > 0 else None


def new_token_budget(limit: int | None, prompt_len: int, max_new_tokens: int, block_length: int = 1) -> int:
    """How many new tokens a request may generate: ``max_new_tokens``, cut so the positions it uses (prompt + new
    tokens; for block diffusion, whole blocks of ``block_length`` positions aligned at 0) stay within ``limit``.

    Args:
        limit: the model's position limit (``position_limit``; None: no limit).
        prompt_len: prompt tokens (>= 1). max_new_tokens: tokens asked for (>= 1).
        block_length: 1 for autoregressive models; the diffusion block length.
    Returns:
        ``min(max_new_tokens, room)`` (>= 1).
    Raises:
        MoeOffloadError: the prompt leaves no room for one new token within the limit.
    """
    if limit is None:
        return max_new_tokens
    usable = limit // block_length * block_length
    room = usable - prompt_len
    if room < 1:
        blocks = f" (whole blocks of {block_length}: {usable} positions)" if block_length > 1 else ""
        raise MoeOffloadError(f"the prompt has {prompt_len} tokens: no room for a new token within the model's "
                              f"position limit of {limit} (max_position_embeddings){blocks}; shorten the prompt")
    return min(max_new_tokens, room)
