"""Prefill offloading (SeqMoE §8.4): the order in which a prefill prefetches experts, from an offline popularity
profile. Pure decision logic (global expert ids), shared by the runtime prefetcher and the simulator."""

from __future__ import annotations

import numpy as np

from ..errors import MoeOffloadError


class PrefillPrefetch:
    """Prefill offloading (SeqMoE §8.4): during a prefill, prefetch the most popular experts of the layers still to
    come, popularity being expert activation frequencies profiled offline over a dataset.

    With many prompt tokens routed at once, a prefill layer needs most of its experts and the forecast of one
    decode step says little; the paper therefore orders prefill prefetches by offline popularity: "before prefill
    and after each layer" the next layers' high-frequency experts are prefetched, keeping ``num_slots - e`` slots in
    Fetch at most (the caller passes ``reserve=e`` to ``SlotTable.prefetch``) so ``e`` slots stay free for misses.

    Args:
        popularity: ``[L, E]`` non-negative counts or frequencies (any float/int array-like); row ``p`` is MoE
            layer ``p``. Experts with popularity 0 are never prefetched.
        num_moe_layers, num_experts: L and E (the shape is checked against them).
    Raises:
        MoeOffloadError: wrong shape, negative or non-finite entries.
    """

    def __init__(self, popularity, num_moe_layers: int, num_experts: int):
        pop = np.asarray(popularity, dtype=np.float64)
        if pop.shape != (num_moe_layers, num_experts):
            raise MoeOffloadError(f"prefill popularity must have shape [{num_moe_layers}, {num_experts}], "
                                  f"got {list(pop.shape)}")
        if not np.isfinite(pop).all() or (pop < 0).any():
            raise MoeOffloadError("prefill popularity must be finite and non-negative")
        self.num_moe_layers, self.num_experts = num_moe_layers, num_experts
        # per layer: global expert ids by descending popularity (ties: lower expert id first)
        self.order = [[p * num_experts + int(e) for e in np.argsort(-pop[p], kind="stable") if pop[p, e] > 0]
                      for p in range(num_moe_layers)]

    def candidates(self, after_layer: int):
        """Yield global expert ids to prefetch once MoE layer ``after_layer`` has run (-1: before the prefill):
        layer ``after_layer + 1``'s experts by popularity, then the next layer's, and so on to the last layer."""
        for p in range(max(0, after_layer + 1), self.num_moe_layers):
            yield from self.order[p]
