"""SeqMoE predictors in a decode batch (issue 18): one predictor state per sequence, one demand per expert.

The SeqMoE predictor is a per-sequence recurrent model: its state follows one sequence's routing. In a continuous
batch (``generation.batching.BatchDecoder``) every forward pass mixes several sequences' tokens, so ``BatchForecastFeed``
keeps one ``predictor.runtime.PredictorRunner`` per sequence and, at every MoE layer, hands each runner the rows of
its own sequence (``top_k_index [T, k]`` split by the pass's row spans: a prefill pass's rows are its prompts'
positions, padding excluded; a decode step's, one token per sequence). When the runners produce forecasts (at their
predictor's trigger layer, all rows at once), the forecasts of the sequences in this pass are combined by the union
rule (``batch_forecast.combine``: ``p(e) = 1 - prod_s (1 - p_s(e))``, the probability that at least one of them
needs expert e) and handed to the consumers — the forecast-driven eviction policy (probabilistic Belady) and the
prefetcher — exactly where the single-sequence ``ForecastFeed`` hands one sequence's forecast.

A batch of one sequence is ``ForecastFeed``'s run: the union of one forecast is that forecast. The predictor runs
once per sequence per trigger (its recurrent update is not batched over rows): its cost grows with the batch.
"""

from __future__ import annotations

import torch

from .batch_forecast import combine
from .model import PredictorSet
from .attach import connect_feed, forecast_consumers
from ..core.forecast import ROLLOUT, ROLLOUT_EVERY, Forecast
from .runtime import PredictorRunner


class BatchForecastFeed:
    """Engine observer for a decode batch (module docstring). ``BatchDecoder`` finds it among the engine's
    observers (``begin_pass``) and describes each forward pass before it runs; ``forget`` drops a sequence's state.

    Args:
        pset: the predictors. consumers: objects with ``observe(forecast)`` (policy first, then the prefetcher).
        rollout / rollout_every: as ``PredictorRunner``.
    Attributes:
        runners: ``{request: PredictorRunner}`` of the sequences in the batch.
        combined: forecasts handed to the consumers (count).
    """

    def __init__(self, pset: PredictorSet, *consumers, rollout: int = ROLLOUT, rollout_every: int = ROLLOUT_EVERY):
        self.pset = pset
        self.consumers = consumers
        self.rollout, self.rollout_every = rollout, rollout_every
        self.runners: dict[int, PredictorRunner] = {}
        self._spans: list[tuple[PredictorRunner, int, int]] = []
        self.combined = 0

    def begin_pass(self, rows: list[tuple[int, int, int, int]]) -> None:
        """Before a forward pass: ``rows`` = ``(request, step, first token, tokens)`` of each sequence in it (step
        0: its prefill; the token range: its rows of the pass's flattened ``[T, k]`` routing)."""
        self._spans = []
        for request, step, start, n in rows:
            runner = self.runners.get(request)
            if runner is None:
                runner = self.runners[request] = PredictorRunner(self.pset, self.rollout, self.rollout_every)
            runner.begin_step(request, step)
            self._spans.append((runner, start, n))

    def begin_step(self, request: int, step: int) -> None:
        """The engine's per-pass hook: the batch's passes are described by ``begin_pass`` instead."""

    def forget(self, requests) -> None:
        """Drop the predictor states of ``requests`` (sequences that left the batch)."""
        for r in requests:
            self.runners.pop(r, None)

    @torch.no_grad()
    def __call__(self, layer: int, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> None:
        """Engine observer call at MoE ``layer`` (``[T, k]`` routing of the whole pass): each runner gets its rows;
        new forecasts are combined per predictor and handed to the consumers."""
        fresh: dict[int, list] = {}
        for runner, start, n in self._spans:
            before = list(runner.forecasts)
            runner(layer, top_k_index[start:start + n], top_k_weights[start:start + n])
            for i, (old, new) in enumerate(zip(before, runner.forecasts)):
                if new is not None and new is not old:
                    fresh.setdefault(i, []).append(new)
        for i in sorted(fresh):
            batch = combine(_common_horizon(fresh[i]))
            self.combined += 1
            for c in self.consumers:
                c.observe(batch)


def _common_horizon(forecasts: list) -> list:
    """The forecasts cut to their shortest horizon (rows ahead), so they stack: with ``rollout_every > 1`` the
    sequences' rollouts were made at different steps and hold different numbers of rows still ahead."""
    rows = min(f.probs.shape[0] for f in forecasts)
    if all(f.probs.shape[0] == rows for f in forecasts):
        return forecasts
    return [Forecast(f.request, f.step, f.layers, f.probs[:rows]) for f in forecasts]


def attach_batch_predictor(engine, pset: PredictorSet, rollout_every: int = ROLLOUT_EVERY) -> BatchForecastFeed:
    """Run ``pset`` per sequence inside ``engine`` for a decode batch and feed the union forecasts to its
    forecast-driven policy and prefetcher (as ``runtime.attach_predictor`` does for one sequence; at least
    ``ROLLOUT`` recursive rows). Attach before the ``BatchDecoder`` is built.

    Raises:
        ValueError: the engine has neither a forecast-driven policy nor a prefetcher (nothing would use them).
    """
    consumers = forecast_consumers(engine)
    if not consumers:
        raise ValueError(f"policy {engine.policy_name!r} takes no forecasts (use a seqmoe* policy)")
    feed = BatchForecastFeed(pset, *consumers, rollout=ROLLOUT, rollout_every=rollout_every)
    connect_feed(engine, pset, feed)
    return feed
