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
from ..predictor.runtime import ROLLOUT, ROLLOUT_EVERY, Forecast, ForecastFeed, PredictorRunner
from ..trace.format import Trace


@torch.no_grad()
def forecast_stream(pset: PredictorSet, trace: Trace, rollout: int = ROLLOUT, rollout_every: int = ROLLOUT_EVERY,
                    progress: bool = False) -> list[list[tuple[int, Forecast]]]:
    """Run the predictors over ``trace`` in the runtime's execution modes.

    Args:
        pset: predictors of the trace's model.
        trace: the routing trace.
        rollout: recursive steps after each one-step prediction (7: with the one-step row, the c = 8 rows of
            SeqMoE §7.1's CacheScore).
        rollout_every: decode steps between recursive rollouts (``PredictorRunner``; the runtime's setting).

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

    feed = ForecastFeed(PredictorRunner(pset, rollout=rollout, rollout_every=rollout_every), _Sink)
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


def oracle_stream(stream: list[list[tuple[int, Forecast]]], trace: Trace) -> list[list[tuple[int, Forecast]]]:
    """The perfect predictor's version of ``stream`` (a ``forecast_stream`` of ``trace``): the same forecasts (same
    trigger layers, steps, layer ranges and rows) whose ``probs`` are the *true* activations: row ``j`` of a
    forecast made at step ``s`` is Psi (SeqMoE §5.2) of the request's step ``s + 1 + j`` (averaged over its tokens;
    zeros past the request's end). Replaying with it bounds what any predictor could give the same scheduler and
    eviction policy (``simulate --policy seqmoe-oracle``)."""
    from ..predictor.features import psi

    L, E = trace.num_moe_layers, trace.num_experts
    rows_of = {(req, step): (a, b) for req, step, a, b in trace.steps()}
    ids = torch.from_numpy(trace.expert_ids.astype(np.int64))
    w = torch.from_numpy(trace.expert_weights.astype(np.float32))
    cache: dict[tuple[int, int], torch.Tensor] = {}

    def truth(req: int, step: int) -> torch.Tensor | None:  # [L, E] or None past the request's end
        key = (req, step)
        if key not in cache:
            ab = rows_of.get(key)
            cache[key] = None if ab is None else psi(ids[ab[0]:ab[1]], w[ab[0]:ab[1]], E).view(-1, L, E).mean(0)
        return cache[key]

    out = []
    for events in stream:
        new = []
        for trig, f in events:
            lo, hi = f.layers
            probs = torch.zeros_like(f.probs)
            for j in range(f.probs.shape[0]):
                t = truth(f.request, f.step + 1 + j)
                if t is not None:
                    probs[j] = t[lo:hi]
            new.append((trig, Forecast(f.request, f.step, f.layers, probs)))
        out.append(new)
    return out
