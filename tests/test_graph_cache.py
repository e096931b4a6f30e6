"""Graph mode's device-side slot table (``runtime.graph_cache.GraphCache``) makes exactly the decisions of
``core.slots.SlotTable`` with LRU, LFU and probabilistic Belady: same hits, misses, evicted experts, destination
slots and slot contents after every layer execution, over random traces with forecasts and request boundaries."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from moe_offload.core.policies import LFU, LRU
from moe_offload.core.prob_belady import ProbabilisticBelady
from moe_offload.core.slots import SlotTable
from moe_offload.errors import MoeOffloadError
from moe_offload.runtime.graph.cache import GraphCache, check_graph_policy

POLICIES = {"lru": LRU, "lfu": LFU, "prob-belady": lambda: ProbabilisticBelady(8, horizon=4, lam=0.5)}


def _route(rng: random.Random, tokens: int, E: int, k: int, hot: int) -> torch.Tensor:
    """``[tokens, k]`` distinct experts per token, skewed towards the first ``hot`` experts."""
    rows = []
    for _ in range(tokens):
        pool = list(range(hot)) if rng.random() < 0.7 else list(range(E))
        rows.append(rng.sample(pool, k) if len(pool) >= k else rng.sample(range(E), k))
    return torch.tensor(rows, dtype=torch.long)


def replay(kind: str, seed: int, S: int, L: int = 4, E: int = 8, k: int = 2, steps: int = 60) -> int:
    """Drive a SlotTable + policy and a GraphCache through the same trace; assert every decision equal.
    Returns the number of evictions seen (so a test can require that eviction was exercised)."""
    rng = random.Random(seed)
    policy = POLICIES[kind]()
    table = SlotTable(S, L * E, policy)
    cache = GraphCache(S, E, L, kind, horizon=4, lam=0.5)
    evictions, request = 0, 0
    for step in range(steps):
        if step % 20 == 0:  # a new request: prefill (many tokens), then decode steps of one token
            request, i = request + 1, 0
        i = step % 20
        table.begin_step(request, i)
        cache.begin_step(request, i)
        for layer in range(L):
            if kind == "prob-belady" and rng.random() < 0.5:  # a forecast for some layers
                lo = rng.randrange(L)
                hi = rng.randrange(lo + 1, L + 1)
                probs = np.round(np.random.default_rng(rng.randrange(1 << 30)).random((5, hi - lo, E)), 3)
                policy.update_forecast((lo, hi), probs)
                cache.update_forecast((lo, hi), torch.from_numpy(probs))
            top = _route(rng, 6 if i == 0 else 1, E, k, hot=3)
            gid = (top + layer * E).reshape(-1)
            uniq, counts = np.unique(gid.numpy(), return_counts=True)
            plan = table.plan_layer(uniq.tolist(), counts.tolist())
            hits0, misses0 = int(cache.hits), int(cache.misses)
            slot_ids, load_eids, load_slots, valid = cache.plan(layer, top)
            n = int(valid.sum())
            assert int(cache.hits) - hits0 == plan.hits and int(cache.misses) - misses0 == plan.misses
            loads = plan.rounds[0].loads
            assert len(plan.rounds) == 1 and n == len(loads)
            assert load_eids[:n].tolist() == [ld.eid for ld in loads]
            assert load_slots[:n].tolist() == [ld.slot for ld in loads]
            assert cache.slots_of() == table.expert_in
            assert slot_ids.tolist() == [table.slot_of[e] for e in gid.tolist()]
            evictions += sum(ld.evicted >= 0 for ld in loads)
    assert cache.lookup[:L * E].tolist() == table.slot_of
    return evictions


@pytest.mark.parametrize("kind", list(POLICIES))
@pytest.mark.parametrize("seed", range(4))
def test_same_decisions_as_slot_table(kind, seed):
    assert replay(kind, seed, S=8 + seed) > 20


def test_prob_belady_without_forecasts_is_lru():
    assert replay("prob-belady", 7, S=9, steps=40) > 0


def test_refusals():
    with pytest.raises(MoeOffloadError, match="supports the policies"):
        check_graph_policy("lfru", 64, 8)
    with pytest.raises(MoeOffloadError, match="at least one MoE layer"):
        check_graph_policy("lru", 4, 8)
