"""Predictor forecasts for trace replay: what a ``PredictorRunner`` produces at each step and trigger layer.

A trained predictor's forecasts depend only on the routing (the trace), not on residency decisions, so they are
computed once per trace and replayed for every policy and residency. ``replay(..., forecasts=...)`` hands each
forecast to the policy before planning the trigger layer that produced it, which is where the runtime's
``ForecastFeed`` (an engine observer, called before the engine plans the layer) hands it over.
"""

from __future__ import annotations

import numpy as np
import torch

from ..predictor.model import PredictorSet
from ..predictor.runtime import Forecast, ForecastFeed, PredictorRunner
from ..trace.format import Trace


@torch.no_grad()
def forecast_stream(pset: PredictorSet, trace: Trace, rollout: int = 7,
                    progress: bool = False) -> list[list[tuple[int, Forecast]]]:
    """Run the predictors over ``trace`` in the runtime's execution modes.

    Args:
        pset: predictors of the trace's model.
        trace: the routing trace.
        rollout: recursive steps after each one-step prediction (7: with the one-step row, the c = 8 rows of
            SeqMoE §7.1's CacheScore).

    Returns:
        For each step of ``trace.steps()`` (replay order), the ``(trigger MoE layer, Forecast)`` pairs produced in it.
    """
    from tqdm.auto import tqdm

    class _Sink:  # records what the runtime's ForecastFeed hands to its consumers, with the current layer
        layer = 0
        events: list[tuple[int, Forecast]] = []

        @classmethod
        def observe(cls, forecast: Forecast) -> None:
            cls.events.append((cls.layer, forecast))

    feed = ForecastFeed(PredictorRunner(pset, rollout=rollout), _Sink)
    ids = torch.from_numpy(trace.expert_ids.astype(np.int64))
    w = torch.from_numpy(trace.expert_weights.astype(np.float32))
    out = []
    for req, step, a, b in tqdm(trace.steps(), desc="forecasts", disable=not progress, leave=False):
        feed.begin_step(req, step)
        _Sink.events = []
        for layer in range(trace.num_moe_layers):
            _Sink.layer = layer
            feed(layer, ids[a:b, layer], w[a:b, layer])
        out.append(_Sink.events)
    return out
