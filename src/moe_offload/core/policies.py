"""Eviction policies over the global slot pool (DESIGN.md §5; SeqMoE §3.3).

A policy is pure decision logic: it sees expert ids (ints, ``layer * num_experts + expert``), never tensors,
so the runtime and the trace simulator drive the very same object. The slot table (``core.slots``) tells the
policy what happens; the policy only answers "which resident expert should leave?".

Event order the table guarantees:
  * ``on_access(eid, tick)`` for every expert a layer needs, hit or miss, before any load of that layer;
  * ``on_insert(eid, tick)`` when a missed expert lands in a slot;
  * ``on_evict(eid)`` when an expert leaves its slot;
  * ``victim(candidates)`` picks one of ``candidates`` (resident, evictable expert ids, never empty).

``tick`` is a monotonically non-decreasing access clock (one tick per layer execution).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Iterable

from ..errors import MoeOffloadError


class EvictionPolicy(ABC):
    """Interface of an eviction policy; see the module docstring for the event order."""

    name = "base"

    def on_access(self, eid: int, tick: int) -> None:
        """Record that expert ``eid`` was required at ``tick`` (hit or miss)."""

    def on_insert(self, eid: int, tick: int) -> None:
        """Record that expert ``eid`` was loaded into a slot at ``tick``."""

    def on_evict(self, eid: int) -> None:
        """Record that expert ``eid`` left its slot."""

    @abstractmethod
    def victim(self, candidates: Iterable[int]) -> int:
        """Return the expert id among ``candidates`` (non-empty, resident, evictable) to evict."""

    def reset(self) -> None:
        """Forget all history (a new run)."""


class LRU(EvictionPolicy):
    """Least recently used: evict the resident expert whose last access is oldest.

    Keeps an ordered dict of resident experts in recency order, so ``victim`` is O(candidates) in the worst
    case but O(1) when the oldest resident expert is evictable (the common case).
    """

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()

    def on_access(self, eid: int, tick: int) -> None:
        if eid in self._order:
            self._order.move_to_end(eid)

    def on_insert(self, eid: int, tick: int) -> None:
        self._order[eid] = None
        self._order.move_to_end(eid)

    def on_evict(self, eid: int) -> None:
        self._order.pop(eid, None)

    def victim(self, candidates: Iterable[int]) -> int:
        cand = candidates if isinstance(candidates, (set, frozenset)) else set(candidates)
        for eid in self._order:
            if eid in cand:
                return eid
        return min(cand)  # candidates the policy never saw inserted (should not happen): deterministic

    def reset(self) -> None:
        self._order.clear()


class LFU(EvictionPolicy):
    """Least frequently used: evict the resident expert with the fewest accesses since the run started.

    Frequencies persist across evictions (an expert's history is kept when it leaves the pool). Ties are
    broken by least recent access, then by the smaller expert id, so the result is deterministic.
    """

    name = "lfu"

    def __init__(self) -> None:
        self._freq: dict[int, int] = {}
        self._last: dict[int, int] = {}
        self._seq = 0

    def on_access(self, eid: int, tick: int) -> None:
        self._freq[eid] = self._freq.get(eid, 0) + 1
        self._seq += 1
        self._last[eid] = self._seq

    def victim(self, candidates: Iterable[int]) -> int:
        return min(candidates, key=lambda e: (self._freq.get(e, 0), self._last.get(e, 0), e))

    def reset(self) -> None:
        self._freq.clear()
        self._last.clear()
        self._seq = 0


POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRU, "lfu": LFU}


def make_policy(name: str) -> EvictionPolicy:
    """Build an eviction policy by name.

    Raises:
        MoeOffloadError: unknown policy name (the message lists the known ones).
    """
    try:
        return POLICIES[name.lower()]()
    except KeyError:
        raise MoeOffloadError(f"unknown policy {name!r}; choose one of: {', '.join(sorted(POLICIES))}") from None
