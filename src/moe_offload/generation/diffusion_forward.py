"""One diffusion step's forward pass, with or without the block-prefix KV cache (issue 19; the loop is
``generation.diffusion``).

Block-causal attention (``diffusion.block_causal_mask``: a query sees its own block and every earlier block, never
a later one) makes the keys and values of a block depend only on the tokens of that block and of earlier blocks.
Once a block is *committed* (no mask token left) its tokens never change, so its keys and values never change
either: computing them once and keeping them (a **block-prefix KV cache**) gives exactly the keys and values the
reference loop recomputes at every diffusion step.

``StepForward`` runs one step of the current block ``[start, end)``:

* reference (``prefix_cache=False``, the authors' loop): the whole prefix ``[0, end)`` with the block-causal mask;
* block-prefix cache (default): only the positions whose keys and values are not cached yet — the current block,
  plus, at a block's first step, the blocks committed since the last step (at the request's first step, the
  prompt's complete blocks; later, the block committed just before) — attending to the cached keys and values.
  After the forward the cache keeps the positions before ``start`` (committed: final) and forgets the current
  block's (recomputed at the next step, since its tokens change). A committed block is therefore computed exactly
  once, with its final tokens, in the first step of the next block: no extra forward per block, and the last block
  of a request is never cached.

Both give the current block's logits from the same keys and values; only the amount of recomputation differs
(tokens per forward: about ``block_length`` with the cache, the whole prefix without).
"""

from __future__ import annotations

import inspect

import torch

from ..errors import MoeOffloadError


class BlockPrefixCache:
    """Keys and values of the committed prefix, one preallocated buffer per attention layer.

    The model's attention layers call ``update(k, v, layer_idx)`` with the new positions' keys/values ``[B, H_kv, Q,
    D]``; they are written after the cached ``length`` positions and the layer attends to ``[0, length + Q)``
    (a view). ``keep(n)`` then makes the first ``n`` of those new positions part of the cached prefix; the others
    are overwritten by the next forward. Implements the two methods of transformers' ``Cache`` the LLaDA2 model
    uses (``update``, ``get_seq_length``).

    Args:
        capacity: positions the buffers hold (the request's padded length).
    """

    def __init__(self, capacity: int):
        self.capacity = int(capacity)
        self.length = 0           # cached (committed) positions
        self._new = 0             # positions written by the current forward
        self._k: list[torch.Tensor] = []
        self._v: list[torch.Tensor] = []

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Cached positions (the forward's position offset)."""
        return self.length

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               cache_kwargs: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``key_states``/``value_states [B, H_kv, Q, D]`` of layer ``layer_idx`` after the cached prefix and
        return the layer's keys/values ``[B, H_kv, length + Q, D]`` (views of the buffers).

        Raises:
            MoeOffloadError: more positions than ``capacity``, or layers not called in order on first use.
        """
        q = key_states.shape[-2]
        end = self.length + q
        if end > self.capacity:
            raise MoeOffloadError(f"block-prefix cache: {end} positions exceed its capacity {self.capacity}")
        if layer_idx == len(self._k):
            b, h, _, d = key_states.shape
            self._k.append(key_states.new_empty((b, h, self.capacity, d)))
            self._v.append(value_states.new_empty((b, h, self.capacity, value_states.shape[-1])))
        elif layer_idx > len(self._k):
            raise MoeOffloadError(f"block-prefix cache: layer {layer_idx} before layer {len(self._k)}")
        k, v = self._k[layer_idx], self._v[layer_idx]
        k[:, :, self.length:end] = key_states
        v[:, :, self.length:end] = value_states
        self._new = q
        return k[:, :, :end], v[:, :, :end]

    def keep(self, n: int) -> None:
        """The first ``n`` positions of the last forward become part of the cached prefix (``0 <= n <= Q``).

        Raises:
            MoeOffloadError: ``n`` outside ``[0, Q]``.
        """
        if not 0 <= n <= self._new:
            raise MoeOffloadError(f"block-prefix cache: cannot keep {n} of the forward's {self._new} positions")
        self.length += n
        self._new = 0


class StepForward:
    """The forward of every diffusion step of one request (module docstring).

    Args:
        model: the diffusion LM; its forward takes ``input_ids [1, Q]``, ``attention_mask [1, 1, Q, K]`` bool (True =
            may attend), ``position_ids [1, Q]``, ``use_cache`` and, with the cache, ``past_key_values`` (an object
            with ``update``/``get_seq_length``) and returns ``logits [1, Q', V]``; ``logits_to_keep`` is passed when
            its forward takes it.
        total: positions of the request's sequence (a multiple of ``block_length``).
        block_length: positions per block.
        mask: bool ``[total, total]`` block-causal mask (``diffusion.block_causal_mask``).
        prefix_cache: use the block-prefix KV cache (default True) or recompute the prefix at every step.

    Raises:
        MoeOffloadError: ``prefix_cache`` for a model whose forward takes no ``past_key_values``.
    """

    def __init__(self, model, total: int, block_length: int, mask: torch.Tensor, prefix_cache: bool = True):
        params = inspect.signature(model.forward).parameters
        if prefix_cache and "past_key_values" not in params:
            raise MoeOffloadError(f"{type(model).__name__} takes no past_key_values: run it without the prefix cache "
                                  "(--no-prefix-cache)")
        self.model, self.block_length, self.mask = model, int(block_length), mask
        self.positions = torch.arange(total, device=mask.device)[None]
        self.cache = BlockPrefixCache(total) if prefix_cache else None
        self.keep = {"logits_to_keep": self.block_length} if "logits_to_keep" in params else {}
        self.tokens = 0  # tokens of the last forward

    def __call__(self, x: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Logits ``[block_length, V]`` of the current block ``[start, end)`` of ``x [1, total]`` int64 (the
        sequence with the block's current tokens); ``end - start == block_length``."""
        lo = 0 if self.cache is None else self.cache.length
        kw = {"use_cache": False} if self.cache is None else {"use_cache": True, "past_key_values": self.cache}
        out = self.model(input_ids=x[:, lo:end], attention_mask=self.mask[None, None, lo:end, :end],
                         position_ids=self.positions[:, lo:end], **kw, **self.keep)
        if self.cache is not None:
            self.cache.keep(start - lo)  # committed positions before the block: final, cached from now on
        self.tokens = end - lo
        return out.logits[0, -self.block_length:]
