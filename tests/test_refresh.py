"""TIDE decision core: cost model, activation tracking, stability estimate, interval optimiser, planners, traces."""

import json

import numpy as np
import pytest

from moe_offload.core.costs import TideCosts
from moe_offload.core.refresh import (ActivationTracker, IntervalOptimiser, RefreshPlanner, StabilityEstimator,
                                      TidePlanner, make_refresh_planner, select_top)
from moe_offload.errors import MoeOffloadError
from moe_offload.trace.diffusion import DiffusionTrace, load_diffusion_trace, stability_profile
from moe_offload.trace.diffusion_synthetic import synthetic_diffusion_trace

# ------------------------------------------------------------------------------------------------ cost model


def test_costs_from_numbers_and_profiles():
    c = TideCosts.from_numbers(6_000_000, link_gbps=24.0, fallback_token_s=1e-5)
    assert c.swap_s == pytest.approx(6e6 / 24e9)
    assert c.fallback_time(10, 2) == pytest.approx(1e-4)
    assert c.layer_time(1.0, 2.0) == 3.0 and c.with_overrides(overlap_host=True).layer_time(1.0, 2.0) == 2.0
    with pytest.raises(MoeOffloadError, match="exactly one"):
        TideCosts.from_numbers(1, swap_s=1.0, link_gbps=1.0)
    with pytest.raises(MoeOffloadError, match=">= 0"):
        TideCosts.from_numbers(1, swap_s=1.0, fallback_token_s=-1.0)
    r = TideCosts.from_profiles("rtx4090", "llada2.0-mini")
    # 3 x 2048 x 512 bf16 = 6,291,456 B over 25.6 GB/s
    assert r.swap_s == pytest.approx(6_291_456 / 25.6e9)
    assert (r.num_moe_layers, r.num_experts, r.top_k) == (19, 256, 8)
    h = TideCosts.from_profiles("h200", "llada2.0-mini")
    assert h.swap_s < r.swap_s and h.device_expert_s < r.device_expert_s and h.nonexpert_step_s > 0
    with pytest.raises(MoeOffloadError, match="lacks"):
        TideCosts.from_profiles("rtx4090", "qwen3-30b-a3b-fp8")  # that profile has no TIDE fields


# ------------------------------------------------------------------------------------------------ tracking


def test_select_top_positive_only_ties_by_id():
    assert select_top(np.array([0, 2, 1, 2, 0]), 2).tolist() == [1, 3]
    assert select_top(np.array([0, 2, 0, 0]), 3).tolist() == [1]  # zero-token experts are never selected
    assert select_top(np.zeros(3), 2).tolist() == []


def test_tracker_history_and_score():
    t = ActivationTracker(1, 4)
    t.observe(0, [2, 0, 0, 0])
    t.observe(0, [0, 1, 0, 1])
    assert t.history(0).tolist() == [[2, 0, 0, 0], [0, 1, 0, 1]]
    s = t.score(0)
    assert select_top(s, 3).tolist() == [1, 3, 0]  # last step first; expert 0 filled from older in-block counts
    t.begin_block()
    assert t.last(0) is None
    with pytest.raises(MoeOffloadError, match="shape"):
        t.observe(0, [1, 2])


def test_stability_estimator_hand_computed():
    # E = 4, budget 1, no prior. Step 0: counts [2,0,0,0] -> its set S0 = {0}.
    # Step 1: counts [1,1,0,0]: against S0 (d = 1) 1 of 2 token-experts misses (expert 1), 1 expert missed.
    # d = 0: step 0 misses 0 of 2; step 1's own set: score [1,1,0,0] + older tie-break -> {0}, misses 1 of 2.
    est = StabilityEstimator(4, 1, max_distance=3, prior_weight=0.0)
    t = ActivationTracker(1, 4)
    for c in ([2, 0, 0, 0], [1, 1, 0, 0]):
        t.observe(0, c)
        est.observe(np.array(c), t.score(0))
    mu, nu = est.curves()
    assert mu[0] == pytest.approx(1 / 4) and mu[1] == pytest.approx(1 / 2)
    assert nu[1] == pytest.approx(1.0)
    assert (np.diff(mu) >= 0).all()  # made non-decreasing
    assert est.turnover()[1] == pytest.approx(0.0)  # S1 = S0 = {0}
    # prior before any data: (1 - B/E) * (1 - rho^d)
    p = StabilityEstimator(4, 1, max_distance=3, prior_rho=0.5).curves()[0]
    assert p.tolist() == pytest.approx([0, 0.375, 0.5625, 0.65625])


# ------------------------------------------------------------------------------------------------ optimiser

# The constructed case shared by the optimiser tests:
#   E = 4 experts, budget B = 2, resident {0, 1}, reference counts = score = [0, 1, 3, 2]
#   -> S = top-2 = {2, 3}: load [2, 3] (most used first), evict [0, 1]; n = 2.
#   swap_s = 1.0 s per expert, fallback_token_s = 0.1 s, fallback_expert_s = 0.
#   M(d) = expected fallback seconds at distance d = [0, 0, 0.06, 0.12, 0.30, 0.60] (d = 0..5; d > 5 -> 0.60).
#   Landing cost of a new expert for one step = its count x 0.1: expert 2 -> 0.3, expert 3 -> 0.2.
COSTS = TideCosts.from_numbers(1, swap_s=1.0, fallback_token_s=0.1)
M = np.array([0.0, 0.0, 0.06, 0.12, 0.30, 0.60])
SCORE = np.array([0.0, 1.0, 3.0, 2.0])


def test_optimiser_hand_computed_long_steps():
    # step_s = 10: copies land at 1 s and 2 s -> each misses ceil(0.1) = ceil(0.2) = 1 step: landing = 0.5 for any
    # tau; exposed = max(0, 2 - 10 tau) = 0.
    # J(1) = 0.5/1 = 0.5     J(2) = (0.5 + 0.06)/2 = 0.28   J(3) = (0.5 + 0.18)/3 = 0.2267
    # J(4) = (0.5 + 0.48)/4 = 0.245   J(5) = (0.5 + 1.08)/5 = 0.316   J(6) = (0.5 + 1.68)/6 = 0.3633  -> tau = 3
    opt = IntervalOptimiser(COSTS, tau_max=6, modes=("async",))
    ch = opt.choose(SCORE, {0, 1}, 2, M, step_s=10.0)
    assert (ch.mode, ch.tau) == ("async", 3)
    assert ch.load == [2, 3] and ch.evict == [0, 1] and ch.target == [2, 3]
    want = {1: 0.5, 2: 0.28, 3: 0.68 / 3, 4: 0.245, 5: 0.316, 6: 2.18 / 6}
    assert ch.breakdown["candidates"]["async"] == pytest.approx(want)


def test_optimiser_hand_computed_exposed_swap_and_keep_rule():
    # step_s = 0.5: copy of expert 2 lands at 1 s -> missing ceil(1/0.5) = 2 steps; expert 3 at 2 s -> 4 steps.
    #   landing(tau) = 0.3 min(2, tau) + 0.2 min(4, tau) = 0.5, 1.0, 1.2, 1.4, 1.4, 1.4
    #   exposed(tau) = max(0, 2 - 0.5 tau)            = 1.5, 1.0, 0.5, 0,   0,   0
    #   sum M(1..tau)                                  = 0,   0.06, 0.18, 0.48, 1.08, 1.68
    #   J = total / tau = 2.0, 1.03, 0.6267, 0.47, 0.496, 0.5133                          -> tau = 4, J = 0.47
    opt = IntervalOptimiser(COSTS, tau_max=6, modes=("async",))
    ch = opt.choose(SCORE, {0, 1}, 2, M, step_s=0.5, age=4)
    assert (ch.mode, ch.tau) == ("async", 4)
    assert ch.per_step_s == pytest.approx(0.47)
    bd = ch.breakdown
    assert (bd["exposed_s"], bd["landing_s"], bd["miss_s"], bd["hidden_s"]) == pytest.approx((0.0, 1.4, 0.48, 2.0))
    assert bd["candidates"]["async"] == pytest.approx({1: 2.0, 2: 1.03, 3: 1.88 / 3, 4: 0.47, 5: 0.496,
                                                        6: 3.08 / 6})
    # keep rule: with the current set 4 steps old, keeping costs M(5) = 0.60 > 0.47 -> refresh (above);
    # with it fresh (age 0), keeping costs M(1) = 0 <= 0.47 -> keep, decide again next step.
    k = opt.choose(SCORE, {0, 1}, 2, M, step_s=0.5, age=0)
    assert (k.mode, k.tau, k.load, k.target) == ("keep", 1, [], [0, 1])
    # horizon: only 2 steps left in the block -> tau <= 2: J(2) = 1.03 < J(1) = 2.0
    h = opt.choose(SCORE, {0, 1}, 2, M, step_s=0.5, horizon=2)
    assert h.tau == 2


def test_optimiser_sync_mode_and_turnover():
    # sync: J(tau) = (n swap_s + sum M(0..tau-1)) / tau with n = 2:
    #   2, 1.0, 2.06/3 = 0.687, 2.18/4 = 0.545, 2.48/5 = 0.496, 3.08/6 = 0.513  -> tau = 5
    opt = IntervalOptimiser(COSTS, tau_max=6, modes=("sync",))
    ch = opt.choose(SCORE, {0, 1}, 2, M, step_s=0.5)
    assert (ch.mode, ch.tau) == ("sync", 5) and ch.per_step_s == pytest.approx(0.496)
    # both modes at step_s = 0.5: async tau 4 (0.47) beats sync tau 5 (0.496)
    both = IntervalOptimiser(COSTS, tau_max=6).choose(SCORE, {0, 1}, 2, M, step_s=0.5)
    assert (both.mode, both.tau) == ("async", 4)
    # stationary turnover (swaps charged to an interval of tau steps) = [0, 1, 1, 2, 2, 3, 3]:
    #   sync J = (1 + 0)/1 = 1, (1 + 0)/2 = 0.5, (2 + 0.06)/3, (2 + 0.18)/4, (3 + 0.48)/5, (3 + 1.08)/6 -> tau = 2
    t = opt.choose(SCORE, {0, 1}, 2, M, step_s=0.5, turnover=np.array([0, 1, 1, 2, 2, 3, 3.0]))
    assert (t.mode, t.tau) == ("sync", 2) and t.per_step_s == pytest.approx(0.5)
    with pytest.raises(MoeOffloadError):
        IntervalOptimiser(COSTS, modes=("later",))
    with pytest.raises(MoeOffloadError, match="step_s"):
        opt.choose(SCORE, {0, 1}, 2, M, step_s=0.0)


# ------------------------------------------------------------------------------------------------ planners


def drive(planner, steps, layer=0):
    """Run one block of single-layer steps; returns the decisions."""
    planner.begin_block(0, 0)
    out = []
    for s, c in enumerate(steps):
        assert planner.begin_step(s) is None
        out.append(planner.route(layer, np.array(c)))
        planner.end_step()
    return out


def test_tide_fixed_refreshes_every_T_hand_worked():
    # E = 6, budget 2, T = 2: refreshes at steps 0, 2, 4 from that step's own counts.
    p = make_refresh_planner("tide-fixed", 1, 6, 2, interval=2)
    steps = [[3, 0, 1, 0, 0, 0],   # refresh: top-2 = {0 (3), 2 (1)}: load [0, 2]; all on device
             [0, 2, 0, 1, 0, 0],   # no refresh: resident {0, 2}; experts 1 and 3 on the host
             [0, 2, 0, 1, 1, 0],   # refresh: top-2 = {1 (2), 3 (1; ties with 4 -> lower id)}: load [1, 3],
                                   #   demote [0, 2] (fewest tokens first, then lower id); expert 4 on the host
             [1, 1, 0, 0, 0, 0],   # no refresh: 1 on device (a hit), 0 on the host
             [0, 0, 0, 0, 0, 2]]   # refresh: only expert 5 has tokens: load [5], demote one resident (1:
                                   #   0 tokens, lower id than 3); 3 stays
    d = drive(p, steps)
    assert [x.transfer is not None for x in d] == [True, False, True, False, True]
    assert (d[0].transfer.load, d[0].transfer.evict, d[0].device, d[0].host) == ([0, 2], [], [0, 2], [])
    assert (d[1].device, d[1].host, d[1].hit_tokens, d[1].host_tokens) == ([], [1, 3], 0, 3)
    assert (d[2].transfer.load, sorted(d[2].transfer.evict), d[2].device, d[2].host) == ([1, 3], [0, 2], [1, 3], [4])
    assert d[2].transfer.blocking and d[2].hit_tokens == 0
    assert (d[3].device, d[3].host, d[3].hit_tokens) == ([1], [0], 1)
    assert (d[4].transfer.load, d[4].transfer.evict, p.resident(0)) == ([5], [1], frozenset({3, 5}))
    assert p.stats["swaps"] == 5 and p.stats["refreshes"] == 3
    # a new block restarts the step count: step 0 refreshes again
    p.begin_block(0, 1)
    p.begin_step(0)
    assert p.route(0, np.array([0, 0, 0, 4, 0, 0])).transfer is None  # {3} already resident: nothing to move


def test_reactive_hand_worked():
    # E = 4, budget 2, LRU; experts planned in ascending id order.
    p = make_refresh_planner("reactive", 1, 4, 2)
    steps = [[1, 1, 0, 0],   # misses 0, 1: load both
             [0, 1, 1, 0],   # hit 1 (1 token); miss 2 evicts the LRU unpinned expert 0
             [1, 0, 0, 2],   # misses 0 and 3: evict 1 (LRU), then 2
             [1, 1, 1, 0]]   # 3 experts > 2 slots: hit 0; rounds [0, 1] then [2]: load 1 (evict 3), load 2 (evict 0)
    d = drive(p, steps)
    assert [(x.transfer.load if x.transfer else []) for x in d] == [[0, 1], [2], [0, 3], [1, 2]]
    assert [(x.transfer.evict if x.transfer else []) for x in d] == [[], [0], [1, 2], [3, 0]]
    assert [x.hit_tokens for x in d] == [0, 1, 0, 1]
    assert all(x.host == [] for x in d)  # no host fallback
    assert p.stats["swaps"] == 7 and p.resident(0) == frozenset({1, 2})


def test_planner_call_order_errors():
    p = make_refresh_planner("tide-fixed", 1, 4, 2)
    with pytest.raises(MoeOffloadError, match="before begin_block"):
        p.begin_step(0)
    p.begin_block(0, 0)
    with pytest.raises(MoeOffloadError, match="before begin_step"):
        p.route(0, np.zeros(4, int))
    with pytest.raises(MoeOffloadError, match="count 0, 1"):
        p.begin_step(1)
    with pytest.raises(MoeOffloadError, match="unknown planner"):
        make_refresh_planner("lru", 1, 4, 2)
    with pytest.raises(MoeOffloadError, match="cost model"):
        make_refresh_planner("tide", 1, 4, 2)
    with pytest.raises(MoeOffloadError, match="budget"):
        make_refresh_planner("reactive", 1, 4, 5)
    assert make_refresh_planner("tide-fixed-T3", 1, 4, 2).interval == 3


def test_tide_planner_budget_invariant_and_prefetch_api():
    """Through a replay: |resident| + |in flight| <= budget at every route; a RefreshPlan's loads are in flight until
    land(); async transfers are non-blocking."""
    tr = synthetic_diffusion_trace(num_moe_layers=3, num_experts=32, top_k=4, requests=1, blocks=3, block_length=8,
                                   seed=1)
    costs = TideCosts.from_numbers(1, swap_s=1e-4, fallback_expert_s=2e-4, fallback_token_s=1e-5,
                                   device_expert_s=1e-5, nonexpert_step_s=1e-3, top_k=4)
    p = TidePlanner(3, 32, 8, costs, tau_max=6, on_demand=False)  # swaps win here: on_demand would not prefetch
    seen_async = False
    for _, block, a, b in tr.blocks():
        p.begin_block(0, block)
        for row in range(a, b):
            plan = p.begin_step(int(tr.step[row]))
            if plan is not None:
                for t in plan.transfers:
                    assert not t.blocking and set(t.load) <= p.in_flight(t.layer)
                    seen_async = seen_async or bool(t.load)
            for layer in range(3):
                dec = p.route(layer, tr.counts[row, layer])
                assert len(p.resident(layer)) + len(p.in_flight(layer)) <= 8
                # on-demand rounds may evict experts computed in an earlier round of the same step
                on_device_now = dec.device if dec.rounds is None else dec.rounds[-1].compute
                assert set(on_device_now) <= p.resident(layer) and not set(dec.host) & p.resident(layer)
                assert sorted(dec.device + dec.host) == list(np.flatnonzero(tr.counts[row, layer]))
                p.land(layer, list(p.in_flight(layer)))  # everything lands before the next layer (fast link)
            p.end_step(2e-3)
    assert seen_async and p.stats["prefetch_swaps"] > 0


def test_tide_on_demand_swap_or_fallback_hand_worked():
    """Per-miss choice: swap (1.0 s) when cheaper than the host fallback (0.5 s + 0.2 s per token), i.e. for misses
    with >= 3 tokens; swapped experts take free slots, then idle residents' slots, then (a later round) the slots
    of experts already computed this step, fewest tokens first; a synchronous refresh is the first round."""
    costs = TideCosts.from_numbers(1, swap_s=1.0, fallback_expert_s=0.5, fallback_token_s=0.2)
    p = TidePlanner(1, 6, 2, costs)
    p.begin_block(0, 0)
    # step 0: block-start sync refresh: top-2 = {0 (5), 3 (3)}; expert 2 (1 token: 0.7 s < 1 s) on the host
    assert p.begin_step(0) is None
    d = p.route(0, np.array([5, 0, 1, 3, 0, 0]))
    assert d.rounds is None and d.transfer.load == [0, 3] and d.host == [2]
    p.end_step()
    # step 1: a typical miss (3 tokens) costs 1.1 s on the host > 1 s: no asynchronous refresh; misses 4 (6) and
    # 5 (3) are swapped: 4 into idle expert 3's slot (round 0, computed with 0), 5 into 0's slot (round 1)
    assert p.begin_step(1) is None
    d = p.route(0, np.array([4, 0, 0, 0, 6, 3]))
    assert [(r.load, r.evict, r.compute) for r in d.rounds] == [([4], [3], [0, 4]), ([5], [0], [5])]
    assert d.transfer.load == [4, 5] and d.transfer.evict == [3, 0] and d.transfer.blocking
    assert d.device == [0, 4, 5] and d.host == [] and (d.hit_experts, d.hit_tokens) == (1, 4)
    assert p.resident(0) == {4, 5}
    p.end_step()
    # step 2: the only miss has 1 token: host
    assert p.begin_step(2) is None
    d = p.route(0, np.array([1, 0, 0, 0, 2, 0]))
    assert d.rounds is None and d.transfer is None and d.host == [0] and d.device == [4]
    p.end_step()
    # next block, step 0: sync refresh to {1, 2} (ties: lower id), then 3 (3 tokens) swapped into 1's slot
    p.begin_block(0, 1)
    assert p.begin_step(0) is None
    d = p.route(0, np.array([0, 3, 3, 3, 0, 0]))
    assert [(r.load, r.evict, r.compute) for r in d.rounds] == [([1, 2], [4, 5], [1, 2]), ([3], [1], [3])]
    assert d.host == [] and p.resident(0) == {2, 3}
    assert p.stats["swaps"] == 2 + 2 + 2 + 1


def test_full_budget_starts_as_fullload():
    for name in ("reactive", "tide-fixed"):
        p = make_refresh_planner(name, 1, 4, 4)
        d = drive(p, [[1, 2, 0, 1], [0, 0, 3, 1]])
        assert all(x.transfer is None and x.host == [] for x in d) and p.stats["swaps"] == 0


# ------------------------------------------------------------------------------------------------ traces


def small_trace():
    counts = [np.array([[2, 0, 1, 1], [1, 1, 1, 1]]), np.array([[1, 1, 1, 1], [0, 2, 2, 0]]),
              np.array([[2, 2, 0, 0], [1, 0, 2, 1]])]  # 3 steps, 2 layers, 4 experts, 2 tokens x top-2
    return DiffusionTrace.from_steps(counts, block=[0, 0, 1], step=[0, 1, 0], committed=[1, 1, 2], top_k=2,
                                     model_id="m", block_length=2)


def test_diffusion_trace_round_trip(tmp_path):
    tr = small_trace()
    assert tr.tokens.tolist() == [2, 2, 2] and tr.blocks() == [(0, 0, 0, 2), (0, 1, 2, 3)]
    path = tr.save(tmp_path / "t.safetensors")
    back = load_diffusion_trace(path)
    assert back.header["model_id"] == "m" and back.num_moe_layers == 2 and back.top_k == 2
    for name in ("counts", "request", "block", "step", "tokens", "committed"):
        assert np.array_equal(getattr(back, name), getattr(tr, name)), name
    with pytest.raises(MoeOffloadError, match="already exists"):
        tr.save(path)
    raw = (tmp_path / "t.safetensors").read_bytes()
    assert b"pickle" not in raw and json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])  # plain JSON header


def test_diffusion_trace_errors(tmp_path):
    good = [np.array([[1, 1, 0], [0, 1, 1]])]  # 1 token x top-2 per layer
    with pytest.raises(MoeOffloadError, match="sum to"):
        DiffusionTrace.from_steps([np.array([[1, 1, 0], [1, 0, 0]])], block=[0], step=[0], tokens=[1], top_k=2)
    with pytest.raises(MoeOffloadError, match="more tokens"):
        DiffusionTrace.from_steps([np.array([[2, 0, 0], [1, 1, 0]])], block=[0], step=[0], tokens=[1], top_k=2)
    with pytest.raises(MoeOffloadError, match="expected 1"):
        DiffusionTrace.from_steps(good * 2, block=[0, 0], step=[0, 2], top_k=2)
    with pytest.raises(MoeOffloadError, match="ordered"):
        DiffusionTrace.from_steps(good * 2, block=[1, 0], step=[0, 0], top_k=2)
    with pytest.raises(MoeOffloadError, match="no diffusion step"):
        DiffusionTrace.from_steps(np.zeros((0, 2, 3), int), block=[], step=[], top_k=2)
    with pytest.raises(MoeOffloadError, match="not found"):
        load_diffusion_trace(tmp_path / "missing.safetensors")
    (tmp_path / "junk").write_bytes(b"not a safetensors file")
    with pytest.raises(MoeOffloadError, match="not a readable"):
        load_diffusion_trace(tmp_path / "junk")
    from moe_offload.trace.synthetic import synthetic_trace

    ar = synthetic_trace(2, 8, 2, steps=2).save(tmp_path / "ar.safetensors")
    with pytest.raises(MoeOffloadError, match="not a moe-offload diffusion trace"):
        load_diffusion_trace(ar)


def test_synthetic_diffusion_trace_is_stable_and_deterministic():
    a = synthetic_diffusion_trace(num_moe_layers=2, num_experts=64, top_k=4, requests=1, blocks=2, block_length=16)
    b = synthetic_diffusion_trace(num_moe_layers=2, num_experts=64, top_k=4, requests=1, blocks=2, block_length=16)
    assert a.synthetic and np.array_equal(a.counts, b.counts) and a.committed.sum() == 2 * 16
    sp = stability_profile(a, 32, 4)
    assert sp["coverage"][0] > sp["coverage"][4] and sp["jaccard_next"] > 0.5  # stable, decaying with distance
    with pytest.raises(MoeOffloadError):
        synthetic_diffusion_trace(reuse_masked=1.5)


def test_planner_is_a_refresh_planner():
    assert issubclass(TidePlanner, RefreshPlanner)
