"""The slot table: which expert sits in which device slot, and the per-layer residency decisions.

SeqMoE §8.1: one pool of ``num_slots`` device slots is shared by every MoE layer; a lookup table maps a global
expert id ``eid = moe_layer * num_experts + expert`` to its slot. This module holds that mapping and makes all
residency decisions (hit/miss accounting, which slot a missed expert goes to, whom to evict) as pure logic, so
the runtime (``runtime.engine``) and the trace simulator replay the exact same decisions.

Slot states (SeqMoE §7.2; this issue uses three of the four — Fetch arrives with asynchronous prefetch):
  * Empty   — no expert; allocation always prefers these;
  * Compute — holds an expert the layer being executed needs (pinned: never evicted while the layer runs);
  * Used    — holds an expert no running layer needs; the only evictable state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import MoeOffloadError
from .policies import EvictionPolicy


@dataclass
class Load:
    """One on-demand load decided by the table: copy expert ``eid`` into ``slot`` (evicting ``evicted``, or -1)."""

    eid: int
    slot: int
    evicted: int = -1


@dataclass
class Round:
    """A set of experts that are all resident at once and computed together.

    ``eids``: the experts computed in this round (sorted); ``slots``: the slot of each of them during the round;
    ``loads``: the copies to do, in order, before computing.
    """

    eids: list[int]
    slots: list[int]
    loads: list[Load] = field(default_factory=list)


@dataclass
class LayerPlan:
    """Decisions for one layer execution: the rounds to run and the hit/miss counts (SeqMoE's hit rate)."""

    rounds: list[Round]
    hits: int
    misses: int


class SlotTable:
    """Expert <-> slot mapping over one global pool, plus hit/miss/eviction accounting.

    Args:
        num_slots: number of device slots S (>= 1).
        num_experts_total: number of routed experts in the model, all MoE layers together (N).
        policy: the eviction policy consulted when no slot is Empty.

    Attributes:
        slot_of: list[int] of length N, the slot of each expert or -1 when not resident.
        expert_in: list[int] of length S, the expert in each slot or -1 when Empty.
        tick: number of layer executions planned so far (the policies' clock).
    """

    def __init__(self, num_slots: int, num_experts_total: int, policy: EvictionPolicy):
        if num_slots < 1:
            raise MoeOffloadError(f"the slot pool needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.num_experts_total = num_experts_total
        self.policy = policy
        self.slot_of = [-1] * num_experts_total
        self.expert_in = [-1] * num_slots
        self._empty = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._pinned: set[int] = set()
        self.tick = 0

    @property
    def resident(self) -> int:
        """Number of occupied slots."""
        return self.num_slots - len(self._empty)

    def is_resident(self, eid: int) -> bool:
        return self.slot_of[eid] >= 0

    def begin_step(self, request: int, step: int) -> None:
        """A forward pass begins (step 0 = prefill of ``request``, i >= 1 = decode step i): tells the policy."""
        self.policy.on_step(request, step)

    def plan_layer(self, needed: list[int], tokens: list[int] | None = None) -> LayerPlan:
        """Decide how one layer execution gets its experts onto the device.

        Args:
            needed: distinct global expert ids the layer's router selected, any order (ints in [0, N)).
            tokens: optional, aligned with ``needed``: how many tokens selected each expert (default 1 each).

        Returns:
            A LayerPlan. When ``len(needed) <= num_slots`` there is one round holding every needed expert.
            Otherwise the experts are processed in rounds of at most ``num_slots``: the resident ones first (so a
            hit is never evicted before it is used), each round's experts pinned while it computes and released
            (Used) before the next round loads. The hit count is taken before any load (SeqMoE's definition:
            required experts already resident before on-demand loading).

        The plan is already applied to the table (mapping, policy events, counters) when this returns: the
        caller executes, for each round in order, its loads and then its compute.
        """
        self.tick += 1
        if tokens is None:
            tokens = [1] * len(needed)
        pairs = sorted(zip(needed, tokens))
        needed = [e for e, _ in pairs]
        hit_list = [e for e in needed if self.slot_of[e] >= 0]
        miss_list = [e for e in needed if self.slot_of[e] < 0]
        for e, n in pairs:
            self.policy.on_access(e, self.tick, n)
        order = hit_list + miss_list
        chunks = [order[i:i + self.num_slots] for i in range(0, len(order), self.num_slots)]
        rounds = [self._apply_round(chunk, first=(i == 0)) for i, chunk in enumerate(chunks)]
        self.release()
        return LayerPlan(rounds=rounds, hits=len(hit_list), misses=len(miss_list))

    def _apply_round(self, chunk: list[int], first: bool) -> Round:
        if not first:
            self.release()
        self._pinned.update(chunk)
        loads = []
        for e in chunk:
            if self.slot_of[e] < 0:
                loads.append(self._allocate(e))
        eids = sorted(chunk)
        return Round(eids=eids, slots=[self.slot_of[e] for e in eids], loads=loads)

    def _allocate(self, eid: int) -> Load:
        evicted = -1
        if self._empty:
            slot = self._empty.pop()
        else:
            # a round never holds more than num_slots experts, so an unpinned resident expert exists here
            evicted = self.policy.victim(self._pinned)
            slot = self.slot_of[evicted]
            self.slot_of[evicted] = -1
            self.policy.on_evict(evicted)
        self.slot_of[eid] = slot
        self.expert_in[slot] = eid
        self.policy.on_insert(eid, self.tick)
        return Load(eid=eid, slot=slot, evicted=evicted)

    def release(self) -> None:
        """Move every Compute slot to Used (the layer or round finished with them)."""
        self._pinned.clear()
