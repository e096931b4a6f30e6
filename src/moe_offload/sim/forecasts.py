"""Predictor forecasts for trace replay: what a ``PredictorRunner`` produces at each step and trigger layer.

A trained predictor's forecasts depend only on the routing (the trace), not on residency decisions, so they are
computed once per trace and replayed for every policy and residency. ``replay(..., forecasts=...)`` hands each
forecast to the policy before planning the trigger layer that produced it, which is where the runtime's
``ForecastFeed`` (an engine observer, called before the engine plans the layer) hands it over.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import MoeOffloadError
from ..predictor.model import PredictorSet
from ..core.forecast import ROLLOUT, ROLLOUT_EVERY, Forecast
from ..predictor.runtime import ForecastFeed, PredictorRunner
from ..trace.format import Trace


@torch.no_grad()
def forecast_stream(pset: PredictorSet, trace: Trace, rollout: int = ROLLOUT, rollout_every: int = ROLLOUT_EVERY,
                    progress: bool = False, lag: int | None = None) -> list[list[tuple[int, Forecast]]]:
    """Run the predictors over ``trace`` in the runtime's execution modes.

    Args:
        pset: predictors of the trace's model.
        trace: the routing trace.
        rollout: recursive steps after each one-step prediction (7: with the one-step row, the c = 8 rows of
            SeqMoE §7.1's CacheScore).
        rollout_every: decode steps between recursive rollouts (``PredictorRunner``; the runtime's setting).
        lag: None: each forecast at its trigger layer (``ForecastFeed``); else ``lag`` MoE layers later, where the
            runtime's predictor process hands it over (``predictor.lagged.LaggedFeed``, computed here inline).

    Returns:
        For each step of ``trace.steps()`` (replay order), the ``(MoE layer, Forecast)`` pairs handed over in it (the
        layer before whose planning the forecast reaches the policy and the prefetcher).
    Raises:
        MoeOffloadError: ``lag < 0``.
    """
    runner = PredictorRunner(pset, rollout=rollout, rollout_every=rollout_every)
    if lag is None:
        return _replay_feed(ForecastFeed(runner, _Sink()), trace, progress)
    from ..predictor.lagged import InlinePredictions, LaggedFeed

    return _replay_feed(LaggedFeed(InlinePredictions(runner), pset, _Sink(), lag=lag, rollout=rollout), trace,
                        progress)


class _Sink:
    """Records what a feed hands to its consumers, with the MoE layer it was handed over at."""

    def __init__(self):
        self.layer, self.events = 0, []

    def observe(self, forecast: Forecast) -> None:
        self.events.append((self.layer, forecast))


def _replay_feed(feed, trace: Trace, progress: bool = False, xl=None) -> list[list[tuple[int, Forecast]]]:
    """Run an engine-observer ``feed`` (whose consumers end with a ``_Sink``) over ``trace``'s routing in the
    runtime's order: per step ``begin_step``, then every MoE layer (the feed's call, then its ``deliver`` if it has
    one); ``xl`` (a ``TraceXL``) follows the steps."""
    from tqdm.auto import tqdm

    sink = feed.consumers[-1]
    ids = torch.from_numpy(trace.expert_ids.astype(np.int64))
    w = torch.from_numpy(trace.expert_weights.astype(np.float32))
    out = []
    for req, step, a, b in tqdm(trace.steps(), desc="forecasts", disable=not progress, leave=False):
        feed.begin_step(req, step)
        if xl is not None:
            xl.row = xl.rows[a]
        sink.events = []
        for layer in range(trace.num_moe_layers):
            sink.layer = layer
            feed(layer, ids[a:b, layer], w[a:b, layer])
            deliver = getattr(feed, "deliver", None)  # what the engine hands over once the layer is planned
            if deliver is not None:
                deliver()
        out.append(sink.events)
    return out


class TraceXL:
    """The cross-layer forecasts a trace recorded (``trace collect --xl-forecasts``), as the source a
    ``predictor.cross_layer.CrossLayerFeed`` reads: ``probs(layer)`` of the current decode row (set by
    ``_replay_feed``) is float32 ``[n, E]`` (numpy), exactly what the runtime's ``CrossLayerForecaster`` gave.

    ``depth``: the later layers each forecast covers, at most the trace's recorded depth (None: all it recorded); a
    forecast's rows do not depend on the depth, so a deeper trace replays a shallower runtime exactly.

    Raises:
        MoeOffloadError: the trace has no cross-layer forecasts, or fewer than ``depth`` rows of them.
    """

    def __init__(self, trace: Trace, depth: int | None = None):
        if trace.xl_probs is None:
            raise MoeOffloadError("the xl and seqmoe-xl policies need a trace collected with --xl-forecasts")
        recorded = trace.xl_probs.shape[2]
        if depth is not None and not 1 <= depth <= recorded:
            raise MoeOffloadError(f"the trace recorded cross-layer forecasts {recorded} deep; --xl-depth {depth} "
                                  f"needs one collected with --xl-depth {depth} or more")
        self.xl = trace.xl_probs
        self.rows = trace.decode_rows()
        self.L, self.depth = trace.num_moe_layers, recorded if depth is None else depth
        self.row = -1

    def probs(self, layer: int) -> np.ndarray | None:
        n = min(self.depth, self.L - 1 - layer)
        return self.xl[self.row, layer, :n] if self.row >= 0 and n >= 1 else None


@torch.no_grad()
def xl_stream(trace: Trace, pset: PredictorSet | None = None, rollout_every: int = ROLLOUT_EVERY,
              weights=None, progress: bool = False, depth: int | None = None) -> list[list[tuple[int, Forecast]]]:
    """The forecasts of the policies ``xl`` (``pset`` None: cross-layer forecasts alone) and ``seqmoe-xl`` (blended
    with ``pset``'s, ``predictor.blend``) over ``trace``, as ``forecast_stream`` lays them out: the runtime's
    ``CrossLayerFeed`` run on the trace's recorded cross-layer forecasts, blended with ``weights`` (default: the
    predictor's calibrated ones, ``PredictorSet.xl_weights``, else ``predictor.xl_weights.XL_WEIGHTS``), as the runtime
    blends them; ``depth``: as ``TraceXL``'s.

    Raises:
        MoeOffloadError: a trace without cross-layer forecasts, or not ``depth`` deep (``TraceXL``).
    """
    from ..predictor.cross_layer import CrossLayerFeed

    src = TraceXL(trace, depth)
    runner = PredictorRunner(pset, rollout=ROLLOUT, rollout_every=rollout_every) if pset is not None else None
    return _replay_feed(CrossLayerFeed(src, [_Sink()], runner, weights), trace, progress, xl=src)


def oracle_stream(stream: list[list[tuple[int, Forecast]]], trace: Trace,
                  weighted: bool = True) -> list[list[tuple[int, Forecast]]]:
    """The perfect predictor's version of ``stream`` (a ``forecast_stream`` or ``xl_stream`` of ``trace``): the same
    forecasts (same trigger layers, steps, layer ranges and rows) whose ``probs`` are the *true* activations: row
    ``j`` of a forecast made at step ``s`` is Psi (SeqMoE §5.2) of the request's step ``s + 1 + j`` (averaged over
    its tokens; zeros past the request's end). Replaying with it bounds what any predictor could give the same
    scheduler and eviction policy (``simulate --policy seqmoe-oracle``, ``xl-oracle``).

    ``weighted``: Psi's routing weights (SeqMoE's definition); False: each active expert ``1 / k`` of its layer, so
    the prefetch queue's chance of use (``core.prefetch_tasks.chance_of_use``) is exactly 1 for every expert the
    layer will use and 0 for the others (``xl-oracle``: a perfect cross-layer forecast)."""
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
            if ab is None:
                cache[key] = None
            else:
                wk = w[ab[0]:ab[1]] if weighted else torch.ones_like(w[ab[0]:ab[1]])
                cache[key] = psi(ids[ab[0]:ab[1]], wk, E).view(-1, L, E).mean(0)
        return cache[key]

    out = []
    for events in stream:
        new = []
        for trig, f in events:
            lo, hi = f.layers
            host = isinstance(f.probs, np.ndarray)  # a cross-layer forecast's rows are numpy, a predictor's torch
            probs = np.zeros_like(f.probs) if host else torch.zeros_like(f.probs)
            for j in range(f.probs.shape[0]):
                t = truth(f.request, f.step + 1 + j)
                if t is not None:
                    probs[j] = t[lo:hi].numpy() if host else t[lo:hi]
            new.append((trig, Forecast(f.request, f.step, f.layers, probs, cross_layer=f.cross_layer)))
        out.append(new)
    return out
