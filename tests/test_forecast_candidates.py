"""A forecast's prefetch candidates (``core.prefetch_tasks.forecast_candidates``): the native kernel
(``runtime.kernels``' ``forecast_candidates``) finds the same ones as numpy, bit for bit, and the tasks the gated
submission makes with it are the same (issue 47, session 53)."""

import numpy as np
import pytest

from moe_offload.core.prefetch import JSDScheduler, submit_forecast
from moe_offload.core.prefetch_cost import PrefetchCost, UseLedger
from moe_offload.core.prefetch_tasks import forecast_candidates, prefetch_width
from moe_offload.errors import MoeOffloadError
from moe_offload.runtime.kernels import forecast_candidates_kernel

KERNEL = forecast_candidates_kernel()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="the native kernels are not built here")


def _rows(rng, n: int, e: int, dtype) -> np.ndarray:
    """Forecast rows with what a real forecast has: zeros (experts no router picks), exact ties, a row summing to 0,
    distributions and unnormalised activation probabilities."""
    a = rng.random((n, e))
    a[rng.random((n, e)) < 0.4] = 0.0
    a[:, 1] = a[:, 2]                               # a tie between two neighbours
    if n > 2:
        a[2] = 0.0                                  # nothing forecast: the sum is 0
        a[1] /= a[1].sum()                          # a distribution
    return a.astype(dtype)


class _Gate:
    """The two fields ``forecast_candidates`` reads of a ``PrefetchCost``, set freely."""

    def __init__(self, used_scale, threshold, closed=False):
        self.used_scale, self.threshold, self.closed = used_scale, threshold, closed


@needs_kernel
@pytest.mark.parametrize("e", [5, 8, 32, 130, 300])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_native_candidates_equal_numpys_bit_for_bit(e, dtype):
    """Experts, confidences, chances (numpy's pairwise row sums, below 8 terms, up to 128 and split beyond) and the
    gate's verdicts (open, at thresholds right on some chances, closed) are identical."""
    rng = np.random.default_rng(e)
    for trial in range(20):
        a = _rows(rng, 4, e, dtype)
        width = min(e, 1 + trial % 11)
        for gate in (None, _Gate(1.0, 0.3), _Gate(0.7, 0.0), _Gate(1.3, 0.99, closed=True)):
            for chances in (False, True):
                want = forecast_candidates(a, 4, e, width, 8, gate, chances)
                got = forecast_candidates(a, 4, e, width, 8, gate, chances, kernel=KERNEL)
                assert got == want
                if chances:
                    assert all(float(x).hex() == float(y).hex()
                               for rw, rg in zip(want[2], got[2]) for x, y in zip(rw, rg))


@needs_kernel
def test_native_candidates_hand_worked():
    """One row, worked by hand: the top 3 by confidence, the tie (experts 1 and 3 at 0.2) to the smaller index;
    chances scale the row to sum to k = 2 (sum 1.0): 0.4 * 2 = 0.8, 0.2 * 2 = 0.4; the gate at threshold 0.5 with
    used_scale 1 admits only the first."""
    row = np.array([[0.1, 0.2, 0.1, 0.2, 0.4]], dtype=np.float32)
    got = forecast_candidates(row, 1, 5, 3, 2, _Gate(1.0, 0.5), True, kernel=KERNEL)
    top, conf, chance, worth = got
    assert top == [[4, 1, 3]]
    assert conf == [[float(np.float32(0.4)), float(np.float32(0.2)), float(np.float32(0.2))]]
    assert worth == [[True, False, False]]
    assert got == forecast_candidates(row, 1, 5, 3, 2, _Gate(1.0, 0.5), True)
    assert chance[0][0] == pytest.approx(0.8, rel=1e-6)


@needs_kernel
def test_native_candidates_fall_back_to_numpys_errors():
    """A non-finite value, another shape or dtype: the kernel declines and numpy's path answers (its errors)."""
    bad = np.ones((2, 8), dtype=np.float32)
    bad[1, 3] = np.nan
    assert KERNEL(bad, 3, 2, True, 0, 1.0, 0.0) is None
    with pytest.raises(MoeOffloadError, match="non-finite"):
        forecast_candidates(bad, 2, 8, 3, 2, kernel=KERNEL)
    with pytest.raises(MoeOffloadError, match="cover 3 layers"):
        forecast_candidates(np.ones((2, 8), dtype=np.float32), 3, 8, 3, 2, kernel=KERNEL)
    ints = np.arange(16).reshape(2, 8)
    assert KERNEL(ints, 3, 2, False, 0, 1.0, 0.0) is None
    assert forecast_candidates(ints, 2, 8, 3, 2, kernel=KERNEL) == forecast_candidates(ints, 2, 8, 3, 2)


class _Forecast:
    def __init__(self, probs, layers, step):
        self.probs, self.layers, self.step, self.cross_layer = probs, layers, step, True


@needs_kernel
def test_gated_submission_with_the_kernel_queues_the_same_tasks():
    """``submit_forecast`` of cross-layer forecasts through a gate and a ledger: the same queued tasks (eid,
    confidence, deadline), the same refusals and the same ledger entries with the kernel as without."""
    L, E, k = 6, 32, 8
    runs = []
    for kernel in (None, KERNEL):
        s = JSDScheduler(b_avg=2.0)
        s.candidates_kernel = kernel
        s.gate = PrefetchCost(prefetch_cpu_s=3e-4, miss_s=1e-3, link_busy=0.3, contention=1.0, preempt=1.0,
                              used_scale=0.9)
        s.ledger = UseLedger()
        rng2 = np.random.default_rng(7)
        for layer in range(L - 2):
            probs = _rows(rng2, 2, E, np.float32)[None]
            submit_forecast(s, _Forecast(probs, (layer + 1, layer + 3), 1), L, E, k)
        runs.append(([(t.eid, t.conf, t.ddl) for t in s.pending()], s.gated, dict(s.ledger._pending)))
    assert runs[0] == runs[1]
    assert runs[0][0] and runs[0][1] > 0  # some tasks queued, some refused
    assert prefetch_width(E, k) == 11


def _canon(got):
    """``forecast_candidates``' lists with each float as its hex string (a NaN compares equal to a NaN)."""
    return [None if part is None else [[float(x).hex() if isinstance(x, float) else x for x in row] for row in part]
            for part in got]


@needs_kernel
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's overflow and inf / inf, on the overflowing row
def test_native_candidates_on_odd_inputs():
    """A float64 row whose sum overflows (its chances NaN, the gate refusing them, as numpy's minimum keeps a NaN), a
    Fortran-order array and a strided view: the same lists as numpy's."""
    big = np.full((2, 8), 1e308)
    big[1] = np.arange(8.0)
    gate = _Gate(1.0, 0.2)
    want = forecast_candidates(big, 2, 8, 3, 2, gate, True)
    assert np.isnan(want[2][0][0]) and want[3][0] == [False, False, False]
    assert _canon(forecast_candidates(big, 2, 8, 3, 2, gate, True, kernel=KERNEL)) == _canon(want)
    rng = np.random.default_rng(3)
    a = rng.random((3, 16)).astype(np.float32)
    for odd in (np.asfortranarray(a), rng.random((3, 32)).astype(np.float32)[:, ::2]):
        assert not odd.flags.c_contiguous
        assert _canon(forecast_candidates(odd, 3, 16, 5, 4, gate, True, kernel=KERNEL)) == \
            _canon(forecast_candidates(odd, 3, 16, 5, 4, gate, True))
