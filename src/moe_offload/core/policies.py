"""Eviction policies over the global slot pool (DESIGN.md §5; SeqMoE §3.3).

A policy is pure decision logic: it sees expert ids (ints, ``layer * num_experts + expert``), never tensors,
so the runtime and the trace simulator drive the very same object. The slot table (``core.slots``) tells the
policy what happens; the policy only answers "which resident expert should leave?".

Event order the table guarantees:
  * ``on_step(request, step)`` before each forward pass (step 0 = a request's prefill, i >= 1 = decode step i);
  * ``on_access(eid, tick, tokens)`` for every expert a layer needs, hit or miss, before any load of that layer
    (``tokens``: how many of the layer's tokens selected it);
  * ``on_insert(eid, tick)`` when a missed expert lands in a slot;
  * ``on_evict(eid)`` when an expert leaves its slot;
  * ``victim(pinned)`` picks a resident expert not in ``pinned`` (asked only when one exists).

``tick`` is a monotonically non-decreasing access clock (one tick per layer execution).
"""

from __future__ import annotations

import bisect
import heapq
import math
import re
from abc import ABC, abstractmethod
from collections import OrderedDict
from ..errors import MoeOffloadError


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


class LRU(EvictionPolicy):
    """Least recently used: evict the resident expert whose last access is oldest.

    Keeps resident experts in an ordered dict in recency order; ``victim`` walks it from the oldest and skips
    pinned experts, so it costs O(1 + pinned) per eviction.
    """

    name = "lru"

    def __init__(self) -> None:
        super().__init__()
        self._order: OrderedDict[int, None] = OrderedDict()

    def on_access(self, eid: int, tick: int, tokens: int = 1) -> None:
        if eid in self._order:
            self._order.move_to_end(eid)

    def on_insert(self, eid: int, tick: int) -> None:
        super().on_insert(eid, tick)
        self._order[eid] = None

    def on_evict(self, eid: int) -> None:
        super().on_evict(eid)
        self._order.pop(eid, None)

    def victim(self, pinned: set[int]) -> int:
        return self._oldest(lambda e: e not in pinned)

    def _oldest(self, ok) -> int:
        for eid in self._order:
            if ok(eid):
                return eid
        raise RuntimeError("no evictable expert")  # the slot table never asks in that case

    def reset(self) -> None:
        super().reset()
        self._order.clear()


class _MinKeyHeap(EvictionPolicy):
    """Victim selection for policies that evict the resident expert with the smallest key, where an expert's key
    only grows (on its accesses): a min-heap of ``key(e)`` tuples (the expert id last) with lazy invalidation. An
    entry is current while its expert is resident and its tuple equals ``key(e)``; every resident expert has a
    current entry (pushed at insert and at each access while resident). ``victim`` drops stale entries from the top,
    sets aside pinned ones and answers the smallest current unpinned entry, the same expert as
    ``min(resident - pinned, key=key)``, in O((pinned + stale) log n) instead of O(resident). The heap is rebuilt
    when stale entries outnumber the resident ones a few times over."""

    def __init__(self) -> None:
        super().__init__()
        self._heap: list[tuple] = []

    @abstractmethod
    def key(self, eid: int) -> tuple:
        """The eviction key of ``eid`` now (smallest is evicted), ending with ``eid``."""

    def _push(self, eid: int) -> None:
        heapq.heappush(self._heap, self.key(eid))
        if len(self._heap) > 4 * len(self.resident) + 64:
            self._heap = [self.key(e) for e in self.resident]
            heapq.heapify(self._heap)

    def on_insert(self, eid: int, tick: int) -> None:
        super().on_insert(eid, tick)
        self._push(eid)

    def victim(self, pinned: set[int]) -> int:
        heap, held = self._heap, []
        try:
            while heap:
                top = heap[0]
                eid = top[-1]
                if eid not in self.resident or top != self.key(eid):
                    heapq.heappop(heap)
                elif eid in pinned:
                    held.append(heapq.heappop(heap))
                else:
                    return eid  # stays in the heap: on_evict makes it stale
        finally:
            for entry in held:
                heapq.heappush(heap, entry)
        raise RuntimeError("no evictable expert")  # the slot table never asks in that case

    def reset(self) -> None:
        super().reset()
        self._heap.clear()


class LFU(_MinKeyHeap):
    """Least frequently used: evict the resident expert with the fewest accesses since the run started.

    Frequencies persist across evictions (an expert's history is kept when it leaves the pool). Ties are
    broken by least recent access, then by the smaller expert id, so the result is deterministic.
    """

    name = "lfu"

    def __init__(self) -> None:
        super().__init__()
        self._freq: dict[int, int] = {}
        self._last: dict[int, int] = {}
        self._seq = 0

    def key(self, eid: int) -> tuple:
        return self._freq.get(eid, 0), self._last.get(eid, 0), eid

    def on_access(self, eid: int, tick: int, tokens: int = 1) -> None:
        self._freq[eid] = self._freq.get(eid, 0) + 1
        self._seq += 1
        self._last[eid] = self._seq
        if eid in self.resident:
            self._push(eid)

    def reset(self) -> None:
        super().reset()
        self._freq.clear()
        self._last.clear()
        self._seq = 0


class LFRU(_MinKeyHeap):
    """Frequency-recency hybrid (LRFU, Lee et al. 2001; the family of vLLM's expert-cache LFRU): each expert's
    combined recency-frequency score is ``CRF(t) = sum_i 2^(-(t - t_i) / h)`` over its accesses ``t_i`` (ticks);
    evict the resident expert with the smallest score now. ``h -> 0`` is LRU; ``h -> inf`` ranks by access count
    like LFU (equal counts then by the total age of the accesses).

    Args:
        half_life_ticks: ``h`` in ticks (one tick per MoE layer execution; ``make_policy`` sets it from decode steps
            x MoE layers), > 0.

    Scores are kept in log space, ``key = log2(CRF(t_last)) + t_last / h``: the decay from ``t_last`` to now is the
    same factor for every expert, so comparing keys compares scores now; history persists across evictions. Ties:
    least recent access, then the smaller expert id. A key only grows with accesses (``_MinKeyHeap``).
    """

    name = "lfru"

    def __init__(self, half_life_ticks: float):
        super().__init__()
        if not half_life_ticks > 0:
            raise MoeOffloadError(f"LFRU half-life must be > 0 ticks, got {half_life_ticks}")
        self.h = float(half_life_ticks)
        self._key: dict[int, float] = {}
        self._last: dict[int, int] = {}
        self._seq = 0

    def key(self, eid: int) -> tuple:
        return self._key.get(eid, -math.inf), self._last.get(eid, 0), eid

    def on_access(self, eid: int, tick: int, tokens: int = 1) -> None:
        now = tick / self.h
        old = self._key.get(eid)  # log2(CRF(t_last)) + t_last/h  ->  log2(CRF(t) + 1) + t/h
        self._key[eid] = now if old is None else now + math.log2(1.0 + 2.0 ** (old - now))
        self._seq += 1
        self._last[eid] = self._seq
        if eid in self.resident:
            self._push(eid)

    def reset(self) -> None:
        super().reset()
        self._key.clear()
        self._last.clear()
        self._seq = 0


class PrefillHot(LRU):
    """KTransformers-style hot set: the experts most activated (by tokens) in a request's prefill are pinned for
    its decode; the remaining slots are managed by LRU.

    At a request's first decode step the ``hot_slots`` experts with the most prefill token activations become hot
    (ties: smaller expert id). A hot expert is only evicted when every evictable resident expert is hot. Default
    ``hot_slots = num_slots - top_k`` leaves one decode layer's worth of slots for misses. The resident experts
    that are not hot are also kept apart in recency order (``_cold``), so ``victim`` walks only those.
    """

    name = "prefill-hot"

    def __init__(self, hot_slots: int):
        super().__init__()
        self.hot_slots = max(0, hot_slots)
        self._counts: dict[int, int] = {}
        self._in_prefill = False
        self.hot: frozenset[int] = frozenset()
        self._cold: OrderedDict[int, None] = OrderedDict()

    def on_step(self, request: int, step: int) -> None:
        if step == 0:
            self._in_prefill = True
            self._counts = {}
        elif self._in_prefill:
            self._in_prefill = False
            ranked = sorted(self._counts, key=lambda e: (-self._counts[e], e))
            self.hot = frozenset(ranked[:self.hot_slots])
            self._cold = OrderedDict((e, None) for e in self._order if e not in self.hot)

    def on_access(self, eid: int, tick: int, tokens: int = 1) -> None:
        super().on_access(eid, tick, tokens)
        if eid in self._cold:
            self._cold.move_to_end(eid)
        if self._in_prefill:
            self._counts[eid] = self._counts.get(eid, 0) + tokens

    def on_insert(self, eid: int, tick: int) -> None:
        super().on_insert(eid, tick)
        if eid not in self.hot:
            self._cold[eid] = None

    def on_evict(self, eid: int) -> None:
        super().on_evict(eid)
        self._cold.pop(eid, None)

    def victim(self, pinned: set[int]) -> int:
        for eid in self._cold:
            if eid not in pinned:
                return eid
        return super().victim(pinned)

    def reset(self) -> None:
        super().reset()
        self._counts, self._in_prefill, self.hot = {}, False, frozenset()
        self._cold.clear()


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


POLICIES = ("lru", "lfu", "lfru", "lfru-H", "prefill-hot", "belady", "belady-K")
#: LFRU's default half-life in decode steps
LFRU_HALF_LIFE_STEPS = 8


def make_policy(name: str, *, num_slots: int | None = None, top_k: int | None = None,
                future: list | None = None, num_moe_layers: int | None = None) -> EvictionPolicy:
    """Build an eviction policy by name: ``lru``, ``lfu``, ``lfru`` / ``lfru-H`` (half-life H decode steps, default
    ``LFRU_HALF_LIFE_STEPS``), ``prefill-hot``, ``belady`` or ``belady-K`` (K decode steps of future, e.g.
    ``belady-8``).

    Args:
        num_slots, top_k: pool size and top-k (``prefill-hot`` keeps ``num_slots - top_k`` hot experts).
        num_moe_layers: MoE layers (ticks per decode step; ``lfru`` and ``belady-K`` need it, default 1).
        future, num_moe_layers: per-tick needed experts and layers per step (``belady*``, simulator only).

    Raises:
        MoeOffloadError: unknown name, or a Belady policy without a future (the runtime cannot see the future).
    """
    key = name.lower()
    if key == "lru":
        return LRU()
    if key == "lfu":
        return LFU()
    m = re.fullmatch(r"lfru(?:-(\d+(?:\.\d+)?))?", key)
    if m:
        pol = LFRU(float(m.group(1) or LFRU_HALF_LIFE_STEPS) * (num_moe_layers or 1))
        pol.name = key
        return pol
    if key == "prefill-hot":
        if num_slots is None or top_k is None:
            raise ValueError("prefill-hot needs num_slots and top_k")
        return PrefillHot(num_slots - top_k)
    m = re.fullmatch(r"belady(?:-(\d+))?", key)
    if m:
        if future is None:
            raise MoeOffloadError(f"policy {name!r} needs the future and is only available in the simulator")
        window = None if m.group(1) is None else int(m.group(1)) * (num_moe_layers or 1)
        pol = Belady(future, window)
        pol.name = key
        return pol
    raise MoeOffloadError(f"unknown policy {name!r}; choose one of: {', '.join(POLICIES)}")
