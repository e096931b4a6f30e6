"""Belady's optimal replacement over a known future (SeqMoE §3.3 fig. 3): the simulator's upper bound on any eviction
policy, with the full future or a window of it (``belady`` / ``belady-K`` in ``core.policies.make_policy``). The
runtime never builds it (it cannot see the future); SeqMoE's probabilistic version over a forecast is
``core.prob_belady``.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import OrderedDict

from .eviction import EvictionPolicy


class Belady(EvictionPolicy):
    """Belady's optimal replacement with a known future (SeqMoE §3.3 fig. 3): evict the resident expert whose next
    use is farthest away. Simulator only: the future comes from a trace.

    Args:
        future: for each tick ``t`` (1-based, one per layer execution, as ``SlotTable`` counts them) the experts
            needed: ``future[t - 1]`` is an iterable of expert ids.
        window: ``None`` for the full future; else only the next ``window`` ticks are visible (Belady-k with
            ``window = k * num_moe_layers`` for k decode steps), and an expert not used within it counts as never.
    Ties (experts never used again within the horizon) are broken by least recent use, then by smaller id.

    Cost: a max-heap keyed by (next use, least recent) with lazy invalidation gives O(log S) per eviction for the
    full oracle; the windowed variant first walks the recency order for an expert beyond the window.
    """

    name = "belady"

    def __init__(self, future: list, window: int | None = None):
        super().__init__()
        self.window = window
        self._uses: dict[int, list[int]] = {}
        for t, needed in enumerate(future, start=1):
            for e in needed:
                self._uses.setdefault(int(e), []).append(t)
        self._tick = 0
        self._seq = 0
        self._next: dict[int, float] = {}
        self._last: dict[int, int] = {}
        self._heap: list[tuple[float, int, int, int]] = []
        self._order: OrderedDict[int, None] = OrderedDict()

    def _next_after(self, eid: int, tick: int) -> float:
        uses = self._uses.get(eid)
        if not uses:
            return math.inf
        i = bisect.bisect_right(uses, tick)
        return uses[i] if i < len(uses) else math.inf

    def on_access(self, eid: int, tick: int, tokens: int = 1) -> None:
        self._tick = tick
        self._seq += 1
        nxt = self._next_after(eid, tick)
        self._next[eid] = nxt
        self._last[eid] = self._seq
        if eid in self.resident:
            heapq.heappush(self._heap, (-nxt, self._seq, -eid, eid))
            if len(self._heap) > 4 * len(self.resident) + 1024:  # drop stale entries now and then
                self._heap = [(-self._next[e], self._last[e], -e, e) for e in self.resident]
                heapq.heapify(self._heap)
        if eid in self._order:
            self._order.move_to_end(eid)

    def on_insert(self, eid: int, tick: int) -> None:
        super().on_insert(eid, tick)
        self._order[eid] = None
        # a prefetch may land an expert never accessed yet (or accessed long ago): its next use is the first one
        # after the current tick (for an on-demand load this equals what on_access just computed)
        self._next[eid] = self._next_after(eid, self._tick)
        self._last.setdefault(eid, self._seq)
        # the entry pushed by on_access may have been dropped as stale while eid was not yet resident
        heapq.heappush(self._heap, (-self._next[eid], self._last[eid], -eid, eid))

    def on_evict(self, eid: int) -> None:
        super().on_evict(eid)
        self._order.pop(eid, None)

    def next_use(self, eid: int) -> float:
        """Ticks until ``eid`` is next needed after the current tick (inf if never / beyond the window)."""
        nxt = self._next_after(eid, self._tick)
        d = nxt - self._tick
        return math.inf if self.window is not None and d > self.window else d

    def victim(self, pinned: set[int]) -> int:
        if self.window is not None:  # beyond the window = never: the least recent such expert
            limit = self._tick + self.window
            for eid in self._order:
                if eid not in pinned and self._next[eid] > limit:
                    return eid
        stash, found = [], None
        while self._heap:
            entry = heapq.heappop(self._heap)
            neg_next, seq, _, eid = entry
            if eid not in self.resident or self._last.get(eid) != seq:
                continue  # stale entry
            stash.append(entry)
            if eid not in pinned:
                found = eid
                break
        for entry in stash:
            heapq.heappush(self._heap, entry)
        if found is None:
            raise RuntimeError("no evictable expert")  # the slot table never asks in that case
        return found

    def reset(self) -> None:
        super().reset()
        self._tick, self._seq = 0, 0
        self._next, self._last, self._heap = {}, {}, []
        self._order.clear()
