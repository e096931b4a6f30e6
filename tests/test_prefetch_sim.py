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
    from moe_offload.sim.prefetch_sim import link_fraction

    tr = planted_trace(requests=6, length=30, L=3, E=16, k=2)
    needs = layer_needs(tr)
    fc = oracle_forecasts(tr)
    for slots in (4, 12, 30):
        plain = replay(tr, slots, "seqmoe-cacheonly", needs=needs, forecasts=fc)
        pf = replay_with_prefetch(tr, slots, "seqmoe-cacheonly", 1.5, forecasts=fc, scheduler=None, needs=needs)
        assert (pf.hits, pf.misses, pf.decode_hits, pf.decode_misses) == (plain.hits, plain.misses,
                                                                          plain.decode_hits, plain.decode_misses)
        assert pf.prefetches == 0
        assert abs(pf.decode_fraction_of_full_load - link_fraction(plain, tr, 1.5)) < 1e-12


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


def _hand_trace():
    """One request, L = 2 MoE layers, E = 4 experts, k = 1: a 3-token prefill (layer 0 uses experts 0, 1, 2; layer 1
    uses 3, 3, 2) and one decode step (experts 0 and 3)."""
    import numpy as np

    from moe_offload.trace.format import Trace

    ids = np.array([[[0], [3]], [[1], [3]], [[2], [2]], [[0], [3]]], dtype=np.int16)
    header = {"model_id": "hand", "model_type": "hand", "num_moe_layers": 2, "num_experts": 4, "top_k": 1,
              "synthetic": True, "requests": [{"prompt_tokens": 3, "decode_steps": 1}], "source": "hand-made"}
    return Trace(header, ids, np.ones(ids.shape, np.float16), np.zeros(4, np.int32),
                 np.array([0, 0, 0, 1], np.int32), np.arange(3, dtype=np.int32))


def test_prefill_offloading_hand_worked():
    """SeqMoE §8.4 on a hand-worked prefill, 8 slots (all 8 experts fit), link 2 experts per layer time (d = 0.5).

    Layer 0: experts 0, 1, 2 miss and load on demand (link busy until t = 1.5, the layer computes 1.5 -> 2.5).
    Popularity of layer 1 is [0, 0, 5, 9]: candidates after layer 0 are eids 7 (expert 3) then 6 (expert 2). With
    reserve e = 4, at most 8 - 4 = 4 slots may be in Fetch/Compute: layer 0's three Compute slots + eid 7 = 4, so
    eid 7 is prefetched (lands at t = 2.0) and eid 6 is refused. Layer 1 (t = 2.5): 7 hits, 6 misses.
    Prefill: 1 hit, 4 misses (without the profile: 0 hits, 5 misses)."""
    from moe_offload.core.prefill_prefetch import PrefillPrefetch

    tr = _hand_trace()
    none = [[], []]
    pop = [[1, 1, 1, 0], [0, 0, 5, 9]]
    r = replay_with_prefetch(tr, 8, "lru", 2.0, forecasts=none, scheduler="jsd", prefill_popularity=pop)
    assert (r.hits - r.decode_hits, r.misses - r.decode_misses) == (1, 4)
    assert r.prefill_prefetches == 1 == r.prefetches
    base = replay_with_prefetch(tr, 8, "lru", 2.0, forecasts=none, scheduler="jsd")
    assert (base.hits - base.decode_hits, base.misses - base.decode_misses) == (0, 5)
    assert list(PrefillPrefetch(pop, 2, 4).candidates(-1)) == [0, 1, 2, 7, 6]
    assert list(PrefillPrefetch(pop, 2, 4).candidates(0)) == [7, 6]
    assert list(PrefillPrefetch(pop, 2, 4).candidates(1)) == []


def test_prefill_popularity_errors():
    import pytest

    from moe_offload.core.prefill_prefetch import PrefillPrefetch
    from moe_offload.errors import MoeOffloadError

    with pytest.raises(MoeOffloadError, match="shape"):
        PrefillPrefetch([[1, 2]], 2, 4)
    with pytest.raises(MoeOffloadError, match="non-negative"):
        PrefillPrefetch([[1, -1], [0, 0]], 2, 2)


def test_bench_decode_replays_the_routing_of_its_own_runs(tiny_dirs, capsys):
    """`bench decode` records the routing of its requests once (the warm-up request, then the prompts, numbered
    apart) and replays it for every row: for LRU the replay's counts over the measured requests are the runtime's
    own, exactly; with an emulated link every row shows the simulator's fraction of FullLoad beside the measured
    one."""
    from moe_offload.bench.decode import _measure, _record_routing
    from moe_offload.cli import main
    from moe_offload.models.loader import load_offloaded

    d, prompts = tiny_dirs["mixtral"], ["hello world how are you", "the cat sat on the mat"]
    tr = _record_routing(d, prompts, 6, None, None)
    assert [r["decode_steps"] for r in tr.header["requests"]] == [5, 5, 5]
    assert sorted(set(tr.request.tolist())) == [0, 1, 2]
    lm = load_offloaded(d, residency=0.5, policy="lru", progress=False)
    _, s = _measure(lm, prompts, 6, False)
    res = replay(tr, lm.engine.pool.num_slots, "lru")
    measured = res.per_step.request >= 1
    assert (int(res.per_step.hits[measured].sum()), int(res.per_step.misses[measured].sum())) == \
        (s.offload.hits, s.offload.misses)
    assert s.offload.misses > 0
    assert main(["bench", "decode", "--model", str(d), "--prompt", "hi there", "--max-new-tokens", "4", "--quiet",
                 "--residencies", "0.5", "--policy", "lru,lfu", "--link-regime", "rtx4090"]) == 0
    rows = [ln.split(" | ") for ln in capsys.readouterr().out.splitlines() if ln.startswith("| ")]
    assert rows[0][5] == "simulated vs FullLoad" and rows[1][5] == "1.000"     # FullLoad
    assert [r[0] for r in rows[2:4]] == ["| lru", "| lfu"] and all(0 < float(r[5]) <= 1 for r in rows[2:4])
    # the same with the waits skipped on a virtual clock: same decisions, FullLoad's tokens
    assert main(["bench", "decode", "--model", str(d), "--prompt", "hi there", "--max-new-tokens", "4", "--quiet",
                 "--residencies", "0.5", "--policy", "lru", "--link-regime", "rtx4090", "--emulated-waits",
                 "skip"]) == 0
    out = capsys.readouterr().out
    rows = [ln.split(" | ") for ln in out.splitlines() if ln.startswith("| lru")]
    assert "its waits skipped on a virtual clock" in out and 0 < float(rows[0][5]) <= 1 and rows[0][9] == "yes"


def test_core_costs_lengthen_each_decode_layer():
    """Issue 47 part 4: the forecasts' and management's time per decode layer, and each prefetch copy's CPU, are
    charged to the clock; with no scheduler the projection is ``link_fraction``'s with the same overhead."""
    import pytest

    from moe_offload.sim.prefetch_sim import CoreCosts, link_fraction

    tr = planted_trace(requests=4, length=20, L=3, E=16, k=2)
    needs = layer_needs(tr)
    fc = oracle_forecasts(tr)
    plain = replay(tr, 12, "seqmoe-cacheonly", needs=needs, forecasts=fc)
    costs = CoreCosts(overhead=0.25)
    pf = replay_with_prefetch(tr, 12, "seqmoe-cacheonly", 1.5, forecasts=fc, scheduler=None, needs=needs, costs=costs)
    assert pf.decode_overhead == pytest.approx(0.25 * pf.decode_layers)
    assert pf.decode_fraction_of_full_load == pytest.approx(link_fraction(plain, tr, 1.5, costs))
    assert link_fraction(plain, tr, 1.5, costs) < link_fraction(plain, tr, 1.5)
    # prefetch copies: each started in a decode step costs its CPU there
    free = replay_with_prefetch(tr, 24, "seqmoe-cacheonly", 2.0, forecasts=fc, scheduler="jsd", needs=needs)
    paid = replay_with_prefetch(tr, 24, "seqmoe-cacheonly", 2.0, forecasts=fc, scheduler="jsd", needs=needs,
                                costs=CoreCosts(prefetch_cpu=0.1))
    assert free.decode_overhead == 0.0 and paid.prefetches > 0
    assert paid.decode_overhead == pytest.approx(0.1 * paid.decode_prefetches) and paid.decode_prefetches > 0
    assert paid.decode_fraction_of_full_load < free.decode_fraction_of_full_load
    with pytest.raises(Exception, match="overhead"):
        CoreCosts(overhead=-1.0)
    # a staging copy after each read keeps the copy engine busy: every miss stalls 1 / link_epl + copy
    slow = CoreCosts(copy=0.5)
    staged = replay_with_prefetch(tr, 12, "seqmoe-cacheonly", 1.5, forecasts=fc, scheduler=None, needs=needs,
                                  costs=slow)
    layers = staged.decode_layers
    assert staged.decode_stall == pytest.approx(staged.decode_misses * (1 / 1.5 + 0.5))
    assert staged.decode_fraction_of_full_load == pytest.approx(layers / (layers + staged.decode_stall))
    assert link_fraction(plain, tr, 1.5, slow) == pytest.approx(staged.decode_fraction_of_full_load)


def test_the_simulated_gate_measures_as_the_runtime_does():
    """A ``+gate`` policy in the simulator: the runtime's ``CostMeter`` fed each decode step's measurements; copies
    whose CPU exceeds any saving close the gate after the first measured step, free ones keep it open."""
    tr = planted_trace(requests=4, length=20, L=3, E=16, k=2)
    needs = layer_needs(tr)
    fc = oracle_forecasts(tr)
    from moe_offload.sim.prefetch_sim import CoreCosts

    # 10 slots and a slow link: decode steps miss, so the meter measures a miss's stall
    open_ = replay_with_prefetch(tr, 10, "seqmoe+gate", 0.5, forecasts=fc, scheduler="jsd", needs=needs)
    ungated = replay_with_prefetch(tr, 10, "seqmoe", 0.5, forecasts=fc, scheduler="jsd", needs=needs)
    assert ungated.decode_misses > 0 and ungated.decode_prefetches > 0
    assert open_.decode_prefetches > ungated.decode_prefetches / 2
    dear = replay_with_prefetch(tr, 10, "seqmoe+gate", 0.5, forecasts=fc, scheduler="jsd", needs=needs,
                                costs=CoreCosts(prefetch_cpu=5.0))
    assert 0 < dear.decode_prefetches < ungated.decode_prefetches / 4


def test_bench_decode_charges_each_row_the_costs_it_measured(monkeypatch):
    """``bench.decode.core_costs`` by hand: a 2 ms layer time, 30 layers; 6 ms of predictor + management per step
    -> 0.1 layer times per layer; a prefetch copy's 1 ms of CPU on both cores -> 0.5; 10 ms of staging copies per
    step over 4 experts copied (2 on demand, 2 prefetched) -> 1.25."""
    import pytest
    import torch

    from moe_offload.bench.decode import core_costs

    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    bd = {"ms_per_step": {"predictor": 4.0, "management": 2.0, "stall": 50.0},
          "prefetch_cpu_s_per_copy": 1e-3,
          "cpu_account": {"ms_per_step": {"main": {"compute": {"cpu": 40.0, "wall": 40.0}},
                                          "copy worker": {"staging_copies": {"cpu": 9.0, "wall": 10.0}}},
                          "bytes_per_step": {"on_demand": 200.0, "prefetched": 200.0}}}
    c = core_costs(bd, 2e-3, 30, expert_bytes=100)
    assert (c.overhead, c.prefetch_cpu, c.copy) == pytest.approx((0.1, 0.5, 1.25))
    assert core_costs({}, 2e-3, 30, expert_bytes=100).copy == 0.0


def test_bench_decode_models_the_disk_as_the_baseline_read_it():
    """``bench.decode.loaded_disk_links`` by hand, a 2 ms layer time: lru's misses took 1.6 ms per expert read at 25%
    (no staging copy) -> 1 / 0.8 = 1.25 experts per layer time, and 1.0 ms at 45% with a staging copy of 0.1 layer
    times, which the simulator charges apart -> 1 / (0.5 - 0.1) = 2.5; every row at those residencies gets them,
    whatever its own reads (xl+gate's share the disk with its prefetches); a residency where lru read nothing keeps
    the idle disk's 2.0. A prefetching baseline, or none, leaves every row on the idle disk."""
    import pytest

    from moe_offload.bench.decode import loaded_disk_links
    from moe_offload.core.policy_spec import parse_policy
    from moe_offload.sim.prefetch_sim import CoreCosts

    bds = [("lru", 0.25, {"demand_read_s": 1.6e-3, "demand_gbps": 1.6}), ("lru", 0.45, {"demand_read_s": 1e-3}),
           ("xl+gate", 0.25, {"demand_read_s": 3e-3}), ("xl+gate", 0.45, {}), ("lru", 1.0, {})]
    costs = [CoreCosts(), CoreCosts(copy=0.1), CoreCosts(), CoreCosts(copy=0.1), CoreCosts()]
    links, words = loaded_disk_links(bds, parse_policy("lru"), 2.0, 2e-3, costs)
    assert links == pytest.approx([1.25, 2.5, 1.25, 2.5, 2.0])
    assert "lru's on-demand reads" in words and "1.60 ms per expert read (1.60 GB/s) at 0.25" in words
    for base in (parse_policy("xl"), None):
        assert loaded_disk_links(bds, base, 2.0, 2e-3, costs) == ([2.0] * 5,
                                                                  "; the simulated column models the same link")


def test_a_miss_waits_behind_a_prefetch_for_the_share_preempt_says():
    """``preempt``: the share of one copy an on-demand copy waits behind a prefetch in flight (the emulated link's
    1 / LINK_CHUNKS by default; the disk tier reads a prefetch of up to ``PREFETCH_CHUNK`` bytes in one request, so
    ``bench decode --host-store disk`` passes ``DiskStore``'s share, 1 for its testbed experts). Waiting for whole
    copies never stalls less; a share outside (0, 1] is refused."""
    import pytest

    from moe_offload.core.prefetch import LINK_CHUNKS
    from moe_offload.errors import MoeOffloadError
    from moe_offload.runtime.disk_store import PREFETCH_CHUNK, preempt_share
    from moe_offload.sim.prefetch_sim import CoreCosts, replay_policy

    tr = planted_trace(requests=4, length=20, L=3, E=16, k=2)
    needs = layer_needs(tr)
    fc = oracle_forecasts(tr)
    runs = {p: replay_with_prefetch(tr, 10, "seqmoe", 0.5, forecasts=fc, scheduler="jsd", needs=needs, preempt=p)
            for p in (1.0 / LINK_CHUNKS, 0.5, 1.0)}
    default = replay_with_prefetch(tr, 10, "seqmoe", 0.5, forecasts=fc, scheduler="jsd", needs=needs)
    assert default.decode_stall == runs[1.0 / LINK_CHUNKS].decode_stall
    assert runs[1.0 / LINK_CHUNKS].decode_prefetches > 0
    assert runs[1.0 / LINK_CHUNKS].decode_stall <= runs[0.5].decode_stall <= runs[1.0].decode_stall
    assert runs[1.0 / LINK_CHUNKS].decode_stall < runs[1.0].decode_stall
    for bad in (0.0, 1.5):
        with pytest.raises(MoeOffloadError, match="preempt"):
            replay_with_prefetch(tr, 10, "seqmoe", 0.5, forecasts=fc, scheduler="jsd", needs=needs, preempt=bad)
    # replay_policy passes it on, to the link and to a +gate policy's cost meter (its gate weighs a wasted prefetch's
    # delay to a miss by it), and the default is the emulated link's
    costs = CoreCosts(prefetch_cpu=0.05)
    gated = {p: replay_policy(tr, "seqmoe+gate", 10, 0.5, forecasts=fc, needs=needs, costs=costs, preempt=p)[0]
             for p in (1.0 / LINK_CHUNKS, 1.0)}
    plain = replay_policy(tr, "seqmoe+gate", 10, 0.5, forecasts=fc, needs=needs, costs=costs)[0]
    assert plain.decode_prefetches == gated[1.0 / LINK_CHUNKS].decode_prefetches
    assert plain.decode_stall == gated[1.0 / LINK_CHUNKS].decode_stall
    assert gated[1.0].decode_prefetches != gated[1.0 / LINK_CHUNKS].decode_prefetches
    assert preempt_share(PREFETCH_CHUNK, 2654208) == 1.0 and preempt_share(1 << 20, 4 << 20) == 0.25
    assert preempt_share(1 << 20, 0) == 1.0
