"""The KV cache of a decode batch: transformers' ``DynamicCache`` with its rows left-padded to one length.

Sequences are prefilled into a cache of their own (one alone: exactly ``generate``'s prefill; several together:
left-padded to one length, padding columns zeroed); ``merge`` adds its rows to the batch cache, left-padding
whichever side is shorter with zeros; ``select`` keeps
some rows (a finished or cancelled sequence leaves: its KV cache is freed) and trims the leading columns that are
padding in every row left. ``pads[b]`` counts row b's padding columns; they are masked out of attention by the
2D attention mask (``attention_mask``), and row b's next position is ``length - pads[b]``.

Only caches whose layers are all plain ``DynamicLayer`` (full attention, ``[B, heads, S, head_dim]``) are batched:
sliding-window, linear-attention and recurrent layers keep state that left padding would corrupt
(``unsupported_reason``).
"""

from __future__ import annotations

import torch

try:
    from transformers.cache_utils import DynamicCache, DynamicLayer
except ImportError:  # pragma: no cover - transformers without the layered cache
    DynamicCache = DynamicLayer = None


def unsupported_reason(cache) -> str | None:
    """Why ``cache`` (a model's cache object after a prefill) cannot be a batch cache, or None when it can."""
    if DynamicCache is None or not isinstance(cache, DynamicCache):
        return f"its cache is a {type(cache).__name__}, not a DynamicCache"
    kinds = {type(layer).__name__ for layer in cache.layers if type(layer) is not DynamicLayer}
    if kinds:
        return f"its cache has {', '.join(sorted(kinds))} layers (only full-attention DynamicLayer rows can be padded)"
    return None


def _pad_left(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t [B, h, S, d]`` with ``n`` zero columns prepended along S."""
    if n == 0:
        return t
    return torch.cat([t.new_zeros(*t.shape[:-2], n, t.shape[-1]), t], dim=-2)


class BatchCache:
    """A DynamicCache holding several sequences' KV rows, left-padded to one length.

    Attributes:
        cache: the ``DynamicCache`` passed to the model (None while empty).
        pads: leading padding columns of each row.
    """

    def __init__(self):
        self.cache = None
        self.pads: list[int] = []

    @property
    def rows(self) -> int:
        """Sequences in the cache."""
        return len(self.pads)

    @property
    def length(self) -> int:
        """Columns of every row (padding included)."""
        return self.cache.get_seq_length() if self.cache is not None else 0

    def nbytes(self) -> int:
        """Bytes of the cache's key and value tensors."""
        if self.cache is None:
            return 0
        return sum(t.numel() * t.element_size() for layer in self.cache.layers for t in (layer.keys, layer.values))

    def merge(self, new, pads: list[int] | None = None) -> None:
        """Append the rows of ``new`` (a prefill's ``DynamicCache``: one sequence, or several left-padded to one
        length, whose padding columns are zeros) as the last rows.

        Args:
            new: the cache (``[P, heads, S, head_dim]`` per layer).
            pads: leading padding columns of each of its P rows (None: no padding).
        Raises:
            ValueError: ``new`` is not a cache of plain ``DynamicLayer`` layers, or ``pads`` has not one entry per
                row.
        """
        why = unsupported_reason(new)
        if why is not None:
            raise ValueError(why)
        rows = new.layers[0].keys.shape[0]
        pads = [0] * rows if pads is None else list(pads)
        if len(pads) != rows:
            raise ValueError(f"{len(pads)} padding counts for a cache of {rows} rows")
        s = new.get_seq_length()
        if self.cache is None:
            self.cache, self.pads = new, pads
            return
        big = self.length
        width = max(big, s)
        for mine, add in zip(self.cache.layers, new.layers):
            mine.keys = torch.cat([_pad_left(mine.keys, width - big), _pad_left(add.keys, width - s)], dim=0)
            mine.values = torch.cat([_pad_left(mine.values, width - big), _pad_left(add.values, width - s)], dim=0)
        self.pads = [p + width - big for p in self.pads] + [p + width - s for p in pads]

    def select(self, keep: list[int]) -> None:
        """Keep rows ``keep`` (in that order) and drop the columns that are padding in all of them; an empty
        ``keep`` frees the cache."""
        if not keep:
            self.cache, self.pads = None, []
            return
        if keep == list(range(self.rows)):
            return
        cut = min(self.pads[b] for b in keep)
        idx = torch.tensor(keep, dtype=torch.long, device=self.cache.layers[0].keys.device)
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(0, idx)[..., cut:, :].contiguous()
            layer.values = layer.values.index_select(0, idx)[..., cut:, :].contiguous()
        self.pads = [self.pads[b] - cut for b in keep]

    def attention_mask(self, device: torch.device) -> torch.Tensor | None:
        """``[B, length + 1]`` int64 mask for a decode step (0 on padding columns), or None when no row is padded
        (the model then builds its plain causal mask, as in batch-1 ``generate``)."""
        if not any(self.pads):
            return None
        cols = torch.arange(self.length + 1, device=device)
        return (cols.unsqueeze(0) >= torch.tensor(self.pads, device=device).unsqueeze(1)).long()

    def positions(self, device: torch.device) -> torch.Tensor:
        """``[B, 1]`` int64: each row's position for the next token (its tokens in the cache, padding excluded)."""
        n = self.length
        return torch.tensor([[n - p] for p in self.pads], dtype=torch.long, device=device)
