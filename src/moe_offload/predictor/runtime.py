"""Running a ``PredictorSet`` inside generation (SeqMoE §5.3): prefill with the prompt, one-step prediction at
each predictor's trigger layer every decode step, optional recursive rollout; forecasts for the decision core."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..errors import MoeOffloadError
from .features import psi
from .model import PredictorSet


@dataclass
class Forecast:
    """One predictor's latest forecast.

    Attributes:
        request: request index.
        step: the generation step whose activations were consumed last (0 = prefill, i = decode step i).
        layers: ``(l, l')``, the MoE layers forecast.
        probs: float32 ``[1 + c, n, e]``: row j is the per-layer probability of each expert being activated at
            step ``step + 1 + j`` (row 0 is the one-step prediction, rows 1.. the recursive rollout).
    """

    request: int
    step: int
    layers: tuple[int, int]
    probs: torch.Tensor


@dataclass
class PredictorStats:
    """Time spent in the predictors (seconds) and calls, split into prefill and decode steps."""

    prefill_s: float = 0.0
    decode_s: float = 0.0
    prefill_calls: int = 0
    decode_calls: int = 0
    decode_steps: int = 0


class PredictorRunner:
    """Engine observer that feeds each predictor its layers' activations and runs it at its trigger layer.

    Register with ``engine.observers.append(runner)``; the engine calls ``runner(layer, top_k_index [T, k],
    top_k_weights [T, k])`` at every MoE layer and ``runner.begin_step(request, step)`` before every forward pass.
    Step 0 (prefill) resets the recurrent state and runs the predictor's prefill mode over the prompt's positions;
    decode steps run one-step prediction, then ``rollout`` recursive steps (state restored).

    Args:
        pset: the predictors (on the model's device).
        rollout: c, recursive steps after each one-step prediction (SeqMoE uses c = 8 for eviction; 0 = none).
    Attributes:
        forecasts: ``forecasts[i]`` is predictor i's latest ``Forecast`` (None before its first trigger).
        stats: ``PredictorStats``.
    """

    def __init__(self, pset: PredictorSet, rollout: int = 0):
        if rollout < 0:
            raise MoeOffloadError(f"rollout must be >= 0, got {rollout}")
        self.pset = pset
        self.rollout = rollout
        self.E, self.k = pset.header.num_experts, pset.header.top_k
        self._by_layer: dict[int, tuple[int, int]] = {}   # layer -> (predictor index, offset in its range)
        for i, p in enumerate(pset.predictors):
            lo, hi = p.spec.layers
            for layer in range(lo, hi):
                self._by_layer[layer] = (i, layer - lo)
        # per predictor, per layer of its range: this step's (top_k_index [T, k], top_k_weights [T, k])
        self._bufs: list[list[tuple | None]] = [[None] * p.spec.num_layers for p in pset.predictors]
        self._states: list = [None] * len(pset.predictors)
        self.forecasts: list[Forecast | None] = [None] * len(pset.predictors)
        self.stats = PredictorStats()
        self.request, self.step = -1, 0

    def begin_step(self, request: int, step: int) -> None:
        """Called before each forward pass (0 = the request's prefill)."""
        self.request, self.step = request, step
        if step == 0:
            self._states = [None] * len(self._states)
            self.forecasts = [None] * len(self.forecasts)
        else:
            self.stats.decode_steps += 1

    @torch.no_grad()
    def __call__(self, layer: int, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> None:
        hit = self._by_layer.get(layer)
        if hit is None:
            return
        i, off = hit
        pred = self.pset.predictors[i]
        t0 = time.perf_counter()
        self._bufs[i][off] = (top_k_index, top_k_weights)
        if off == pred.spec.num_layers - 1:
            self._trigger(i, pred)
        dt = time.perf_counter() - t0
        if self.step == 0:
            self.stats.prefill_s += dt
        else:
            self.stats.decode_s += dt

    def _trigger(self, i: int, pred) -> None:
        bufs = self._bufs[i]
        self._bufs[i] = [None] * pred.spec.num_layers
        # Psi of the whole range at once: ids/weights [T, n, k] -> [T, n*e]
        x = psi(torch.stack([b[0] for b in bufs], 1), torch.stack([b[1] for b in bufs], 1), self.E)
        if self._states[i] is None:
            logits, self._states[i] = pred.prefill(x)
        else:
            for row in x:                                                       # normally one decode position
                logits = pred.step(row, self._states[i])
        rows = [logits]
        if self.rollout:
            rows.extend(pred.rollout(logits, self._states[i], self.rollout))
        probs = torch.softmax(torch.stack(rows) if len(rows) > 1 else logits.unsqueeze(0), dim=-1)
        self.forecasts[i] = Forecast(self.request, self.step, pred.spec.layers, probs)
        if self.step == 0:
            self.stats.prefill_calls += 1
        else:
            self.stats.decode_calls += 1

    def forecast_for(self, layer: int) -> tuple[Forecast, int] | None:
        """The latest forecast covering MoE ``layer`` and the layer's row in it, or None."""
        hit = self._by_layer.get(layer)
        if hit is None or self.forecasts[hit[0]] is None:
            return None
        return self.forecasts[hit[0]], hit[1]


class ForecastFeed:
    """Engine observer that runs a ``PredictorRunner`` and hands each new forecast to its consumers — a
    forecast-driven policy (``core.prob_belady.ProbabilisticBelady.observe``), a ``runtime.prefetcher.Prefetcher``
    — before the layer that produced it is planned, which is the order the simulator replays (``sim.forecasts``).

    Args:
        runner: the predictor runner (its ``rollout`` sets how many recursive rows the policy sees).
        consumers: objects with ``observe(forecast)``, called in this order.
    """

    def __init__(self, runner: PredictorRunner, *consumers):
        self.runner = runner
        self.consumers = consumers

    def begin_step(self, request: int, step: int) -> None:
        """Before each forward pass (0 = prefill): passed on to the runner."""
        self.runner.begin_step(request, step)

    def __call__(self, layer: int, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> None:
        """Engine observer call at MoE ``layer`` (``top_k_index``/``top_k_weights [T, k]``): run the predictor,
        then hand every forecast it just produced to the consumers."""
        before = list(self.runner.forecasts)
        self.runner(layer, top_k_index, top_k_weights)
        for old, new in zip(before, self.runner.forecasts):
            if new is not None and new is not old:
                for c in self.consumers:
                    c.observe(new)
