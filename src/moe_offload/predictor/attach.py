"""Attaching a ``PredictorSet`` to an offloading engine: the runner alone (observing, for measuring), a
``ForecastFeed`` handing its forecasts to the engine's forecast-driven policy and prefetcher, or the predictors in
their own process with forecasts used some MoE layers late (``lagged.LaggedFeed``)."""

from __future__ import annotations

from ..errors import MoeOffloadError
from .lagged import LaggedFeed, PredictorProcess
from .model import PredictorSet
from ..core.forecast import ROLLOUT, ROLLOUT_EVERY
from .runtime import ForecastFeed, PredictorRunner


def attach_predictor(engine, pset: PredictorSet, rollout: int = 0, rollout_every: int = ROLLOUT_EVERY,
                     lag: int | None = None):
    """Run ``pset`` inside ``engine`` (a ``runtime.engine.OffloadEngine``) and return its runner.

    With a forecast-driven eviction policy (one with ``observe``, e.g. probabilistic Belady) and/or a prefetcher,
    a ``ForecastFeed`` hands every forecast to them (policy first) with at least ``ROLLOUT`` recursive rows; the
    prefetcher also gets the predictor's prefill popularity (SeqMoE §8.4). Otherwise the runner only observes
    (``rollout`` rows, for measuring). The CLI's ``generate`` and ``bench decode`` attach through this, and
    ``sim.forecasts.forecast_stream`` replays the same runner settings.

    With ``lag`` (MoE layers, not None) and consumers, the predictors run in a worker process and each forecast
    is handed over ``lag`` layers after its trigger layer (``predictor.lagged.LaggedFeed``); the feed is returned
    (it has the runner's ``rollout`` and ``stats``, this process's side) and ``engine.close`` stops the worker.

    Raises:
        MoeOffloadError: ``rollout < 0``, ``rollout_every < 1``, ``lag < 0`` or given without consumers, or the
            worker did not start.
    """
    consumers = forecast_consumers(engine)
    if lag is not None and not consumers:
        raise MoeOffloadError("--predictor-lag needs a policy that uses the forecasts (seqmoe, seqmoe-cacheonly, "
                              "seqmoe-infinity)")
    if not consumers:
        runner = PredictorRunner(pset, rollout=rollout, rollout_every=rollout_every)
        engine.observers.append(runner)
        return runner
    if lag is None:
        runner = PredictorRunner(pset, rollout=max(rollout, ROLLOUT), rollout_every=rollout_every)
        connect_feed(engine, pset, ForecastFeed(runner, *consumers))
        return runner
    if lag < 0:
        raise MoeOffloadError(f"the predictor lag must be >= 0 MoE layers, got {lag}")
    if rollout < 0 or rollout_every < 1:
        raise MoeOffloadError(f"need rollout >= 0 and rollout_every >= 1, got {rollout} and {rollout_every}")
    rollout = max(rollout, ROLLOUT)
    feed = LaggedFeed(PredictorProcess(pset, rollout, rollout_every), pset, *consumers, lag=lag, rollout=rollout)
    connect_feed(engine, pset, feed)
    return feed


def forecast_consumers(engine) -> list:
    """What in ``engine`` takes forecasts, in the order it gets them: its eviction policy when forecast-driven (one
    with ``observe``, e.g. probabilistic Belady, SeqMoE §7.1), then its prefetcher (§6); empty when neither."""
    policy = engine.table.policy
    return [c for c in (policy if hasattr(policy, "observe") else None, engine.prefetcher) if c is not None]


def connect_feed(engine, pset: PredictorSet, feed) -> None:
    """Register ``feed`` (a forecast feed over ``forecast_consumers(engine)``) as an engine observer and give the
    prefetcher, if any, the predictor's prefill popularity (prefill offloading, SeqMoE §8.4)."""
    engine.observers.append(feed)
    if engine.prefetcher is not None:
        engine.prefetcher.set_prefill_popularity(pset.header.prefill_popularity)
