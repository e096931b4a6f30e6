"""The eviction-policy interface over the global slot pool (DESIGN.md §5; SeqMoE §3.3): ``EvictionPolicy``.

A policy is pure decision logic: it sees expert ids (ints, ``layer * num_experts + expert``), never tensors,
so the runtime and the trace simulator drive the very same object. The slot table (``core.slots``) tells the
policy what happens; the policy only answers "which resident expert should leave?".

Event order the table guarantees:
  * ``on_step(request, step)`` before each forward pass (step 0 = a request's prefill, i >= 1 = decode step i);
  * ``on_access(eid, tick, tokens)`` for every expert a layer needs, hit or miss, before any load of that layer
    (``tokens``: how many of the layer's tokens selected it), in ascending ``eid`` order; the table makes these
    calls through ``on_layer_access``, which a policy may override to take a layer's accesses at once;
  * ``on_insert(eid, tick)`` when a missed expert lands in a slot;
  * ``on_evict(eid)`` when an expert leaves its slot;
  * ``victim(pinned)`` picks a resident expert not in ``pinned`` (asked only when one exists).

``tick`` is a monotonically non-decreasing access clock (one tick per layer execution).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod


def crf_after_use(key: float, now: float) -> float:
    """LRFU's combined recency-frequency after one more use (Lee et al. 2001), in log form: ``key`` is
    ``log2(CRF(t_last)) + t_last / h`` (``-inf``: never used), ``now`` is ``t / h`` (the use's time over the half-life
    ``h``, ``t >= t_last``); returns ``log2(CRF(t_last) * 2^-((t - t_last) / h) + 1) + t / h``. The decay from a key's
    time to a later one is the same factor for every key, so comparing keys compares the CRFs at any common time, and
    ``key - t / h`` is ``log2(CRF(t))``. Used by ``core.policies.LFRU`` and ``core.prob_belady`` (its layer cycle)."""
    return now if key == -math.inf else now + math.log2(1.0 + 2.0 ** (key - now))


class EvictionPolicy(ABC):
    """Interface of an eviction policy; see the module docstring for the event order.

    The base class keeps ``resident``, the set of experts currently in a slot (maintained by ``on_insert`` and
    ``on_evict``; subclasses that override them call ``super()``).
    """

    name = "base"

    def __init__(self) -> None:
        self.resident: set[int] = set()

    def on_step(self, request: int, step: int) -> None:
        """A forward pass begins: ``step`` 0 is the prefill of ``request``, ``step`` i >= 1 its i-th decode step."""

    def on_access(self, eid: int, tick: int, tokens: int = 1) -> None:
        """Record that expert ``eid`` was required at ``tick`` (hit or miss) by ``tokens`` tokens."""

    def on_layer_access(self, pairs: list[tuple[int, int]], tick: int) -> None:
        """One layer execution's accesses, ``[(eid, tokens)]`` in ascending ``eid`` order: the same as calling
        ``on_access(eid, tick, tokens)`` for each in turn (what this default does; an override must leave the
        policy in the same state)."""
        for e, n in pairs:
            self.on_access(e, tick, n)

    def on_insert(self, eid: int, tick: int) -> None:
        """Record that expert ``eid`` was loaded into a slot at ``tick``."""
        self.resident.add(eid)

    def on_evict(self, eid: int) -> None:
        """Record that expert ``eid`` left its slot."""
        self.resident.discard(eid)

    @abstractmethod
    def victim(self, pinned: set[int]) -> int:
        """Return the resident expert to evict, never one in ``pinned`` (the experts the running layer needs).

        The slot table only asks when a resident, unpinned expert exists."""

    def reset(self) -> None:
        """Forget all history (a new run)."""
        self.resident.clear()
