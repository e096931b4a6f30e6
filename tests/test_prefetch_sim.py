"""Replay with prefetching over an emulated link (sim.prefetch_sim)."""

import torch

from moe_offload.predictor.features import psi
from moe_offload.predictor.runtime import Forecast
from moe_offload.sim.prefetch_sim import replay_with_prefetch
from moe_offload.sim.simulator import layer_needs, replay

from test_predictor import planted_trace


def oracle_forecasts(tr):
    """Perfect one-step forecasts from two "predictors", as the runtime has them: layers [0, 1) triggered at layer 0
    and layers [1, L) triggered at layer L - 1, each giving the true Psi of those layers at the next step."""
    L, E = tr.num_moe_layers, tr.num_experts
    steps = tr.steps()
    out = []
    for i, (req, step, a, b) in enumerate(steps):
        nxt = steps[i + 1] if i + 1 < len(steps) and steps[i + 1][0] == req else None
        if nxt is None:
            out.append([])
            continue
        _, _, c, d = nxt
        ids = torch.from_numpy(tr.expert_ids[c:d].astype("int64"))
        w = torch.from_numpy(tr.expert_weights[c:d].astype("float32"))
        probs = psi(ids, w, E).view(d - c, L, E).mean(0, keepdim=True)       # [1, L, E]
        out.append([(0, Forecast(req, step, (0, 1), probs[:, :1])),
                    (L - 1, Forecast(req, step, (1, L), probs[:, 1:]))])
    return out


def test_no_prefetch_equals_plain_replay_and_link_fraction():
    from moe_offload.cli import _link_fraction

    tr = planted_trace(requests=6, length=30, L=3, E=16, k=2)
    needs = layer_needs(tr)
    fc = oracle_forecasts(tr)
    for slots in (4, 12, 30):
        plain = replay(tr, slots, "seqmoe-cacheonly", needs=needs, forecasts=fc)
        pf = replay_with_prefetch(tr, slots, "seqmoe-cacheonly", 1.5, forecasts=fc, scheduler=None, needs=needs)
        assert (pf.hits, pf.misses, pf.decode_hits, pf.decode_misses) == (plain.hits, plain.misses,
                                                                          plain.decode_hits, plain.decode_misses)
        assert pf.prefetches == 0
        assert abs(pf.decode_fraction_of_full_load - _link_fraction(plain, tr, 1.5)) < 1e-12


def test_perfect_forecasts_and_fast_link_hide_every_decode_miss():
    # 24 of 48 slots: room for the k + 3 = 5 tasks per layer of both forecasts (15 protected) plus the reserve
    tr = planted_trace(requests=4, length=20, L=3, E=16, k=2)
    fc = oracle_forecasts(tr)
    base = replay_with_prefetch(tr, 24, "lru", 50.0, forecasts=fc, scheduler=None)
    for sched in ("jsd", "moe-infinity"):
        r = replay_with_prefetch(tr, 24, "seqmoe-cacheonly", 50.0, forecasts=fc, scheduler=sched)
        # only the first decode step of each request can miss (its forecast comes from the prefill)
        assert r.decode_misses <= 4 * tr.num_moe_layers * tr.top_k and r.decode_misses < base.decode_misses / 4, sched
        assert r.prefetches > 0 and r.prefetch_accuracy > 0.5
    assert base.decode_misses > 0
    # a slow link: prefetches land late (counted as misses, waited for, never loaded twice)
    slow = replay_with_prefetch(tr, 24, "seqmoe-cacheonly", 0.05, forecasts=fc, scheduler="jsd")
    assert slow.decode_misses > 0 and slow.decode_fraction_of_full_load < 1.0
