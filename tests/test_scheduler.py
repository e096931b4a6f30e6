"""SeqMoE prefetch scheduling (§6, Algorithm 1, Table 2) and probabilistic Belady eviction (§7.1) on hand-worked
examples. Pure Python: no model, no tensors."""

from types import SimpleNamespace

import numpy as np
import pytest

from moe_offload.core.jsd import JSDScheduler, max_confidence_feasible
from moe_offload.core.prefetch import (MoEInfinityScheduler, PrefetchTask, ProMoEScheduler,
                                       generate_tasks, make_scheduler, position,
                                       prefetch_width, tasks_from_forecast)
from moe_offload.core.prob_belady import ProbabilisticBelady
from moe_offload.core.slots import SlotTable
from moe_offload.errors import MoeOffloadError

# SeqMoE Table 2 ("Prefetch Scheduling Example"), reconstructed from the flattened text
#   "Candidates ABCDEF  Deadline 122333  Confidence 0.55 0.90 0.40 0.75 0.70 0.30  Capacity 134
#    Optimal ABDE  MoE-Infinity BDEF  ProMoE ABCD":
#
#   candidate   A     B     C     D     E     F
#   deadline    1     2     2     3     3     3
#   confidence  0.55  0.90  0.40  0.75  0.70  0.30
#   capacity    C(1) = 1, C(2) = 3, C(3) = 4   (transfers that can complete by each deadline)
#   selected    optimal / SeqMoE: A B D E (total 2.90); MoE-Infinity: B D E F (2.65); ProMoE: A B C D (2.60)
#
# The table's deadline d is the last transfer slot that still serves the task; slot budgets are the capacity
# increments 1, 2, 1. In Algorithm 1's positions (tasks with ddl <= pos + 1 are dropped) slot s is pos = s - 1
# and the task's ddl is d + 1 (the position at which the expert is needed).
TABLE2 = [("A", 1, 0.55), ("B", 2, 0.90), ("C", 2, 0.40), ("D", 3, 0.75), ("E", 3, 0.70), ("F", 3, 0.30)]
TABLE2_CAPACITY = {1: 1, 2: 3, 3: 4}
SLOT_BUDGETS = [1, 2, 1]


def table2_tasks():
    # eid = index of the candidate; ddl = table deadline + 1
    return [PrefetchTask(eid=i, conf=conf, ddl=d + 1) for i, (_, d, conf) in enumerate(TABLE2)]


def names(tasks):
    return "".join(TABLE2[t.eid][0] for t in tasks)


def simulate_table2(sched):
    """Run the scheduler slot by slot with budgets 1, 2, 1; JSD sees the exact remaining capacities."""
    sched.submit(table2_tasks())
    picked = []
    for pos, budget in enumerate(SLOT_BUDGETS):
        for used in range(budget):
            remaining = budget - used

            def cap(ddl, pos=pos, remaining=remaining):
                return remaining + sum(SLOT_BUDGETS[pos + 1:ddl - 1])

            t = sched.select(pos, capacity=cap)
            if t is not None:
                picked.append(t)
    return picked


def test_table2_capacities_match_harness():
    cap = lambda ddl: 1 + sum(SLOT_BUDGETS[1:ddl - 1])  # noqa: E731  (slot 1, nothing used yet)
    assert {d: cap(d + 1) for d in (1, 2, 3)} == TABLE2_CAPACITY


def test_table2_jsd_feasible_set():
    kept = max_confidence_feasible(table2_tasks(), lambda ddl: TABLE2_CAPACITY[ddl - 1])
    assert names(kept) == "ABDE"
    s = JSDScheduler()
    s.submit(table2_tasks())
    assert names(s.plan(0, capacity=lambda ddl: TABLE2_CAPACITY[ddl - 1])) == "ABDE"


def test_table2_jsd_selects_ABDE():
    picked = simulate_table2(JSDScheduler())
    assert names(picked) == "ABDE"  # A (slot 1), B then D (slot 2), E (slot 3)
    assert sum(t.conf for t in picked) == pytest.approx(2.90)


@pytest.mark.parametrize("L", [4, 48])
def test_table2_moe_infinity_selects_BDEF(L):
    picked = simulate_table2(MoEInfinityScheduler(L))
    assert names(picked) == "BDEF"  # B outranks A in slot 1 (A expires), D and E outrank C in slot 2 (C expires)


def test_table2_promoe_selects_ABCD():
    picked = simulate_table2(ProMoEScheduler())
    assert names(picked) == "ABCD"  # earliest deadline first, then confidence


def test_jsd_default_capacity_formula():
    # C(ddl) = max(1, B_cur) + B_avg * (ddl - pos - 1); at a new position B_cur = B_avg
    s = JSDScheduler(b_avg=1.0)
    s.submit(table2_tasks())
    s.advance(0)
    assert [s.capacity(d) for d in (2, 3, 4)] == [2.0, 3.0, 4.0]
    assert names(s.plan(0)) == "ABDE"   # C pushed out at ddl 4 (lowest confidence), then F
    assert names([s.select(0)]) == "A"  # EDF within the kept set

    s = JSDScheduler(b_avg=0.5)          # B_cur = 0.5 -> max(1, B_cur) = 1: C = 1.5, 2, 2.5
    s.submit(table2_tasks())
    s.advance(0)
    assert [s.capacity(d) for d in (2, 3, 4)] == [1.5, 2.0, 2.5]
    assert names(s.plan(0)) == "BD"
    assert names([s.select(0)]) == "B"


def test_position_and_width():
    assert position(1, 0, 48) == 0
    assert position(3, 5, 48) == 101
    assert position(0, 47, 48) == -1      # prefill
    assert prefetch_width(128, 8) == 11   # k' = k + 3
    assert prefetch_width(4, 2) == 3      # clamped to k' < e
    assert prefetch_width(4, 4) == 4      # k = e


def test_generate_tasks_hand_made():
    # L = 4 MoE layers, e = 8, k = 2 -> k' = 5; predictor over layers [2, 4); prediction for step i = 3
    probs = np.array([
        [0.05, 0.30, 0.02, 0.20, 0.10, 0.15, 0.08, 0.10],   # layer 2
        [0.40, 0.01, 0.01, 0.25, 0.03, 0.10, 0.12, 0.08],   # layer 3
    ], dtype=np.float32)
    tasks = generate_tasks(probs, (2, 4), 3, num_moe_layers=4, num_experts=8, top_k=2)
    assert len(tasks) == 2 * 5
    # layer 2: experts 1, 3, 5, 4, 7 (4 and 7 tie at 0.10: smaller index first); ddl = (3 - 1) * 4 + 2 = 10
    # layer 3: experts 0, 3, 6, 5, 7; ddl = 11
    assert [t.eid for t in tasks] == [17, 19, 21, 20, 23, 24, 27, 30, 29, 31]
    assert [t.ddl for t in tasks] == [10] * 5 + [11] * 5
    assert [t.layer for t in tasks] == [2] * 5 + [3] * 5
    assert [t.expert for t in tasks] == [1, 3, 5, 4, 7, 0, 3, 6, 5, 7]
    assert [t.conf for t in tasks] == pytest.approx([0.30, 0.20, 0.15, 0.10, 0.10, 0.40, 0.25, 0.12, 0.10, 0.08])
    assert all(t.step == 3 for t in tasks)

    fc = SimpleNamespace(step=2, layers=(2, 4), probs=np.stack([probs, probs[::-1]]))  # [1 + c, n, e], c = 1
    assert tasks_from_forecast(fc, 4, 8, 2) == tasks


def test_generate_tasks_batch_mean_and_clamp():
    # b = 2 requests, A' of shape [b, 1, n, e]; conf = mean over the batch: [0.4, 0.3, 0.2, 0.1]
    # e = 4, k = 1, extra = 3 -> k' = min(4, e - 1) = 3; prediction for step 1 -> ddl = layer
    batch = np.array([[[[0.7, 0.1, 0.1, 0.1]]], [[[0.1, 0.5, 0.3, 0.1]]]])
    tasks = generate_tasks(batch, (0, 1), 1, num_moe_layers=2, num_experts=4, top_k=1)
    assert [(t.eid, t.ddl) for t in tasks] == [(0, 0), (1, 0), (2, 0)]
    assert [t.conf for t in tasks] == pytest.approx([0.4, 0.3, 0.2])


@pytest.mark.parametrize("kwargs", [
    dict(probs=np.zeros((2, 2, 8)), layers=(2, 4)),          # a whole [1 + c, n, e] forecast
    dict(probs=np.zeros((3, 8)), layers=(2, 4)),             # n mismatch
    dict(probs=np.zeros((2, 8)), layers=(3, 5)),             # beyond L
    dict(probs=np.full((2, 8), np.nan), layers=(2, 4)),      # non-finite
    dict(probs=np.zeros((2, 8)), layers=(2, 4), step_index=0),
    dict(probs=np.zeros((2, 8)), layers=(2, 4), top_k=9),
])
def test_generate_tasks_errors(kwargs):
    args = dict(step_index=3, num_moe_layers=4, num_experts=8, top_k=2) | kwargs
    with pytest.raises(MoeOffloadError):
        generate_tasks(**args)


@pytest.mark.parametrize("name", ["jsd", "moe-infinity", "promoe"])
def test_expiry(name):
    s = make_scheduler(name, num_moe_layers=4)
    s.submit([PrefetchTask(eid=1, conf=0.9, ddl=5), PrefetchTask(eid=2, conf=0.5, ddl=6),
              PrefetchTask(eid=3, conf=0.4, ddl=7)])
    t = s.select(4)                     # ddl 5 <= pos + 1: dropped
    assert t is not None and t.eid == 2
    assert [x.eid for x in s.pending()] == [3]
    assert s.select(6) is None          # ddl 7 <= 7: dropped
    assert len(s) == 0


def test_submit_replace_and_drop():
    s = JSDScheduler()
    s.submit([PrefetchTask(5, 0.2, 10), PrefetchTask(5, 0.3, 14), PrefetchTask(6, 0.4, 10)])
    s.submit([PrefetchTask(5, 0.6, 10)])                  # same (eid, ddl): newer confidence
    assert [(t.eid, t.conf, t.ddl) for t in s.pending()] == [(5, 0.6, 10), (6, 0.4, 10), (5, 0.3, 14)]
    assert s.drop([5]) == 2                               # expert 5 became resident
    assert [t.eid for t in s.pending()] == [6]
    assert s.select(0).eid == 6 and s.select(0) is None


def test_bandwidth_ema():
    s = JSDScheduler(b_avg=2.0, alpha=0.5)
    assert s.observe_bandwidth(4.0) == pytest.approx(3.0)
    s.set_bandwidth(2.0)
    assert (s.b_avg, s.b_cur) == (2.0, 2.0)

    s.submit([PrefetchTask(eid=i, conf=1.0 - i / 10, ddl=100) for i in range(6)])
    for _ in range(3):                                    # 3 transfers during position 0
        assert s.select(0) is not None
    assert s.b_cur == pytest.approx(-1.0)
    s.select(1)                                           # new layer: sample 3/layer
    assert s.b_avg == pytest.approx(2.5)                  # = 2 - alpha * B_cur(-1): the paper's line 2, sign fixed
    assert s.b_cur == pytest.approx(1.5)                  # reset to B_avg, minus the task just selected
    s.select(3)                                           # 1 transfer over 2 layers: sample 0.5
    assert s.b_avg == pytest.approx(1.5)
    s.drop(range(6))
    assert s.select(3) is None                            # prefetcher idle: no sample at the next update
    s.submit([PrefetchTask(eid=9, conf=0.5, ddl=100)])
    s.select(4)
    assert s.b_avg == pytest.approx(1.5)

    manual = JSDScheduler(b_avg=2.0, alpha=0.5, auto_ema=False)
    manual.submit([PrefetchTask(eid=i, conf=0.5, ddl=100) for i in range(3)])
    manual.select(0), manual.select(0), manual.select(1)
    assert manual.b_avg == 2.0


def test_scheduler_errors():
    with pytest.raises(MoeOffloadError):
        JSDScheduler(b_avg=-1.0)
    with pytest.raises(MoeOffloadError):
        JSDScheduler(alpha=0.0)
    with pytest.raises(MoeOffloadError):
        JSDScheduler().observe_bandwidth(float("nan"))
    with pytest.raises(MoeOffloadError):
        JSDScheduler().capacity(3)                        # no position yet
    with pytest.raises(MoeOffloadError):
        make_scheduler("fifo", num_moe_layers=4)
    with pytest.raises(MoeOffloadError):
        MoEInfinityScheduler(0)


# Probabilistic Belady: e = 4, a forecast over layers [0, 2) with 3 rows, c = 3, lambda = 0.5
# -> row weights 4/7, 2/7, 1/7. eids: layer 0 -> 0..3, layer 1 -> 4..7.
FORECAST = np.array([
    [[0.1, 0.6, 0.2, 0.1], [0.5, 0.2, 0.2, 0.1]],   # row 0: step i
    [[0.7, 0.1, 0.1, 0.1], [0.1, 0.1, 0.7, 0.1]],   # row 1: step i + 1
    [[0.7, 0.1, 0.1, 0.1], [0.1, 0.1, 0.7, 0.1]],   # row 2: step i + 2
])
# 7 * score: eid 0: .4+1.4+.7 = 2.5, 1: 2.4+.2+.1 = 2.7, 2: .8+.2+.1 = 1.1, 3: .7,
#            eid 4: 2.0+.2+.1 = 2.3, 5: 1.1, 6: .8+1.4+.7 = 2.9, 7: .7
SCORES = [2.5 / 7, 2.7 / 7, 1.1 / 7, 0.7 / 7, 2.3 / 7, 1.1 / 7, 2.9 / 7, 0.7 / 7]


def make_pb(horizon=3, **kw):
    pb = ProbabilisticBelady(num_experts=4, horizon=horizon, lam=0.5, **kw)
    pb.update_forecast((0, 2), FORECAST)
    return pb


def test_prob_belady_scores():
    pb = make_pb()
    assert [pb.score(e) for e in range(8)] == pytest.approx(SCORES)
    assert pb.score(9) == 0.0                                          # layer 2: no forecast
    assert [make_pb(horizon=8).score(e) for e in range(8)] == pytest.approx(SCORES)  # 3 rows, renormalised
    assert [make_pb(horizon=1).score(e) for e in range(4)] == pytest.approx([0.1, 0.6, 0.2, 0.1])
    batched = ProbabilisticBelady(num_experts=4, horizon=3)
    batched.update_forecast((0, 2), np.stack([FORECAST, FORECAST]))    # [b, R, n, e]
    assert [batched.score(e) for e in range(8)] == pytest.approx(SCORES)
    fc = SimpleNamespace(layers=(0, 2), probs=FORECAST)
    observed = ProbabilisticBelady(num_experts=4, horizon=3)
    observed.observe(fc)
    assert [observed.score(e) for e in range(8)] == pytest.approx(SCORES)


def test_prob_belady_victim_and_pinned():
    pb = make_pb()
    for t, e in enumerate([0, 1, 2, 3, 4, 6], start=1):
        pb.on_insert(e, t)
    assert pb.victim(set()) == 3                 # lowest score 0.1
    assert pb.victim({3}) == 2                   # next: 1.1/7
    assert pb.victim({3, 2}) == 4                # 2.3/7 (0 beats 4 thanks to its near-future rows)
    pb.on_evict(3)
    assert pb.victim(set()) == 2
    pb.on_insert(9, 7)                           # layer 2, no forecast: score 0
    pb.on_insert(8, 8)
    assert pb.victim(set()) == 9                 # score tie 0 -> least recently used
    pb.on_access(9, 9)
    assert pb.victim(set()) == 8
    assert pb.victim({8, 9}) == 2
    pb.on_step(request=1, step=0)                # new request: forecasts forgotten -> plain LRU
    assert pb.victim(set()) == 0


def test_prob_belady_ranked_victims_equal_a_full_scan():
    """The victim ranking reused between accesses picks exactly the resident, unpinned expert with the lowest
    (score, last use, id), over a random mix of forecasts, accesses, inserts, evictions and pinned sets."""
    rng = np.random.default_rng(7)
    pb = ProbabilisticBelady(num_experts=4, horizon=3)
    last, seq = {}, 0
    for _ in range(3000):
        op = rng.integers(6)
        if op == 0:
            pb.update_forecast((0, 3), np.round(rng.random((3, 3, 4)), 1))  # rounded: score ties happen
        elif op == 1 and pb.resident:
            e = int(rng.choice(sorted(pb.resident)))
            pb.on_access(e, 0)
            seq += 1
            last[e] = seq
        elif op == 2:
            e = int(rng.integers(14))
            if e not in pb.resident:
                pb.on_insert(e, 0)
                seq += 1
                last[e] = seq
        elif op == 3 and pb.resident:
            pb.on_evict(int(rng.choice(sorted(pb.resident))))
        elif op == 4 and rng.random() < 0.05:
            pb.on_step(request=0, step=0)
        elif pb.resident:
            pinned = {int(e) for e in sorted(pb.resident) if rng.random() < 0.4}
            free = [e for e in pb.resident if e not in pinned]
            if free:
                want = min(free, key=lambda e: (pb.score(e), last[e], e))
                assert pb.victim(pinned) == want


def test_prob_belady_in_slot_table():
    # 2 slots; experts 1 then 0 are loaded, then 2 misses: LRU would evict 1, the forecast evicts 0 (2.5 < 2.7)
    pb = make_pb()
    table = SlotTable(2, 12, pb)
    for needed in ([1], [0]):
        table.plan_layer(needed)
    plan = table.plan_layer([2])
    assert [ld.evicted for r in plan.rounds for ld in r.loads] == [0]
    assert sorted(pb.resident) == [1, 2]


def test_prob_belady_errors():
    with pytest.raises(MoeOffloadError):
        ProbabilisticBelady(num_experts=4, lam=1.0)
    with pytest.raises(MoeOffloadError):
        ProbabilisticBelady(num_experts=4, horizon=0)
    with pytest.raises(MoeOffloadError):
        make_pb().update_forecast((0, 3), FORECAST)       # n mismatch
    with pytest.raises(MoeOffloadError):
        make_pb().update_forecast((0, 2), FORECAST[0])    # missing the row axis


class _ReferenceJSD(JSDScheduler):
    """Algorithm 1 as written: the feasible set rebuilt by ``max_confidence_feasible`` at every selection."""

    def _choose(self, pos, capacity):
        entries = list(self._queue.values())
        kept = max_confidence_feasible((e[4] for e in entries), capacity or self.capacity)
        seq_of = {(e[4].eid, e[4].ddl): e[3] for e in entries}
        return min(kept, key=lambda t: (t.ddl, -t.conf, seq_of[(t.eid, t.ddl)])) if kept else None


@pytest.mark.parametrize("seed", range(12))
def test_jsd_reuses_its_feasible_set_exactly(seed):
    """JSDScheduler keeps its kept set between selections (core.jsd); on random queues — tied confidences,
    resubmitted tasks, drops, fractional and integral budgets, B_cur overrides — it selects exactly what rebuilding
    the set with max_confidence_feasible at every selection selects."""
    rng = np.random.default_rng(seed)
    b_avg = float(rng.choice([0.5, 1.0, 1.39, 2.0, 2.5, 3.7]))
    fast, ref = JSDScheduler(b_avg=b_avg), _ReferenceJSD(b_avg=b_avg)
    pos, picked = 0, 0
    for _ in range(60):
        tasks = [PrefetchTask(eid=int(rng.integers(40)), conf=float(rng.choice([0.1, 0.2, 0.25, 0.5, 0.9])),
                              ddl=pos + int(rng.integers(1, 12))) for _ in range(int(rng.integers(0, 15)))]
        for s in (fast, ref):
            s.submit(tasks)
        if rng.random() < 0.1:
            gone = rng.integers(40, size=3).tolist()
            assert fast.drop(gone) == ref.drop(gone)
        for _ in range(int(rng.integers(0, 5))):
            b_cur = float(rng.choice([0.5, 1.5, 3.0])) if rng.random() < 0.15 else None
            a, b = fast.select(pos, b_cur=b_cur), ref.select(pos, b_cur=b_cur)
            assert a == b
            picked += a is not None
        pos += int(rng.integers(0, 3))
    assert picked > 20
