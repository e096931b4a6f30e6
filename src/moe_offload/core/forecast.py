"""A forecast of expert activations, the type every forecaster hands the decision core (SeqMoE §6.1, §7.1): the
seq2seq predictor (``predictor.runtime``), the cross-layer forecasts (``predictor.cross_layer``) and graph mode's
prefetch worker make one; probabilistic Belady (``core.prob_belady``) and the prefetch schedulers
(``core.prefetch_queue.submit_forecast``) read it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: recursive steps after each one-step prediction for the forecast-driven policies: with the one-step row, the c = 8
#: CacheScore rows of SeqMoE §7.1 (§9.1)
ROLLOUT = 7
#: decode steps between recursive rollouts (``PredictorRunner.rollout_every``), chosen by measurement (issue 17,
#: docs/notes/benchmark-history.md, "Runtime decode under the emulated link"): the simulator's hit rate against the
#: rollout's cost per step
ROLLOUT_EVERY = 4
#: d, the number of later MoE layers each MoE layer forecasts (``runtime.cross_layer``; default of ``--xl-depth``).
#: 2: the next layer's row serves eviction only (its tasks could not land in time: ``core.prefetch_queue``'s
#: ``submit_forecast``) and the one after it is prefetched. A third row, forecast again one layer later from a nearer
#: hidden state, moved the simulated speed by -0.3% to +4% of lru's and cost ~1.4 ms of a ~130 ms decode step
#: (testbed-sparse-wide; issue 47, session 50, docs/benchmarks.md)
XL_DEPTH = 2


@dataclass
class Forecast:
    """One predictor's latest forecast.

    Attributes:
        request: request index.
        step: the generation step whose activations were consumed last (0 = prefill, i = decode step i).
        layers: ``(l, l')``, the MoE layers forecast.
        probs: float32 ``[1 + c, n, e]``: row j is the per-layer probability of each expert being activated at
            step ``step + 1 + j`` (row 0 is the one-step prediction, rows 1.. the recursive rollout). A torch tensor on
            the model's device; a numpy array for cross-layer forecasts (``predictor.blend``, made on the host).
        cross_layer: made inside step ``step + 1`` by the later layers' routers (``predictor.cross_layer``): row 0
            forecasts the current step's next layers; its prefetch tasks replace the queued ones of the same
            deadlines (``core.prefetch.submit_forecast``).
    """

    request: int
    step: int
    layers: tuple[int, int]
    probs: Any
    cross_layer: bool = False


def triggered(events, layer: int, planned: bool) -> list:
    """The forecasts MoE ``layer`` hands the decision core at one point of its run, in order, from a step's
    ``[(trigger layer, forecast)]`` (the runtime's order, which the replays follow): before the layer is planned
    (``planned`` False) the SeqMoE predictor's; after it is planned and before it issues prefetches (``planned``
    True) the cross-layer ones (``Forecast.cross_layer``), which the runtime computes while the layer's misses are
    read from disk (``runtime.engine``: the work hides in the wait instead of lengthening the step; the layer's own
    victims are then chosen on the earlier layers' forecasts)."""
    return [f for trig, f in events if trig == layer and bool(getattr(f, "cross_layer", False)) == planned]
