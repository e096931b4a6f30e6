"""Exact hit/miss counts of LRU and LFU on a hand-worked access sequence, and the round planner."""

import random

import pytest

from moe_offload.core.policies import LFRU, LFU, LRU, PrefillHot, make_policy
from moe_offload.core.slots import SlotTable
from moe_offload.errors import MoeOffloadError

SEQ = [0, 1, 2, 0, 3, 1, 4, 0, 1]  # one expert per layer call, 3 slots


def replay(policy, seq=SEQ, slots=3, n=8):
    t = SlotTable(slots, n, policy)
    hits = misses = 0
    evicted = []
    for e in seq:
        plan = t.plan_layer([e])
        hits += plan.hits
        misses += plan.misses
        evicted += [ld.evicted for r in plan.rounds for ld in r.loads if ld.evicted >= 0]
    return hits, misses, evicted, t


def test_lru_hand_worked():
    # 0m 1m 2m | 0h | 3m evicts 1 | 1m evicts 2 | 4m evicts 0 | 0m evicts 3 | 1h
    hits, misses, evicted, t = replay(LRU())
    assert (hits, misses) == (2, 7)
    assert evicted == [1, 2, 0, 3]
    assert sorted(e for e in t.expert_in) == [0, 1, 4]


def test_lfu_hand_worked():
    # frequencies persist; ties -> least recently accessed
    # 0m 1m 2m | 0h (f0=2) | 3m evicts 1 (f=1, older than 2) | 1m evicts 2 | 4m evicts 3 | 0h | 1h
    hits, misses, evicted, t = replay(LFU())
    assert (hits, misses) == (3, 6)
    assert evicted == [1, 2, 3]
    assert sorted(t.expert_in) == [0, 1, 4]


def test_empty_slots_first_and_slot_lookup_consistent():
    t = SlotTable(4, 10, LRU())
    plan = t.plan_layer([7, 2, 5])
    assert plan.misses == 3 and plan.hits == 0
    assert [ld.evicted for ld in plan.rounds[0].loads] == [-1, -1, -1]
    for e, s in zip(plan.rounds[0].eids, plan.rounds[0].slots):
        assert t.slot_of[e] == s and t.expert_in[s] == e


def test_rounds_when_layer_needs_more_experts_than_slots():
    t = SlotTable(2, 10, LRU())
    t.plan_layer([1])  # expert 1 resident, one slot still empty
    plan = t.plan_layer([0, 1, 2])
    assert (plan.hits, plan.misses) == (1, 2)
    # hits first, so a hit is never evicted before use; each round fits in the pool
    assert [r.eids for r in plan.rounds] == [[0, 1], [2]]
    assert [ld.eid for ld in plan.rounds[0].loads] == [0]
    # round 1's experts are released after their compute; for round 2 LRU evicts 1 (0 was inserted after it)
    assert [(ld.eid, ld.evicted) for ld in plan.rounds[1].loads] == [(2, 1)]


def test_current_layer_experts_are_never_evicted():
    t = SlotTable(3, 10, LRU())
    t.plan_layer([0, 1, 2])
    plan = t.plan_layer([2, 3, 4])  # 2 is a hit and pinned; 0 and 1 go
    assert sorted(ld.evicted for ld in plan.rounds[0].loads) == [0, 1]
    assert t.slot_of[2] >= 0


def test_unknown_policy_is_a_clear_error():
    with pytest.raises(MoeOffloadError, match="unknown policy 'fifo'"):
        make_policy("fifo")


def test_lfru_hand_worked_between_lru_and_lfu():
    # SEQ at ticks 1..9, half-life 4 ticks, CRF(t) = sum 2^(-(t - t_i)/4):
    # t5: 3 evicts 1 (CRF 0.59 < 2: 0.71 < 0: 1.34); t6: 1 evicts 2 (0.59 < 3: 0.84 < 0: 1.13);
    # t7: 4 evicts 3 (3: 0.71 < 0: 0.95 < 1: 2^-1.25 + 2^-0.25 = 1.26) where LRU evicts 0; t8 0 hit, t9 1 hit
    hits, misses, evicted, _ = replay(make_policy("lfru-4"))
    assert (hits, misses, evicted) == (3, 6, [1, 2, 3])
    assert replay(LRU())[:3] == (2, 7, [1, 2, 0, 3])
    # an old frequency decays (2 slots, half-life 1 tick): at t6 expert 0 (4 accesses at t1-t4, CRF 0.47) leaves
    # rather than 1 (one access at t5, CRF 0.5), so 1 is a hit at t7; LFU keeps 0 and misses 1 twice
    seq = [0, 0, 0, 0, 1, 2, 1]
    assert replay(make_policy("lfru-1"), seq, slots=2)[:3] == (4, 3, [0])
    assert replay(LFU(), seq, slots=2)[:3] == (3, 4, [1, 2])


def test_lfru_limits_are_lru_and_lfu():
    import random

    rng = random.Random(0)
    seq = [min(int(rng.expovariate(0.3)), 15) for _ in range(400)]
    assert replay(LFRU(1e-4), seq, slots=5, n=16)[:3] == replay(LRU(), seq, slots=5, n=16)[:3]
    # h -> inf ranks by access count like LFU (equal counts then by total age, not by last access as LFU does)
    assert replay(LFRU(1e12))[:3] == replay(LFU())[:3] == (3, 6, [1, 2, 3])
    with pytest.raises(MoeOffloadError, match="half-life"):
        LFRU(0)


class _ScanLFU(LFU):
    """LFU's victim by a full scan of the resident experts (the definition; the policy uses a lazy min-heap)."""

    def victim(self, pinned):
        return min((e for e in self.resident if e not in pinned), key=self.key)


class _ScanLFRU(LFRU):
    def victim(self, pinned):
        return min((e for e in self.resident if e not in pinned), key=self.key)


class _ScanPrefillHot(PrefillHot):
    """Prefill-hot's victim by walking every resident expert in recency order (the policy walks the cold ones)."""

    def victim(self, pinned):
        for e in self._order:
            if e not in pinned and e not in self.hot:
                return e
        return LRU.victim(self, pinned)


@pytest.mark.parametrize("fast, scan", [(LFU, _ScanLFU), (lambda: LFRU(12.0), lambda: _ScanLFRU(12.0)),
                                        (lambda: PrefillHot(9), lambda: _ScanPrefillHot(9))],
                         ids=["lfu", "lfru", "prefill-hot"])
def test_fast_victims_equal_the_definition(fast, scan):
    """On random multi-expert layers over several requests (prefills and decode steps), the heap / cold-list victims
    evict exactly what the definitions evict."""
    rng = random.Random(0)
    tables = [SlotTable(12, 64, fast()), SlotTable(12, 64, scan())]
    evicted = [[], []]
    for request in range(3):
        for step in range(40):
            for t in tables:
                t.begin_step(request, step)
            for layer in range(4):
                need = sorted({layer * 16 + int(rng.triangular(0, 16, 0)) for _ in range(6 if step else 14)})
                for t, ev in zip(tables, evicted):
                    plan = t.plan_layer(need)
                    ev += [ld.evicted for r in plan.rounds for ld in r.loads]
    assert evicted[0] == evicted[1] and sum(e >= 0 for e in evicted[0]) > 500
