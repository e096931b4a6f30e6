"""TIDE's expert activation tracker: per MoE layer, the tokens routed to each expert at every diffusion step of the
current block, and a long-run frequency over blocks (DESIGN.md §5; used by every ``core.refresh`` planner).
"""

from __future__ import annotations

import numpy as np

from ..errors import MoeOffloadError


class ActivationTracker:
    """Per MoE layer: token counts per expert for every diffusion step of the current block (TIDE's "expert
    activation tracker"), plus a long-run frequency over all blocks.

    Args:
        num_layers: MoE layers L.
        num_experts: experts per layer E.
        history_decay: weight of each older in-block step in :meth:`score`'s tie-break term (0..1).
        longrun_decay: per-step decay of the long-run frequency (0..1).
    """

    def __init__(self, num_layers: int, num_experts: int, history_decay: float = 0.5, longrun_decay: float = 0.98):
        self.num_layers = int(num_layers)
        self.num_experts = int(num_experts)
        self.history_decay = float(history_decay)
        self.longrun_decay = float(longrun_decay)
        self._steps: list[list[np.ndarray]] = [[] for _ in range(self.num_layers)]
        self._older = np.zeros((self.num_layers, self.num_experts))  # decayed sum of in-block steps before the last
        self._longrun = np.zeros((self.num_layers, self.num_experts))

    def begin_block(self) -> None:
        """Forget the in-block history (the long-run frequency is kept)."""
        self._steps = [[] for _ in range(self.num_layers)]
        self._older[:] = 0.0

    def observe(self, layer: int, counts) -> np.ndarray:
        """Record one step's counts of ``layer``: int ``[E]``, tokens routed to each expert.

        Returns the counts as an int64 array. Raises MoeOffloadError for a bad layer or shape or negative counts.
        """
        if not 0 <= layer < self.num_layers:
            raise MoeOffloadError(f"layer {layer} out of range [0, {self.num_layers})")
        c = np.asarray(counts)
        if c.shape != (self.num_experts,):
            raise MoeOffloadError(f"counts of layer {layer} must have shape ({self.num_experts},), got {c.shape}")
        c = c.astype(np.int64)
        if c.size and c.min() < 0:
            raise MoeOffloadError("counts must be >= 0")
        hist = self._steps[layer]
        if hist:
            self._older[layer] = self.history_decay * self._older[layer] + hist[-1]
        hist.append(c)
        self._longrun[layer] = self.longrun_decay * self._longrun[layer] + c
        return c

    def history(self, layer: int) -> np.ndarray:
        """This block's counts of ``layer`` so far, int64 ``[steps, E]``."""
        h = self._steps[layer]
        return np.stack(h) if h else np.zeros((0, self.num_experts), dtype=np.int64)

    def last(self, layer: int) -> np.ndarray | None:
        """The most recent step's counts of ``layer`` in this block (None before the first)."""
        h = self._steps[layer]
        return h[-1] if h else None

    def score(self, layer: int) -> np.ndarray:
        """Selection score ``[E]`` (float): the last step's counts; ties broken by the decayed older in-block counts,
        then by the long-run frequency (so a set with room beyond the last step's active experts is filled with
        the next most likely ones). Zero for experts never seen."""
        last = self.last(layer)
        base = last.astype(np.float64) if last is not None else np.zeros(self.num_experts)
        older = self._older[layer]
        lr = self._longrun[layer]
        o = older / (older.max() + 1.0)
        g = lr / (lr.max() + 1.0)
        return base + 1e-3 * o + 1e-6 * g
