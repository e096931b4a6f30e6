"""Cross-layer forecasts: the next layers' routers applied to this layer's router input (Fate, arXiv 2502.12224;
ProMoE; Pre-gated MoE).

The router inputs of adjacent MoE layers differ only by a residual update, so at MoE layer ``l`` of decode step
``s`` the routers of layers ``l+1 .. l+d``, called on layer ``l``'s router input, forecast the experts those layers
will choose for the *same* token — no training, the model's own router functions (softmax, sigmoid + bias, group
limits, ...), called as the model calls them. ``runtime.cross_layer.CrossLayerForecaster`` captures each router's input (a
forward pre-hook) and calls the later routers on it (``xl_probabilities``: a router's output as a probability per
expert); ``CrossLayerFeed`` (an engine observer) hands the forecasts, alone (policy ``xl``) or blended with SeqMoE's
multi-step forecasts (``seqmoe-xl``, ``predictor.blend``), to the forecast-driven eviction policy and the
prefetcher. The simulator replays the forecasts a trace recorded (``trace collect --xl-forecasts``) through the
same feed (``sim.forecasts.xl_stream``).

Cross-layer forecasts are made in decode steps only (a prefill's many tokens need most experts anyway, and
SeqMoE's prefill offloading, §8.4, covers it).
"""

from __future__ import annotations

import torch

from ..core.forecast import XL_DEPTH
from ..core.policy_spec import PolicySpec, parse_policy
from ..errors import MoeOffloadError
from ..runtime.cross_layer import CrossLayerForecaster
from .runtime import ForecastFeed


class CrossLayerFeed:
    """Engine observer for the policies ``xl`` and ``seqmoe-xl``: at each MoE layer of a decode step, the
    cross-layer forecast of the next layers (from ``source``), alone or blended with a predictor's forecasts
    (``predictor.blend.blend_forecast``), handed to the consumers once the layer is planned (``deliver``; the
    predictor's own forecasts before) — the order the simulator replays (``core.forecast.triggered``).

    Args:
        source: ``probs(layer) -> float32 [n, E] | None`` for the current pass (a ``CrossLayerForecaster`` in the
            runtime, ``sim.forecasts.TraceXL`` in the simulator).
        consumers: objects with ``observe(forecast)`` (``predictor.attach.forecast_consumers``), in this order.
        runner: a ``PredictorRunner`` (``seqmoe-xl``: its own forecasts go to the consumers as ``ForecastFeed``
            hands them, and the cross-layer ones are blended with them), or None (``xl``).
        weights: the blend weight of the cross-layer forecast per layer distance (None: the runner's predictor's
            calibrated ones, ``PredictorSet.xl_weights``, else ``predictor.xl_weights.XL_WEIGHTS``).
    """

    def __init__(self, source, consumers: list, runner=None, weights=None):
        from .blend import HostForecasts
        from .xl_weights import XL_WEIGHTS

        self.source, self.consumers, self.runner = source, list(consumers), runner
        if weights is None:  # the predictor's calibrated weights (``predictor.xl_calibrate``), else the default
            weights = getattr(getattr(runner, "pset", None), "xl_weights", None) or XL_WEIGHTS
        self.weights = tuple(weights)
        self.inner = ForecastFeed(runner, *consumers) if runner is not None else None
        self.host = HostForecasts(runner) if runner is not None else None
        self.request, self.step = -1, 0
        self._pending: int | None = None   # the MoE layer whose cross-layer forecast ``deliver`` makes next

    def begin_step(self, request: int, step: int) -> None:
        """Before each forward pass (0 = prefill)."""
        self.request, self.step, self._pending = request, step, None
        if self.inner is not None:
            self.inner.begin_step(request, step)

    def __call__(self, layer: int, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> None:
        """At MoE ``layer``, before it is planned: the predictor's new forecasts (if any); the cross-layer forecast
        of the next layers (decode steps only) is made and handed over by ``deliver``, which the engine calls once
        the layer is planned (``core.forecast.triggered``: the order the replays follow)."""
        if self.inner is not None:
            self.inner(layer, top_k_index, top_k_weights)
        self._pending = layer if self.step >= 1 else None

    def deliver(self) -> None:
        """The cross-layer forecast of the layer last seen by ``__call__`` (if a decode step's and not yet
        delivered), blended with the predictor's rows for ``seqmoe-xl``, handed to the consumers."""
        from .blend import blend_forecast

        layer, self._pending = self._pending, None
        if layer is None:
            return
        xl = self.source.probs(layer)
        if xl is None:
            return
        f = blend_forecast(self.request, self.step, layer, xl, self.host, self.weights)
        for c in self.consumers:
            c.observe(f)


def attach_cross_layer(lm, pset=None, depth: int = XL_DEPTH, rollout_every: int | None = None) -> CrossLayerFeed:
    """Feed ``lm``'s engine cross-layer forecasts (policy ``xl``) or blended ones (``seqmoe-xl``: with ``pset``'s,
    which also brings its prefill popularity to the prefetcher, SeqMoE §8.4) and return the feed.

    Args:
        lm: an offloaded model (``models.loader.load_offloaded``) with a forecast-driven policy.
        pset: the trained predictors (``seqmoe-xl``; their calibrated blend weights, ``PredictorSet.xl_weights``,
            if any) or None (``xl``).
        depth: d, later layers forecast by each MoE layer.
        rollout_every: the predictor's rollout interval (default ``core.forecast.ROLLOUT_EVERY``).
    Raises:
        MoeOffloadError: as ``CrossLayerForecaster``, or the engine has nothing that takes forecasts.
    """
    from ..models.capability import experts_modules
    from .attach import connect_feed, forecast_consumers
    from ..core.forecast import ROLLOUT, ROLLOUT_EVERY
    from .runtime import PredictorRunner

    engine = lm.engine
    consumers = forecast_consumers(engine)
    if not consumers:
        raise MoeOffloadError("cross-layer forecasts need a forecast-driven policy (xl, seqmoe-xl)")
    source = CrossLayerForecaster(lm.model, experts_modules(lm.model), lm.num_experts, depth)
    runner = None
    if pset is not None:
        runner = PredictorRunner(pset, rollout=ROLLOUT, rollout_every=rollout_every or ROLLOUT_EVERY)
    feed = CrossLayerFeed(source, consumers, runner)
    if pset is not None:
        connect_feed(engine, pset, feed)
    else:
        engine.observers.append(feed)
    return feed


def attach_forecasts(lm, policy: PolicySpec | str, pset=None, rollout: int = 0, rollout_every: int | None = None,
                     xl_depth: int = XL_DEPTH, lag: int | None = None):
    """What ``generate`` and ``bench decode`` attach for a runtime ``policy`` (a ``core.policy_spec.PolicySpec``; a
    name is parsed): cross-layer forecasts for the cross-layer policies, ``xl`` and ``seqmoe-xl`` (blended with
    ``pset``'s) (``attach_cross_layer``), else ``pset`` through ``predictor.attach.attach_predictor`` (None when
    there is no ``pset``). Returns the ``PredictorRunner`` (None for ``xl``; with ``lag`` the ``LaggedFeed``).

    ``lag`` (MoE layers; None: inline): the predictor in a process of its own, each forecast used ``lag`` layers
    after its trigger (``predictor.lagged``); not for ``xl`` / ``seqmoe-xl``.

    Raises:
        MoeOffloadError: as ``attach_cross_layer`` / ``attach_predictor``; ``lag`` with ``xl`` / ``seqmoe-xl``.
    """
    from .attach import attach_predictor
    from ..core.forecast import ROLLOUT_EVERY

    spec = parse_policy(policy)
    if spec.cross_layer:
        if lag is not None:
            raise MoeOffloadError("--predictor-lag runs the SeqMoE predictor alone (seqmoe, seqmoe-cacheonly, "
                                  f"seqmoe-infinity), not --policy {spec.name}")
        return attach_cross_layer(lm, pset if spec.needs_predictor else None, xl_depth, rollout_every).runner
    if pset is None:
        return None
    return attach_predictor(lm.engine, pset, rollout=rollout, rollout_every=rollout_every or ROLLOUT_EVERY, lag=lag)
