"""Probabilistic Belady following the layer cycle (``core.prob_belady``, ``layer_cycle=True``; the cross-layer
policies ``xl`` and ``seqmoe-xl``, issue 47): forecast rows consumed as their layers run, and the Belady order of
the experts without a forecast, on hand-worked event sequences and against a full scan."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from moe_offload.core.policy_spec import parse_policy
from moe_offload.core.prob_belady import ProbabilisticBelady, forecast_eviction
from moe_offload.errors import MoeOffloadError
from moe_offload.runtime.kernels import belady_scores_kernel, belady_victim_kernel


def _forecast(step: int, layers: tuple[int, int], probs) -> SimpleNamespace:
    return SimpleNamespace(step=step, layers=layers, probs=np.asarray(probs, dtype=np.float64))


def test_a_one_row_forecast_protects_its_experts_until_its_layer_runs():
    pb = ProbabilisticBelady(num_experts=4, horizon=8, lam=0.5, layer_cycle=True)
    pb.on_step(0, 1)
    pb.on_access(0, 1)                                        # layer 0 runs in step 1 ...
    pb.observe(_forecast(0, (1, 2), [[[0.7, 0.1, 0.1, 0.1]]]))  # ... and forecasts layer 1 for step 1
    assert [pb.score(e) for e in range(4, 8)] == pytest.approx([0.7, 0.1, 0.1, 0.1])
    pb.on_access(5, 2)                                        # layer 1 runs: its only row is the past
    assert [pb.score(e) for e in range(4, 8)] == [0.0] * 4
    pb.on_access(6, 2)                                        # a second expert of the same run changes nothing
    assert pb.score(4) == 0.0


def test_rows_of_a_multi_step_forecast_are_consumed_one_per_run():
    # rows of steps 2, 3, 4 (a forecast made in step 1, after layer 0 ran in it); c = 8, lambda = 0.5
    rows = [[[0.4, 0.6]], [[0.8, 0.2]], [[1.0, 0.0]]]
    pb = ProbabilisticBelady(num_experts=2, horizon=8, lam=0.5, layer_cycle=True)
    pb.on_step(0, 1)
    pb.on_access(0, 1)
    pb.observe(_forecast(1, (0, 1), rows))
    # not consumed in step 1: row 0 is step 2's; (4 * .4 + 2 * .8 + 1 * 1.0) / 7
    assert pb.score(0) == pytest.approx((1.6 + 1.6 + 1.0) / 7)
    pb.on_step(0, 2)
    pb.on_access(1, 2)                                        # step 2's run: rows of steps 3, 4 are left
    assert pb.score(0) == pytest.approx((2 * 0.8 + 1 * 1.0) / 3)
    assert pb.score(1) == pytest.approx((2 * 0.2 + 0.0) / 3)
    pb.on_step(0, 3)
    pb.on_access(1, 3)
    assert pb.score(0) == pytest.approx(1.0)
    pb.on_step(0, 4)
    pb.on_access(1, 4)
    assert pb.score(0) == 0.0                                 # all consumed: no forecast


def test_without_layer_cycle_a_forecast_scores_until_the_next_one():
    pb = ProbabilisticBelady(num_experts=4, horizon=8, lam=0.5)
    pb.on_step(0, 1)
    pb.observe(_forecast(0, (1, 2), [[[0.7, 0.1, 0.1, 0.1]]]))
    pb.on_access(5, 1)
    assert pb.score(4) == pytest.approx(0.7)


def test_experts_without_a_forecast_go_by_reuse_frequency_then_the_cycle_order():
    # 3 MoE layers of 2 experts (ids layer * 2 + e); no forecasts; half-life H = 4 steps
    pb = ProbabilisticBelady(num_experts=2, horizon=8, lam=0.5, layer_cycle=True, half_life=4.0)
    pb.on_step(0, 1)
    for e in (0, 1, 2, 4):                  # step 1: layer 0 uses 0 and 1, layer 1 uses 2, layer 2 uses 4
        pb.on_access(e, 1)
        pb.on_insert(e, 1)
    pb.on_step(0, 2)
    pb.on_access(1, 2)                      # step 2, layer 0 runs with expert 1 only
    # reuse frequency at its layer's last run, sum_i 2^-((r - s_i) / 4): layer 0 ran in step 2, layers 1 and 2 in
    # step 1; expert 0: 2^-(1/4) = 0.841; expert 1 (steps 1 and 2): 1.841; experts 2 and 4: 1. Layers ahead of
    # the running layer 0: layer 1 -> 1, layer 2 -> 2, layer 0 -> 3
    freq = lambda e: 2.0 ** (pb._crf[e] - pb._ran[e // 2] / 4.0)  # noqa: E731
    assert [freq(e) for e in (0, 1, 2, 4)] == pytest.approx([2 ** -0.25, 1 + 2 ** -0.25, 1.0, 1.0])
    assert pb.victim(set()) == 0            # not used at its layer's last run
    assert pb.victim({0}) == 4              # used once, as expert 2, but its layer runs after layer 1's
    assert pb.victim({0, 4}) == 2
    assert pb.victim({0, 2, 4}) == 1        # used at both runs: kept longest, though its layer runs again last
    pb.on_access(2, 2)                      # layer 1 runs with expert 2: 1.841 too, as expert 1; layer 2 is now
    assert pb.victim({0}) == 4              # 1 layer ahead (frequency 1), layer 0 2 layers, layer 1 itself 3
    assert pb.victim({0, 4}) == 2           # ties with expert 1: its layer runs again farther
    pb.on_step(0, 0)                        # a new request forgets the frequencies
    assert np.isneginf(pb._crf).all()


_VICTIM_KERNEL = belady_victim_kernel()
_SCORES_KERNEL = belady_scores_kernel()


@pytest.mark.parametrize("native", [False, True], ids=["numpy", "native"])
def test_cycle_ranked_victims_equal_a_full_scan(native):
    """The ranking reused between calls (numpy), and the native one-pass victim (``runtime.kernels``'
    ``belady_victim``, with the native one-row intake ``belady_scores``), pick exactly what a full scan of the
    cycle order picks, over random forecasts, steps,
    accesses (one at a time and a layer's at once, ``on_layer_access``; an expert may run twice in a step), inserts,
    evictions and pinned sets."""
    if native and _VICTIM_KERNEL is None:
        pytest.skip("the native kernels are not built here")
    rng = np.random.default_rng(11)
    E, L = 3, 4
    pb = ProbabilisticBelady(num_experts=E, horizon=3, lam=0.5, layer_cycle=True,
                             victim_kernel=_VICTIM_KERNEL if native else None,
                             scores_kernel=_SCORES_KERNEL if native else None)
    last, crf, ran, seq, step, cur, H = {}, {}, [-1] * L, 0, 1, 0, pb.half_life
    rows: dict[int, tuple[np.ndarray, int]] = {}
    pb.on_step(0, step)

    def score(e):
        p = e // E
        if p not in rows:
            return 0.0
        a, first = rows[p]
        done = max(0, ran[p] - first + 1)
        if done >= len(a):
            return 0.0
        w = 0.5 ** np.arange(min(len(a) - done, 3))
        return float((w / w.sum()) @ a[done:done + len(w), e % E])

    def use(e):                             # LFRU's log form of the reuse frequency (the policy's arithmetic)
        old = crf.get(e, -np.inf)
        crf[e] = step / H if old == -np.inf else step / H + math.log2(1.0 + 2.0 ** (old - step / H))

    for p in range(L):                      # every layer seen once, so the cycle's length is L from the start
        pb.on_access(p * E, 0)
        ran[p], cur = step, p
        use(p * E)
    for _ in range(3000):
        op = rng.integers(7)
        if op == 0:
            lo = int(rng.integers(L))
            hi = int(rng.integers(lo + 1, L + 1))
            a = np.round(rng.random((int(rng.integers(1, 4)), hi - lo, E)), 1)
            f = int(rng.integers(step - 1, step + 1))
            pb.observe(_forecast(f, (lo, hi), a))
            for p in range(lo, hi):
                rows[p] = (a[:, p - lo], f + 1)
        elif op == 1:
            p = int(rng.integers(L))
            many = rng.random() < 0.5
            eids = sorted({p * E + int(x) for x in rng.integers(E, size=int(rng.integers(1, E + 1)))}) if many \
                else [p * E + int(rng.integers(E))]
            if many:
                pb.on_layer_access([(e, 1) for e in eids], 0)
            else:
                pb.on_access(eids[0], 0)
            for e in eids:
                ran[p], cur = step, p
                use(e)
                if e in pb.resident:
                    seq += 1
                    last[e] = seq
        elif op == 2:
            e = int(rng.integers(L * E))
            if e not in pb.resident:
                pb.on_insert(e, 0)
                seq += 1
                last[e] = seq
        elif op == 3 and pb.resident:
            pb.on_evict(int(rng.choice(sorted(pb.resident))))
        elif op == 4 and rng.random() < 0.3:
            step += 1
            pb.on_step(0, step)
        elif pb.resident:
            pinned = {int(e) for e in sorted(pb.resident) if rng.random() < 0.4}
            free = [e for e in pb.resident if e not in pinned]
            if free:
                def key(e):
                    p = e // E
                    return (score(e), crf.get(e, -np.inf) - ran[p] / H, -((p - cur - 1) % L + 1), last[e], e)
                assert pb.victim(pinned) == min(free, key=key)


def test_native_intake_scores_as_numpy_does():
    """Float32 forecasts (the cross-layer forecaster's dtype) of one row and of several, and runs of their layers in
    between, through the native intake (``belady_scores``) and through numpy: the scores are identical bit for bit
    after every event, and so are the victims; a non-finite forecast is refused alike."""
    if _SCORES_KERNEL is None or _VICTIM_KERNEL is None:
        pytest.skip("the native kernels are not built here")
    rng = np.random.default_rng(5)
    E, L = 6, 5
    pbs = [ProbabilisticBelady(num_experts=E, horizon=3, lam=0.5, layer_cycle=True, victim_kernel=_VICTIM_KERNEL,
                               scores_kernel=kernel) for kernel in (None, _SCORES_KERNEL)]
    step = 1
    for pb in pbs:
        pb.on_step(0, step)
        for e in range(0, L * E, 2):
            pb.on_insert(e, 0)
    for _ in range(600):
        op = rng.integers(4)
        if op == 0:
            lo = int(rng.integers(L))
            hi = int(rng.integers(lo + 1, L + 1))
            rows = 1 if rng.random() < 0.7 else int(rng.integers(2, 4))
            probs = rng.random((rows, hi - lo, E)).astype(np.float32)
            f = SimpleNamespace(step=step - 1, layers=(lo, hi), probs=probs)
            for pb in pbs:
                pb.observe(f)
        elif op == 1:
            e = int(rng.integers(L * E))
            for pb in pbs:
                pb.on_access(e, 0)
        elif op == 2 and rng.random() < 0.3:
            step += 1
            for pb in pbs:
                pb.on_step(0, step)
        else:
            pinned = {int(e) for e in sorted(pbs[0].resident) if rng.random() < 0.3}
            assert pbs[0].victim(pinned) == pbs[1].victim(pinned)
        assert pbs[0]._score.tobytes() == pbs[1]._score.tobytes()
    bad = np.full((1, 1, E), np.nan, dtype=np.float32)
    beyond = np.full((1, 2, E), np.nan, dtype=np.float32)   # layers past the arrays' end: nothing may grow either
    sizes = [(pb._ran.size, pb._score.size) for pb in pbs]
    for pb in pbs:
        with pytest.raises(MoeOffloadError, match="non-finite"):
            pb.observe(SimpleNamespace(step=step - 1, layers=(0, 1), probs=bad))
        with pytest.raises(MoeOffloadError, match="non-finite"):
            pb.observe(SimpleNamespace(step=step - 1, layers=(L + 3, L + 5), probs=beyond))
    assert [(pb._ran.size, pb._score.size) for pb in pbs] == sizes


def test_the_cross_layer_policies_follow_the_cycle():
    assert forecast_eviction(parse_policy("xl"), 8).layer_cycle
    assert forecast_eviction(parse_policy("seqmoe-xl"), 8).layer_cycle
    assert forecast_eviction(parse_policy("xl+gate"), 8).name == "xl+gate"
    assert not forecast_eviction(parse_policy("seqmoe"), 8).layer_cycle


def test_native_victims_equal_numpy_without_the_cycle():
    """Without ``layer_cycle`` (seqmoe's order: score, last use, id) the native victim equals numpy's ranking over
    random multi-row forecasts, accesses, inserts, evictions and pinned sets; arrays of different lengths are a
    ValueError."""
    if _VICTIM_KERNEL is None:
        pytest.skip("the native kernels are not built here")
    rng = np.random.default_rng(5)
    E, L = 4, 3
    a = ProbabilisticBelady(num_experts=E, horizon=3, lam=0.5)
    b = ProbabilisticBelady(num_experts=E, horizon=3, lam=0.5, victim_kernel=_VICTIM_KERNEL)
    for _ in range(2000):
        op = rng.integers(5)
        if op == 0:
            f = _forecast(0, (0, L), np.round(rng.random((int(rng.integers(1, 4)), L, E)), 1))
            a.observe(f)
            b.observe(f)
        elif op == 1:
            p = int(rng.integers(L))
            pairs = [(p * E + e, 1) for e in sorted({int(x) for x in rng.integers(E, size=2)})]
            a.on_layer_access(pairs, 0)
            b.on_layer_access(pairs, 0)
        elif op == 2:
            e = int(rng.integers(L * E))
            if e not in a.resident:
                a.on_insert(e, 0)
                b.on_insert(e, 0)
        elif op == 3 and a.resident:
            e = int(rng.choice(sorted(a.resident)))
            a.on_evict(e)
            b.on_evict(e)
        elif a.resident:
            pinned = {int(e) for e in sorted(a.resident) if rng.random() < 0.4}
            if len(pinned) < len(a.resident):
                assert b.victim(pinned) == a.victim(pinned)
    with pytest.raises(ValueError):
        _VICTIM_KERNEL(np.zeros(3), np.zeros(2, dtype=np.int64), np.zeros(3, dtype=bool), np.zeros(1, dtype=np.int64),
                       np.zeros(3), set(), 0, 1, False, 4.0)
    with pytest.raises(ValueError):
        _VICTIM_KERNEL(np.zeros(3), np.zeros(3, dtype=np.int64), np.zeros(3, dtype=bool), np.zeros(1, dtype=np.int64),
                       np.zeros(3), set(), 0, 1, False, 0.0)
