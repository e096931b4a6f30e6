"""Graph mode's device-side slot table with prefetching (``runtime.graph_fetch_cache.FetchingGraphCache``) makes
exactly the decisions of ``core.slots.SlotTable`` with prefetching: the same reservations (slot, tag, evicted
expert), landings, adoptions of in-flight experts (and the tags waited for), hits, misses, on-demand loads, slot
states and slot contents, over random traces with random prefetch requests and copy completions."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from moe_offload.core.policies import LRU
from moe_offload.core.prob_belady import ProbabilisticBelady
from moe_offload.core.slots import SlotState, SlotTable
from moe_offload.errors import MoeOffloadError
from moe_offload.runtime.graph.fetch_cache import COMPUTE, EMPTY, FETCH, USED, FetchingGraphCache

POLICIES = {"lru": LRU, "prob-belady": lambda: ProbabilisticBelady(6, horizon=4, lam=0.5)}
CODES = {SlotState.EMPTY: EMPTY, SlotState.FETCH: FETCH, SlotState.COMPUTE: COMPUTE, SlotState.USED: USED}


def _route(rng: random.Random, tokens: int, E: int, k: int) -> torch.Tensor:
    rows = []
    for _ in range(tokens):
        pool = list(range(3)) if rng.random() < 0.6 else list(range(E))
        rows.append(rng.sample(pool, k) if len(pool) >= k else rng.sample(range(E), k))
    return torch.tensor(rows, dtype=torch.long)


def _same_state(table: SlotTable, cache: FetchingGraphCache) -> None:
    S = table.num_slots
    assert cache.slots_of() == table.expert_in
    assert cache.lookup[:-1].tolist() == table.slot_of
    assert cache.state[:S].tolist() == [CODES[table.state_of(s)] for s in range(S)]
    assert cache.tag[:S].tolist() == [table.tag_of(s) for s in range(S)]
    assert cache.in_flight() == sorted(table.fetching)


def replay(kind: str, seed: int, S: int, L: int = 4, E: int = 6, k: int = 2, steps: int = 40, R: int = 3):
    """Drive both through one trace; assert every decision equal. Returns (reservations, adoptions, landings,
    evictions by reservations) so a test can require that each was exercised."""
    rng = random.Random(seed)
    policy = POLICIES[kind]()
    table = SlotTable(S, L * E, policy, experts_per_layer=E, reserve=E)
    cache = FetchingGraphCache(S, E, L, kind, horizon=4, lam=0.5, max_requests=R)
    done_tag = torch.zeros(S, dtype=torch.long)
    copies: list[tuple[int, int, int]] = []  # (eid, slot, tag) reserved, not yet copied
    seen = dict(reserved=0, adopted=0, landed=0, evicted=0)
    request = 0
    for step in range(steps):
        if step % 10 == 0:
            request += 1
        i = step % 10
        table.begin_step(request, i)
        cache.begin_step(request, i)
        for layer in range(L):
            if kind == "prob-belady" and rng.random() < 0.5:
                lo = rng.randrange(L)
                hi = rng.randrange(lo + 1, L + 1)
                probs = np.round(np.random.default_rng(rng.randrange(1 << 30)).random((5, hi - lo, E)), 3)
                policy.update_forecast((lo, hi), probs)
                cache.update_forecast((lo, hi), torch.from_numpy(probs))
            # 1. some copies finish, in order (one worker); the table lands them by tag
            n_done = rng.randrange(min(len(copies), 2) + 1)
            for eid, slot, tag in copies[:n_done]:
                done_tag[slot] = tag
                seen["landed"] += table.land(eid, slot, tag)
            del copies[:n_done]
            cache.land(done_tag)
            _same_state(table, cache)
            # 2. the layer's plan (held)
            top = _route(rng, 4 if i == 0 else 1, E, k)
            gid = (top + layer * E).reshape(-1)
            uniq, counts = np.unique(gid.numpy(), return_counts=True)
            plan = table.plan_layer(uniq.tolist(), counts.tolist(), layer=layer, hold=True)
            h0, m0 = int(cache.hits), int(cache.misses)
            slot_ids, load_eids, load_slots, valid, wait_slots, wait_tags, wait_valid = cache.plan(layer, top)
            assert (int(cache.hits) - h0, int(cache.misses) - m0) == (plan.hits, plan.misses)
            assert len(plan.rounds) == 1
            rnd = plan.rounds[0]
            n = int(valid.sum())
            assert load_eids[:n].tolist() == [ld.eid for ld in rnd.loads]
            assert load_slots[:n].tolist() == [ld.slot for ld in rnd.loads]
            w = wait_valid.nonzero().flatten()
            assert [(int(wait_slots[j]), int(wait_tags[j])) for j in w] == [(x.slot, x.tag) for x in rnd.waits]
            seen["adopted"] += len(rnd.waits)
            assert slot_ids.tolist() == [table.slot_of[e] for e in gid.tolist()]
            _same_state(table, cache)
            # 3. prefetch requests: random experts of any layer, some resident, some repeated
            nxt = (layer + 1) % L  # mostly the next layer's popular experts (an adoption when one is still in flight)
            reqs = [nxt * E + rng.randrange(3) if rng.random() < 0.5 else rng.randrange(L * E)
                    for _ in range(rng.randrange(R + 1))]
            if reqs and rng.random() < 0.3:
                reqs[-1] = reqs[0]
            want = []
            for e in reqs:
                ld = table.prefetch(e)
                want.append(ld)
            eids = torch.tensor(reqs + [L * E] * (R - len(reqs)), dtype=torch.long)
            slots, tags, accepted = cache.reserve_slots(eids)
            for j, ld in enumerate(want):
                assert bool(accepted[j]) == (ld is not None)
                if ld is not None:
                    assert (int(slots[j]), int(tags[j])) == (ld.slot, ld.tag)
                    copies.append((ld.eid, ld.slot, ld.tag))
                    seen["reserved"] += 1
                    seen["evicted"] += ld.evicted >= 0
            assert not accepted[len(reqs):].any()
            # 4. release
            table.release(layer)
            cache.release(layer)
            _same_state(table, cache)
    return seen


@pytest.mark.parametrize("kind", list(POLICIES))
@pytest.mark.parametrize("seed", range(4))
def test_same_decisions_as_slot_table_with_prefetching(kind, seed):
    seen = replay(kind, seed, S=9 + seed)
    assert seen["reserved"] > 20 and seen["adopted"] > 0 and seen["landed"] > 10 and seen["evicted"] > 5


def test_refusals():
    with pytest.raises(MoeOffloadError, match="not LFU"):
        FetchingGraphCache(12, 4, 3, "lfu")
    with pytest.raises(MoeOffloadError, match="reserve in"):
        FetchingGraphCache(12, 4, 3, "lru", reserve=2)
    with pytest.raises(MoeOffloadError, match="reserve in"):
        FetchingGraphCache(4, 4, 3, "lru")
