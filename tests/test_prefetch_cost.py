"""Prefetches at the price they are worth (issue 47, part 3; ``core.prefetch_cost``): the cost model, the gate in
``submit_forecast`` (runtime and simulator alike), ``+gate`` policies, and the runtime's meter."""

from types import SimpleNamespace

import numpy as np
import pytest

from moe_offload.core.policy_spec import parse_policy
from moe_offload.core.prefetch import JSDScheduler, position, submit_forecast
from moe_offload.core.prefetch_cost import CostMeter, PrefetchCost, UseLedger
from moe_offload.errors import MoeOffloadError
from moe_offload.generation.generate import encode_prompt, generate_ids
from moe_offload.models.loader import load_full, load_offloaded

PROMPT = "Hello there, how are you today? The slot pool is shared by all MoE layers."


def test_a_task_is_worth_its_copy_when_its_saving_exceeds_its_cost():
    """A miss stalls 2 ms, a prefetch copy takes 0.5 ms of CPU the compute loses: worth it above 25% confidence."""
    c = PrefetchCost(miss_s=2e-3, prefetch_cpu_s=0.5e-3)
    assert c.min_confidence == pytest.approx(0.25)
    assert c.worth(0.3) and not c.worth(0.25) and not c.worth(0.2)
    free = PrefetchCost(miss_s=2e-3, prefetch_cpu_s=0.5e-3, contention=0.0)  # a GPU's DMA engine: copies are free
    assert free.worth(0.01) and not free.worth(0.0)
    assert PrefetchCost(miss_s=1e-3, prefetch_cpu_s=2e-3).min_confidence == 2.0  # no prefetch is worth it
    for bad in (dict(miss_s=0.0, prefetch_cpu_s=0.0), dict(miss_s=1.0, prefetch_cpu_s=-1.0),
                dict(miss_s=1.0, prefetch_cpu_s=0.0, contention=1.5), dict(miss_s=float("nan"), prefetch_cpu_s=0.0)):
        with pytest.raises(MoeOffloadError):
            PrefetchCost(**bad)


def test_the_meter_averages_what_each_step_measured():
    m = CostMeter(alpha=0.5)
    m.observe(on_demand_experts=2, on_demand_wall_s=4e-3, prefetched_experts=0, prefetch_cpu_s=0.0)
    assert m.cost is None  # no prefetch measured yet: no gate
    m.observe(0, 0.0, 4, 2e-3)
    assert m.cost == PrefetchCost(2e-3, 0.5e-3, 1.0)
    m.observe(1, 1e-3, 0, 0.0)  # a step without prefetches leaves their average
    assert m.miss_s == pytest.approx(1.5e-3) and m.prefetch_cpu_s == pytest.approx(0.5e-3)
    with pytest.raises(MoeOffloadError):
        CostMeter(alpha=0.0)


def test_a_busy_link_and_unused_prefetches_raise_the_bar():
    """The same copy costs (2 ms miss, 0.5 ms of CPU): with the misses keeping the link busy half of the step and a
    wasted prefetch delaying a miss by half a read on average (a whole read at most, ``preempt`` 1), a task needs
    (0.25 + 0.25) / (0.5 + 0.25) = 2/3; when only half of what the forecasts promised is used, a forecast's chance
    must be 4/3 (no task passes)."""
    busy = PrefetchCost(miss_s=2e-3, prefetch_cpu_s=0.5e-3, link_busy=0.5)
    assert busy.min_confidence == pytest.approx(2 / 3)
    assert busy.worth(0.7) and not busy.worth(0.65)
    # the saving at 0.7: 0.7 x 2 x 0.5 = 0.7 ms > 0.5 + 0.3 x 2 x 0.5 x 0.5 = 0.65 ms
    halved = PrefetchCost(miss_s=2e-3, prefetch_cpu_s=0.5e-3, link_busy=0.5, used_scale=0.5)
    assert halved.min_confidence == pytest.approx(4 / 3) and not halved.worth(1.0) and halved.closed
    assert not PrefetchCost(miss_s=2e-3, prefetch_cpu_s=0.5e-3, link_busy=0.5, used_scale=0.8).closed
    shut = PrefetchCost(miss_s=2e-3, prefetch_cpu_s=0.5e-3, link_busy=0.75)
    assert shut.closed and not shut.worth(1.0) and not shut.worth(100.0)
    for bad in (dict(link_busy=1.5), dict(used_scale=0.0)):
        with pytest.raises(MoeOffloadError):
            PrefetchCost(miss_s=1.0, prefetch_cpu_s=0.0, **bad)


def test_a_wasted_prefetch_delays_a_miss_by_one_chunk_where_a_miss_preempts_it():
    """The busy link of the test above (2 ms miss, 0.5 ms of CPU, busy half of the step) where a miss waits at most
    a quarter of a read behind a prefetch (``preempt`` 0.25), an eighth on average: the waste term is (1 - c) x 2 x
    0.5 x 0.125 ms, and the threshold (0.25 + 0.0625) / (0.5 + 0.0625) = 5/9 (2/3 with a whole read). At 5/9 the
    saving 5/9 x 2 x 0.5 = 5/9 ms equals the cost 0.5 + 4/9 x 0.125 = 5/9 ms."""
    disk = PrefetchCost(miss_s=2e-3, prefetch_cpu_s=0.5e-3, link_busy=0.5, preempt=0.25)
    assert disk.threshold == pytest.approx(5 / 9) and disk.worth(0.56) and not disk.worth(0.55)
    whole = PrefetchCost(miss_s=2e-3, prefetch_cpu_s=0.5e-3, link_busy=0.5, preempt=1.0)
    assert whole.threshold == pytest.approx(2 / 3)
    # forecasts that promise more than is used (used_scale 0.65): the whole-read gate is shut, the chunk one is not
    assert PrefetchCost(2e-3, 0.5e-3, link_busy=0.5, used_scale=0.65).closed
    assert not PrefetchCost(2e-3, 0.5e-3, link_busy=0.5, used_scale=0.65, preempt=0.25).closed
    # a task sure to be used wastes nothing: the link's share alone decides (cpu / miss + busy >= 1), any preempt
    assert PrefetchCost(2e-3, 0.5e-3, link_busy=0.75, preempt=0.25).threshold == pytest.approx(1.0)
    assert CostMeter(alpha=1.0, preempt=0.25).preempt == 0.25
    for bad in (0.0, 1.5):
        with pytest.raises(MoeOffloadError, match="preempt"):
            PrefetchCost(miss_s=1.0, prefetch_cpu_s=0.0, preempt=bad)


def test_the_meter_measures_the_link_and_the_forecasts_calibration():
    m = CostMeter(alpha=1.0)
    # a 20 ms step waited 8 ms for 4 misses; of 4 candidates settled, given 0.9 each, 1 was used
    m.observe(4, 8e-3, 2, 1e-3, step_wall_s=20e-3, settled=(1, 3.6, 4))
    c = m.cost
    assert (c.miss_s, c.prefetch_cpu_s) == pytest.approx((2e-3, 0.5e-3))
    assert c.link_busy == pytest.approx(0.4) and c.used_scale == pytest.approx(0.25 / 0.9)
    assert c.min_confidence == pytest.approx((0.25 + 0.2) / (0.6 + 0.2) * 0.9 / 0.25)  # a miss waits half a read
    m.observe(4, 8e-3, 2, 1e-3, step_wall_s=20e-3, settled=(0, 0.9, 1))
    assert m.cost.used_scale == CostMeter.MIN_USED_SCALE


def test_the_ledger_settles_each_layers_latest_forecast():
    """Layer 2 is forecast twice; the newer candidates (experts 5 and 8, chances 0.8 and 0.4) replace the older;
    the layer runs needing 5 and 9: 1 of 2 used against 1.2 promised. A layer settles once; ``take`` empties the
    totals; ``clear`` forgets what is pending."""
    ledger = UseLedger()
    ledger.expect(2, [5, 6, 7], [0.9, 0.5, 0.2])
    ledger.expect(2, [5, 8], [0.8, 0.4])
    ledger.expect(3, [], [])
    ledger.settle(2, [5, 9])
    ledger.settle(2, [5, 8])   # nothing pending any more
    ledger.settle(3, [1])      # an empty forecast counts nothing
    assert ledger.take() == (1, pytest.approx(1.2), 2) and ledger.take() == (0, 0.0, 0)
    ledger.expect(4, [1], [1.0])
    ledger.clear()
    ledger.settle(4, [1])
    assert ledger.take() == (0, 0.0, 0)


def test_gate_policies_parse_and_print():
    spec = parse_policy("XL+gate")
    assert spec.gated and spec.family == "xl" and spec.name == "xl+gate" and spec.prefetch == "jsd"
    assert parse_policy(spec.name) == spec and not spec.graph and parse_policy("seqmoe").graph
    assert parse_policy("seqmoe+gate").needs_predictor
    with pytest.raises(MoeOffloadError, match="prefetch"):
        parse_policy("lru+gate")


def test_submit_forecast_queues_only_the_tasks_worth_their_cost():
    """One layer's forecast for the next step over 5 experts, a distribution (it sums to 1, as cross-layer forecasts
    do): with top-1 routing the tasks' chances of use are 0.4, 0.3, 0.2, 0.1, and the gate of the first test (25%)
    leaves out the two below it; with top-2 routing the same forecast means chances 0.8, 0.6, 0.4 (and 0.2 for the
    fourth, which only top-1's 3 extra tasks include)."""
    probs = np.array([[[0.4, 0.3, 0.2, 0.1, 0.0]]], dtype=np.float32)  # [rows, layers, experts]
    fc = SimpleNamespace(probs=probs, layers=(0, 1), step=0, cross_layer=False)
    sched = JSDScheduler(b_avg=4.0, auto_ema=False)
    submit_forecast(sched, fc, num_moe_layers=2, num_experts=5, top_k=1)
    assert len(sched) == 4 and sched.gated == 0
    gate = PrefetchCost(miss_s=2e-3, prefetch_cpu_s=0.5e-3)
    for top_k, kept, left_out in ((1, [0.3, 0.4], 2), (2, [0.2, 0.3, 0.4], 1)):
        gated = JSDScheduler(b_avg=4.0, auto_ema=False)
        gated.gate, gated.ledger = gate, UseLedger()
        submit_forecast(gated, fc, num_moe_layers=2, num_experts=5, top_k=top_k)
        assert gated.gated == left_out
        assert sorted(round(e[0], 2) for e in gated._queue.values()) == kept  # queued with their own confidence
        # every candidate goes to the ledger, refused or not, in chances of use: layer 0 of step 1 (position 0)
        # then needs experts 0 and 3
        gated.ledger.settle(0, [0, 3])
        assert gated.ledger.take() == (2, pytest.approx(1.0 * top_k), 4)
    shut = JSDScheduler(b_avg=4.0, auto_ema=False)
    shut.gate = PrefetchCost(miss_s=2e-3, prefetch_cpu_s=0.5e-3, link_busy=0.8)   # closed: no task is made
    shut.ledger = UseLedger()
    submit_forecast(shut, fc, num_moe_layers=2, num_experts=5, top_k=1)
    assert len(shut) == 0 and shut.gated == 4
    shut.ledger.settle(0, [1])
    assert shut.ledger.take() == (1, pytest.approx(1.0), 4)  # the closed gate still learns
    # a forecast made in step 1 for step 2 (SeqMoE's predictor) waits for step 2: layer 0 of step 1 settles nothing
    ahead = SimpleNamespace(probs=probs, layers=(0, 1), step=1, cross_layer=False)
    submit_forecast(shut, ahead, num_moe_layers=2, num_experts=5, top_k=1)
    shut.ledger.settle(position(1, 0, 2), [0])
    assert shut.ledger.take() == (0, 0.0, 0)
    shut.ledger.settle(position(2, 0, 2), [0])
    assert shut.ledger.take() == (1, pytest.approx(1.0), 4)


def test_gated_prefetching_from_disk_is_lossless_and_measures_its_costs(tiny_dirs):
    """xl+gate over the disk store: the tokens are FullLoad's, and the meter has measured both costs, which the
    scheduler gates by."""
    from moe_offload.predictor.cross_layer import attach_cross_layer

    full = load_full(tiny_dirs["qwen3_moe"])
    ids = encode_prompt(full.tokenizer, PROMPT)
    ref = generate_ids(full, ids, 16)[0]
    lm = load_offloaded(tiny_dirs["qwen3_moe"], device="cpu", residency=0.4, policy="xl+gate", progress=False,
                        host_store="disk")
    try:
        attach_cross_layer(lm, None)
        assert generate_ids(lm, ids, 16)[0] == ref
        pf = lm.engine.prefetcher
        assert pf.meter is not None and pf.meter.miss_s is not None and pf.meter.miss_s > 0
        st = pf.transfer.stats  # prefetches only: the on-demand copies the worker ran are not counted
        assert st.prefetch_copies <= pf.prefetches and st.prefetch_cpu_s >= 0
        if pf.meter.prefetch_cpu_s is not None:
            assert pf.scheduler.gate == pf.meter.cost
        assert lm.engine.policy_name == "xl+gate"
    finally:
        lm.close()
