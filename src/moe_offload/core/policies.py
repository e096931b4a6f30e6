"""Eviction policies over the global slot pool (DESIGN.md §5; SeqMoE §3.3): LRU, LFU, LFRU, prefill-hot, and
``make_policy`` (over a ``core.policy_spec.PolicySpec``), which also builds Belady's oracle (``core.belady``, simulator only). Their interface and the event
order the slot table guarantees: ``core.eviction.EvictionPolicy``.
"""

from __future__ import annotations

import heapq
import math
from abc import abstractmethod
from collections import OrderedDict

from ..errors import MoeOffloadError
from .belady import Belady
from .eviction import EvictionPolicy, crf_after_use
from .policy_spec import PolicySpec, parse_policy


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
        self._key[eid] = crf_after_use(self._key.get(eid, -math.inf), tick / self.h)
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


def make_policy(policy: PolicySpec | str, *, num_slots: int | None = None, top_k: int | None = None,
                future: list | None = None, num_moe_layers: int | None = None) -> EvictionPolicy:
    """The eviction policy object of a history or oracle policy (``core.policy_spec``: ``lru``, ``lfu``, ``lfru``
    with its half-life in decode steps, ``prefill-hot``, ``belady`` with its window of K decode steps). Its ``name``
    is the spec's written form.

    Args:
        policy: a ``PolicySpec`` (a name is parsed by ``parse_policy``).
        num_slots, top_k: pool size and top-k (``prefill-hot`` keeps ``num_slots - top_k`` hot experts).
        num_moe_layers: MoE layers (ticks per decode step; ``lfru`` and ``belady-K`` need it, default 1).
        future: per-tick needed experts (``belady``, simulator only).

    Raises:
        MoeOffloadError: an unknown name, a policy that is not a history or oracle one (forecast-driven policies
            are ``core.prob_belady.ProbabilisticBelady`` fed forecasts; refresh planners are ``core.refresh``), or
            Belady without a future (the runtime cannot see the future).
    """
    spec = parse_policy(policy)
    fam = spec.family
    if fam == "lru":
        pol = LRU()
    elif fam == "lfu":
        pol = LFU()
    elif fam == "lfru":
        pol = LFRU(spec.lfru_half_life * (num_moe_layers or 1))
    elif fam == "prefill-hot":
        if num_slots is None or top_k is None:
            raise ValueError("prefill-hot needs num_slots and top_k")
        pol = PrefillHot(num_slots - top_k)
    elif fam == "belady":
        if future is None:
            raise MoeOffloadError(f"policy {spec.name!r} needs the future and is only available in the simulator")
        pol = Belady(future, None if spec.window is None else spec.window * (num_moe_layers or 1))
    else:
        raise MoeOffloadError(f"policy {spec.name!r} is not an eviction policy of its own (history: lru, lfu, "
                              "lfru[-H], prefill-hot; simulator: belady[-K])")
    pol.name = spec.name
    return pol
