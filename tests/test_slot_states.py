"""SeqMoE's slot state machine (§7.2) and landing tags (§8.3) in ``core.slots.SlotTable``, on hand-worked examples,
plus a check that a table that never prefetches plans exactly as the table did before slot states existed."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import pytest

from moe_offload.core.eviction import EvictionPolicy
from moe_offload.core.policies import LFU, LRU
from moe_offload.core.prob_belady import ProbabilisticBelady
from moe_offload.core.slots import Load, SlotState, SlotTable
from moe_offload.errors import MoeOffloadError

E, F, C, U = SlotState.EMPTY, SlotState.FETCH, SlotState.COMPUTE, SlotState.USED


class RecLRU(LRU):
    """LRU that records its events and, at each ``victim`` call, the table's slot states."""

    def __init__(self) -> None:
        super().__init__()
        self.table: SlotTable | None = None
        self.events: list[tuple[str, int]] = []
        self.snapshots: list[tuple[list[SlotState], set[int], int]] = []
        self.victim_states: list[SlotState] = []

    def on_insert(self, eid: int, tick: int) -> None:
        super().on_insert(eid, tick)
        self.events.append(("insert", eid))

    def on_evict(self, eid: int) -> None:
        super().on_evict(eid)
        self.events.append(("evict", eid))

    def victim(self, pinned: set[int]) -> int:
        v = super().victim(pinned)
        self.snapshots.append((states(self.table), set(pinned), v))
        self.victim_states.append(self.table.state_of(self.table.slot_of[v]))
        return v


def states(t: SlotTable) -> list[SlotState]:
    return [t.state_of(s) for s in range(t.num_slots)]


def table(slots: int = 3, reserve: int = 1) -> tuple[SlotTable, RecLRU]:
    """``slots`` slots, 2 MoE layers of 4 experts: layer 0 = experts 0..3, layer 1 = experts 4..7."""
    pol = RecLRU()
    t = SlotTable(slots, 8, pol, experts_per_layer=4, reserve=reserve)
    pol.table = t
    return t, pol


def consistent(t: SlotTable) -> None:
    """Mapping, states and the policy's resident set agree."""
    for s in range(t.num_slots):
        e, st = t.expert_in[s], t.state_of(s)
        assert (e == -1) == (st is E)
        if st in (C, U):
            assert t.slot_of[e] == s
        if st is F:
            assert t.slot_of[e] == -1 and t.in_flight(e)
    assert t.policy.resident == {e for e in range(t.num_experts_total) if t.slot_of[e] >= 0}
    assert t.resident == sum(st is not E for st in states(t))


def test_prefetch_empty_fetch_compute_used():
    t, pol = table()
    ld = t.prefetch(5)
    assert ld == Load(eid=5, slot=0, evicted=-1, tag=1)            # smallest Empty slot, first tag
    assert states(t) == [F, E, E] and t.expert_in[0] == 5
    assert t.in_flight(5) and not t.is_resident(5) and t.slot_of[5] == -1
    assert pol.events == []                                        # the policy sees the insert at landing
    assert t.prefetch(5) is None                                   # already in flight
    assert t.land(5, 0, ld.tag) is True
    assert states(t) == [C, E, E] and t.is_resident(5) and not t.in_flight(5)
    assert pol.events == [("insert", 5)]
    assert t.prefetch(5) is None                                   # already resident
    plan = t.plan_layer([0])                                       # another layer: 5 stays in Compute
    assert [(ld.eid, ld.slot) for ld in plan.rounds[0].loads] == [(0, 1)]
    assert states(t) == [C, U, E]
    plan = t.plan_layer([5])                                       # its layer runs: a hit, then Used
    assert (plan.hits, plan.misses, plan.late, plan.num_loads) == (1, 0, 0, 0)
    assert plan.rounds[0].slots == [0]
    assert states(t) == [U, U, E]
    consistent(t)


def test_prefetched_but_unactivated_experts_of_the_layer_become_used():
    t, _ = table()
    for e in (5, 6):
        ld = t.prefetch(e)
        assert t.land(e, ld.slot, ld.tag)
    assert states(t) == [C, C, E]
    plan = t.plan_layer([4], layer=1)                              # needs 4 only; 5 and 6 were prefetched
    assert (plan.hits, plan.misses) == (0, 1)
    assert states(t) == [U, U, U]                                  # §7.2: all of the layer's Compute slots
    consistent(t)


def test_wasted_prefetches_are_counted_at_eviction():
    """A prefetched expert evicted before any layer needed it is wasted; one a layer needed is not, whatever happens
    to it later; a failed copy is not. Three slots, LRU: prefetch 5 and 6 (layer 1), layer 1 needs 4 and 6 (4 goes to
    the last Empty slot; 5 was never needed), then layer 0 needs 0 and 1: two evictions, LRU's victims 5 (inserted at
    tick 0, never accessed) and then 4 or 6 (accessed at tick 1) — only 5 counts."""
    t, _ = table()
    for e in (5, 6):
        ld = t.prefetch(e)
        assert t.land(e, ld.slot, ld.tag)
    t.plan_layer([4, 6], layer=1)
    assert t.prefetches_wasted == 0
    plan = t.plan_layer([0, 1], layer=0)
    evicted = {ld.evicted for r in plan.rounds for ld in r.loads}
    assert 5 in evicted and len(evicted) == 2
    assert t.prefetches_wasted == 1
    ld = t.prefetch(7)                                             # a failed copy: not wasted
    assert ld is not None and t.land(7, ld.slot, ld.tag, ok=False)
    t.plan_layer([4, 5], layer=1)
    t.plan_layer([2, 3], layer=0)
    assert t.prefetches_wasted == 1


def test_on_demand_load_goes_to_compute_and_hits_are_pinned():
    t, pol = table(slots=3)
    t.plan_layer([0, 1, 2])                                        # LRU order 0, 1, 2
    assert states(t) == [U, U, U]
    plan = t.plan_layer([2, 3])                                    # 2 hits; 3 misses, evicts 0
    assert [(ld.eid, ld.slot, ld.evicted) for ld in plan.rounds[0].loads] == [(3, 0, 0)]
    st, pinned, v = pol.snapshots[-1]                              # at the victim call: 2 in Compute, pinned
    assert st == [U, U, C] and pinned == {2, 3} and v == 0         # (the whole round is pinned, as before)
    plan = t.plan_layer([0, 1])                                    # 1 hits; 0 misses, evicts 2 (LRU)
    st, pinned, v = pol.snapshots[-1]
    assert st == [U, C, U] and pinned == {0, 1} and v == 2
    assert states(t) == [U, U, U]                                  # end of plan_layer: Compute -> Used
    # the loaded expert was already Compute when the policy heard of it, and Used once the plan returned
    t2, pol2 = table(slots=2)
    seen = []
    orig = pol2.on_insert
    pol2.on_insert = lambda e, tick: (seen.append(t2.state_of(t2.slot_of[e])), orig(e, tick))
    t2.plan_layer([4])
    assert seen == [C] and states(t2) == [U, E]
    consistent(t)


def test_only_used_slots_are_evicted_fetch_and_compute_never():
    t, pol = table(slots=3)
    t.plan_layer([0, 1, 2])                                        # slots 0, 1, 2 Used; LRU order 0, 1, 2
    a = t.prefetch(4)
    assert (a.slot, a.evicted) == (0, 0)                           # Used victim (LRU) reserved -> Fetch
    assert pol.events[-1] == ("evict", 0) and not t.is_resident(0)
    b = t.prefetch(5)
    assert (b.slot, b.evicted) == (1, 1)
    assert pol.snapshots[-1][1] == {4}                             # pinned includes the Fetch slot's expert
    assert t.prefetch(6) is None                                   # would leave fewer than `reserve` slots
    assert states(t) == [F, F, U]
    assert t.land(4, 0, a.tag)
    assert states(t) == [C, F, U]
    plan = t.plan_layer([3])                                       # only slot 2 is Used: the only victim
    assert [(ld.eid, ld.slot, ld.evicted) for ld in plan.rounds[0].loads] == [(3, 2, 2)]
    assert pol.snapshots[-1][1] == {3, 4, 5}                       # pinned: Compute 4, Fetch 5, the round's 3
    plan = t.plan_layer([0, 1])                                    # one evictable slot -> two rounds
    assert [r.eids for r in plan.rounds] == [[0], [1]]
    assert [(ld.eid, ld.slot, ld.evicted) for r in plan.rounds for ld in r.loads] == [(0, 2, 3), (1, 2, 0)]
    assert pol.victim_states == [U] * 5                            # every victim sat in a Used slot
    assert all(v not in pinned for _, pinned, v in pol.snapshots)
    assert states(t) == [C, F, U] and t.slot_of[4] == 0 and t.in_flight(5)
    consistent(t)


def test_prefetch_prefers_empty_and_respects_reserve():
    t, _ = table(slots=4, reserve=2)
    t.plan_layer([0])                                              # slot 0 Used, 1..3 Empty
    a = t.prefetch(4)
    assert (a.slot, a.evicted) == (1, -1)                          # Empty first although a Used slot exists
    b = t.prefetch(5)
    assert (b.slot, b.evicted) == (2, -1)
    assert t.prefetch(6) is None                                   # 2 protected == num_slots - reserve
    c = t.prefetch(6, reserve=1)                                   # per-call override
    assert (c.slot, c.evicted) == (3, -1)
    assert t.prefetch(7, reserve=1) is None
    assert t.num_fetching == 3 and t.num_protected == 3


def test_failed_landing_frees_the_slot_and_the_expert_is_not_resident():
    t, pol = table()
    t.plan_layer([0])                                              # slot 0
    ld = t.prefetch(6)
    assert ld.slot == 1
    assert t.land(6, ld.slot, ld.tag, ok=False) is True
    assert states(t) == [U, E, E] and t.expert_in[1] == -1 and t.resident == 1
    assert not t.is_resident(6) and not t.in_flight(6) and 6 not in pol.resident
    assert ("insert", 6) not in pol.events
    assert t.land(6, ld.slot, ld.tag, ok=True) is False            # the same landing again: stale
    plan = t.plan_layer([6])                                       # a miss, loaded on demand into slot 1
    assert (plan.hits, plan.misses, plan.late) == (0, 1, 0)
    assert [(x.eid, x.slot) for x in plan.rounds[0].loads] == [(6, 1)]
    consistent(t)


def test_stale_tag_ignored_after_the_slot_was_reassigned():
    t, pol = table(slots=2)
    t.plan_layer([0])                                              # slot 0 Used
    a = t.prefetch(4)                                              # slot 1, tag 2 (tag 1: the load of 0)
    assert (a.slot, a.tag) == (1, 2)
    assert t.land(4, 1, a.tag, ok=False)                           # cancelled: slot 1 Empty
    b = t.prefetch(5)                                              # slot 1 again, a newer tag
    assert b.slot == 1 and b.tag > a.tag == 2
    assert t.tag_of(1) == b.tag
    assert t.land(4, 1, a.tag, ok=True) is False                   # a late duplicate of 4's landing
    assert states(t) == [U, F] and t.expert_in[1] == 5 and not t.is_resident(4) and t.in_flight(5)
    with pytest.raises(MoeOffloadError):                           # the current tag with another expert
        t.land(4, 1, b.tag)
    assert t.land(5, 1, b.tag) is True
    assert t.land(5, 1, b.tag) is False                            # landed already
    # reassigned through eviction: 5 becomes Used, is evicted by an on-demand load, its old tag stays stale
    t.plan_layer([5])
    t.plan_layer([0])
    t.plan_layer([1])                                              # evicts 5 (LRU) from slot 1
    assert t.expert_in[1] == 1 and t.tag_of(1) > b.tag
    assert t.land(5, 1, b.tag) is False and t.expert_in[1] == 1 and states(t) == [U, U]
    consistent(t)


def test_needed_in_flight_expert_is_waited_for_not_loaded_twice():
    t, pol = table(slots=3)
    a = t.prefetch(5)
    assert a.slot == 0
    plan = t.plan_layer([4, 5])                                    # 5 still in flight
    assert (plan.hits, plan.misses, plan.late, plan.num_loads) == (0, 2, 1, 1)
    assert plan.waits == [Load(eid=5, slot=0, evicted=-1, tag=a.tag)]
    assert plan.rounds[0].waits == plan.waits
    assert [ld.eid for ld in plan.rounds[0].loads] == [4]
    assert plan.rounds[0].eids == [4, 5] and plan.rounds[0].slots == [1, 0]
    assert t.is_resident(5) and not t.in_flight(5) and states(t) == [U, U, E]
    assert pol.events.count(("insert", 5)) == 1
    assert t.land(5, 0, a.tag) is False                            # adopted: its own landing is stale
    assert states(t) == [U, U, E]
    plan = t.plan_layer([5])
    assert (plan.hits, plan.misses, plan.late) == (1, 0, 0)
    consistent(t)


def test_in_flight_and_landed_experts_share_the_first_round():
    # 3 slots: 4 landed (Compute), 5 in flight; layer 1 needs 4, 5, 6, 7: rounds [4, 5, 6] then [7]
    t, _ = table(slots=3, reserve=1)
    a, b = t.prefetch(4), t.prefetch(5)
    t.land(4, a.slot, a.tag)
    plan = t.plan_layer([4, 5, 6, 7])                              # 4 needed > 3 slots: rounds
    assert plan.rounds[0].eids == [4, 5, 6] and [w.eid for w in plan.rounds[0].waits] == [5]
    assert (plan.hits, plan.misses, plan.late) == (1, 3, 1)
    assert [r.eids for r in plan.rounds] == [[4, 5, 6], [7]]
    assert states(t) == [U, U, U]
    consistent(t)


def test_release_all_or_one_layer():
    t, _ = table(slots=3)
    a, b = t.prefetch(1), t.prefetch(5)
    t.land(1, a.slot, a.tag)
    t.land(5, b.slot, b.tag)
    assert t.num_protected == 2 and t.prefetch(6) is None and states(t) == [C, C, E]
    t.release(1)                                                   # only layer 1's Compute slots
    assert states(t) == [C, U, E]
    d = t.prefetch(6)
    assert d.slot == 2 and states(t) == [C, U, F]
    t.release()                                                    # every Compute slot; Fetch untouched
    assert states(t) == [U, U, F] and t.in_flight(6)
    consistent(t)


def test_hold_keeps_the_layer_protected_while_its_prefetch_tasks_are_created():
    t, _ = table(slots=3)
    t.plan_layer([4])                                              # slot 0: Used (LRU oldest)
    plan = t.plan_layer([0, 1], hold=True)                         # the paper's pipeline: loads, then tasks
    assert states(t) == [U, C, C]
    ld = t.prefetch(5)
    assert ld is None                                              # 2 protected + 1 > 3 - reserve
    t2, _ = table(slots=4)
    t2.plan_layer([4])
    t2.plan_layer([0, 1], hold=True)
    ld = t2.prefetch(5)                                            # takes the Empty slot, not layer 0's
    assert ld.slot == 3 and states(t2) == [U, C, C, F]
    ld6 = t2.prefetch(6)
    assert ld6 is None
    t2.release(0)                                                  # "immediately before executing" layer 0
    assert states(t2) == [U, U, U, F]
    assert plan.rounds[0].eids == [0, 1]
    t3, _ = table(slots=2)
    t3.plan_layer([0, 1], hold=True)
    with pytest.raises(MoeOffloadError):                           # layer 0 never released: no slot for layer 1
        t3.plan_layer([4])
    t3.release(0)
    assert t3.plan_layer([4]).misses == 1


def test_policy_events_with_probabilistic_belady():
    pb = ProbabilisticBelady(num_experts=4)
    t = SlotTable(3, 8, pb, experts_per_layer=4)
    t.plan_layer([0, 1, 2])
    pb.update_forecast((0, 1), np.array([[[0.1, 0.9, 0.5, 0.0]]]))
    ld = t.prefetch(4)
    assert ld.evicted == 0 and pb.resident == {1, 2}               # lowest score among Used
    t.land(4, ld.slot, ld.tag)
    assert pb.resident == {1, 2, 4}
    pb.update_forecast((1, 2), np.array([[[0.0, 0.0, 0.0, 0.0]]]))  # 4 now scores lowest, but it is Compute
    ld = t.prefetch(5)
    assert ld.evicted == 2 and pb.resident == {1, 4}
    consistent(t)


def test_bad_arguments():
    t, _ = table()
    with pytest.raises(MoeOffloadError):
        t.prefetch(8)
    with pytest.raises(MoeOffloadError):
        t.prefetch(-1)
    with pytest.raises(MoeOffloadError):
        t.prefetch(1, reserve=0)
    with pytest.raises(MoeOffloadError):
        t.land(1, 3, 1)
    with pytest.raises(MoeOffloadError):
        t.state_of(3)
    with pytest.raises(MoeOffloadError):
        t.plan_layer([1, 4])                                       # two layers
    with pytest.raises(MoeOffloadError):
        t.plan_layer([1], layer=1)
    with pytest.raises(MoeOffloadError):
        t.plan_layer([8])
    with pytest.raises(MoeOffloadError):
        t.plan_layer([1, 2], [1])
    with pytest.raises(MoeOffloadError):
        SlotTable(3, 8, LRU(), experts_per_layer=4, reserve=0)
    with pytest.raises(MoeOffloadError):
        SlotTable(3, 8, LRU(), experts_per_layer=0)
    plain = SlotTable(3, 8, LRU())
    with pytest.raises(MoeOffloadError):
        plain.prefetch(1)                                          # no experts_per_layer
    with pytest.raises(MoeOffloadError):
        plain.release(0)


# ---- a table without prefetches plans exactly as before -----------------------------------------------------

@dataclass
class _OldLoad:
    eid: int
    slot: int
    evicted: int = -1


@dataclass
class _OldRound:
    eids: list[int]
    slots: list[int]
    loads: list[_OldLoad] = field(default_factory=list)


class _OldSlotTable:
    """Verbatim logic of ``SlotTable`` before slot states (commit fa0738b)."""

    def __init__(self, num_slots: int, num_experts_total: int, policy: EvictionPolicy):
        self.num_slots = num_slots
        self.policy = policy
        self.slot_of = [-1] * num_experts_total
        self.expert_in = [-1] * num_slots
        self._empty = list(range(num_slots - 1, -1, -1))
        self._pinned: set[int] = set()
        self.tick = 0

    def plan_layer(self, needed, tokens=None):
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
        self._pinned.clear()
        return rounds, len(hit_list), len(miss_list)

    def _apply_round(self, chunk, first):
        if not first:
            self._pinned.clear()
        self._pinned.update(chunk)
        loads = []
        for e in chunk:
            if self.slot_of[e] < 0:
                loads.append(self._allocate(e))
        eids = sorted(chunk)
        return _OldRound(eids=eids, slots=[self.slot_of[e] for e in eids], loads=loads)

    def _allocate(self, eid):
        evicted = -1
        if self._empty:
            slot = self._empty.pop()
        else:
            evicted = self.policy.victim(self._pinned)
            slot = self.slot_of[evicted]
            self.slot_of[evicted] = -1
            self.policy.on_evict(evicted)
        self.slot_of[eid] = slot
        self.expert_in[slot] = eid
        self.policy.on_insert(eid, self.tick)
        return _OldLoad(eid=eid, slot=slot, evicted=evicted)


def _flat(rounds) -> list:
    return [(r.eids, r.slots, [(ld.eid, ld.slot, ld.evicted) for ld in r.loads]) for r in rounds]


@pytest.mark.parametrize("make", [LRU, LFU, lambda: ProbabilisticBelady(num_experts=8)], ids=["lru", "lfu", "pb"])
@pytest.mark.parametrize("per_layer", [False, True])
def test_no_prefetch_plans_exactly_as_before(make, per_layer):
    rng = random.Random(1234)
    layers, e, slots = 2, 8, 6
    weights = [8, 4, 2, 1, 1, 1, 1, 1]                            # skewed: experts 0, 1 of each layer are hot
    nprng = np.random.default_rng(7)
    new = SlotTable(slots, layers * e, make(), experts_per_layer=e if per_layer else None)
    old = _OldSlotTable(slots, layers * e, make())
    hits = misses = rounds_seen = 0
    for step in range(60):
        new.begin_step(step // 20, step % 20)
        old.policy.on_step(step // 20, step % 20)
        if isinstance(new.policy, ProbabilisticBelady) and step % 5 == 1:  # the same forecast for both
            probs = nprng.random((3, layers, e))
            new.policy.update_forecast((0, layers), probs)
            old.policy.update_forecast((0, layers), probs)
        for layer in range(layers):
            k = rng.choice([1, 1, 2, 3]) if step % 20 else e  # prefill: all 8 experts > 6 slots: rounds
            chosen: set[int] = set()
            while len(chosen) < k:
                chosen.add(rng.choices(range(e), weights)[0])
            needed = [layer * e + q for q in rng.sample(sorted(chosen), k)]  # any order
            tokens = [rng.randint(1, 4) for _ in needed]
            p = new.plan_layer(needed, tokens)
            rounds, h, m = old.plan_layer(needed, tokens)
            assert (p.hits, p.misses, p.late) == (h, m, 0)
            assert _flat(p.rounds) == _flat(rounds)
            assert all(ld.tag == -1 for r in p.rounds for ld in r.loads) and p.waits == []
            assert new.slot_of == old.slot_of and new.expert_in == old.expert_in
            assert all(st is U for st in states(new) if st is not E)
            hits, misses, rounds_seen = hits + h, misses + m, rounds_seen + (len(rounds) > 1)
    assert new.policy.resident == old.policy.resident
    assert rounds_seen > 0 and hits > 60 and misses > 60, (rounds_seen, hits, misses)


def test_belady_accepts_prefetched_expert_never_accessed():
    """A prefetch can land an expert the oracle has not seen accessed yet: its next use comes from the future."""
    from moe_offload.core.belady import Belady
    from moe_offload.core.slots import SlotTable

    future = [[0], [1], [2], [0]]                      # one layer execution per entry, experts of one layer
    pol = Belady(future)
    t = SlotTable(2, 4, pol, experts_per_layer=4)
    t.plan_layer([0])
    load = t.prefetch(2)
    assert load is not None and t.land(2, load.slot, load.tag)
    assert pol.next_use(2) == 2                         # needed at tick 3, two ticks after tick 1
    plan = t.plan_layer([1])                            # must evict: 0 (next at tick 4) rather than 2 (tick 3)
    assert plan.rounds[0].loads[0].evicted == 0
