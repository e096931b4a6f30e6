"""Running a ``PredictorSet`` inside generation (SeqMoE §5.3): prefill with the prompt, one-step prediction at
each predictor's trigger layer every decode step, optional recursive rollout; forecasts for the decision core."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..errors import MoeOffloadError
from ..core.forecast import ROLLOUT_EVERY, Forecast
from .features import psi
from .model import PredictorSet



@dataclass
class PredictorStats:
    """Time spent in the predictors (seconds) and calls, split into prefill and decode steps."""

    prefill_s: float = 0.0
    decode_s: float = 0.0
    prefill_calls: int = 0
    decode_calls: int = 0
    decode_steps: int = 0


class RangeRouting:
    """Gathers each predictor's layer range of routing within a step, layer by layer (SeqMoE §5.3: a predictor reads
    its layers ``[l, l')`` and runs at ``l' - 1``), for ``PredictorRunner`` and ``predictor.lagged.LaggedFeed``.

    Args:
        ranges: per predictor, its MoE layers ``(l, l')``.
    Attributes:
        by_layer: MoE layer -> (predictor index, offset in its range); layers no predictor covers are absent.
    """

    def __init__(self, ranges: list[tuple[int, int]]):
        self.by_layer = {layer: (i, layer - lo) for i, (lo, hi) in enumerate(ranges) for layer in range(lo, hi)}
        # per predictor, per layer of its range: this step's (top_k_index [T, k], top_k_weights [T, k])
        self._bufs: list[list[tuple | None]] = [[None] * (hi - lo) for lo, hi in ranges]

    def add(self, hit: tuple[int, int], top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        """Keep one layer's routing (``hit`` = ``by_layer[layer]``); at its range's last layer return ``(i, ids,
        weights)``, the range stacked to int64 / float32 ``[T, n, k]``, and start the range afresh; else None."""
        i, off = hit
        bufs = self._bufs[i]
        bufs[off] = (top_k_index, top_k_weights)
        if off < len(bufs) - 1:
            return None
        self._bufs[i] = [None] * len(bufs)
        return i, torch.stack([b[0] for b in bufs], 1), torch.stack([b[1] for b in bufs], 1)


class PredictorRunner:
    """Engine observer that feeds each predictor its layers' activations and runs it at its trigger layer.

    Register with ``engine.observers.append(runner)``; the engine calls ``runner(layer, top_k_index [T, k],
    top_k_weights [T, k])`` at every MoE layer and ``runner.begin_step(request, step)`` before every forward pass.
    Step 0 (prefill) resets the recurrent state and runs the predictor's prefill mode over the prompt's positions;
    decode steps run one-step prediction, then ``rollout`` recursive steps (state restored).

    Rolling the horizon forward (issue 17): the recursive rollout costs ``rollout`` predictor steps, several times
    the one-step prediction, while only the eviction policy reads its rows. With ``rollout_every = R > 1`` it runs
    at the prefill and then every R-th decode step; in between, a forecast is the fresh one-step row followed by the
    last rollout's rows that are still ahead (a rollout made ``d`` steps earlier: its rows ``d, d+1, ...``, which
    forecast the same future steps), so the horizon shrinks from ``1 + rollout`` to ``1 + rollout - (R - 1)`` rows
    before the next refresh. ``rollout_every = 1`` is SeqMoE's every-step rollout.

    Args:
        pset: the predictors (on the model's device).
        rollout: c, recursive steps after each one-step prediction (SeqMoE uses c = 8 for eviction; 0 = none).
        rollout_every: R >= 1, decode steps between recursive rollouts (1: every step; default ``ROLLOUT_EVERY``,
            the setting every runtime and simulator path uses unless told otherwise).
    Attributes:
        forecasts: ``forecasts[i]`` is predictor i's latest ``Forecast`` (None before its first trigger).
        stats: ``PredictorStats``.
    """

    def __init__(self, pset: PredictorSet, rollout: int = 0, rollout_every: int = ROLLOUT_EVERY):
        if rollout < 0:
            raise MoeOffloadError(f"rollout must be >= 0, got {rollout}")
        if rollout_every < 1:
            raise MoeOffloadError(f"rollout_every must be >= 1, got {rollout_every}")
        self.pset = pset
        self.rollout = rollout
        self.rollout_every = rollout_every
        self.E, self.k = pset.header.num_experts, pset.header.top_k
        self._routing = RangeRouting([p.spec.layers for p in pset.predictors])
        self._states: list = [None] * len(pset.predictors)
        # per predictor: the last recursive rollout (logits [c, n, e]) and the step it was made at
        self._rolled: list[tuple[torch.Tensor, int] | None] = [None] * len(pset.predictors)
        self.forecasts: list[Forecast | None] = [None] * len(pset.predictors)
        self.stats = PredictorStats()
        self.request, self.step = -1, 0

    def begin_step(self, request: int, step: int) -> None:
        """Called before each forward pass (0 = the request's prefill)."""
        self.request, self.step = request, step
        if step == 0:
            self._states = [None] * len(self._states)
            self._rolled = [None] * len(self._rolled)
            self.forecasts = [None] * len(self.forecasts)
        else:
            self.stats.decode_steps += 1

    @torch.no_grad()
    def __call__(self, layer: int, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> None:
        hit = self._routing.by_layer.get(layer)
        if hit is None:
            return
        t0 = time.perf_counter()
        full = self._routing.add(hit, top_k_index, top_k_weights)
        if full is not None:
            self.predict(*full)
        dt = time.perf_counter() - t0
        if self.step == 0:
            self.stats.prefill_s += dt
        else:
            self.stats.decode_s += dt

    @torch.no_grad()
    def predict(self, i: int, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> Forecast:
        """Predictor ``i``'s forecast from its whole layer range's routing of the current step (what ``__call__``
        does at the trigger layer): ``top_k_index`` int64 / ``top_k_weights`` float32 ``[T, n, k]`` (``n`` layers
        of its range, ``T`` tokens: the prompt at step 0, else normally 1). Updates the recurrent state, sets and
        returns ``forecasts[i]`` (probs ``[1 + c, n, e]`` float32 tensor, SeqMoE §5.3)."""
        pred = self.pset.predictors[i]
        # Psi of the whole range at once: ids/weights [T, n, k] -> [T, n*e]
        x = psi(top_k_index, top_k_weights, self.E)
        if self._states[i] is None:
            logits, self._states[i] = pred.prefill(x)
        else:
            for row in x:                                                       # normally one decode position
                logits = pred.step(row, self._states[i])
        rows = [logits]
        if self.rollout:
            rows.extend(self._future_rows(i, pred, logits))
        probs = torch.softmax(torch.stack(rows) if len(rows) > 1 else logits.unsqueeze(0), dim=-1)
        self.forecasts[i] = f = Forecast(self.request, self.step, pred.spec.layers, probs)
        if self.step == 0:
            self.stats.prefill_calls += 1
        else:
            self.stats.decode_calls += 1
        return f

    def _future_rows(self, i: int, pred, logits: torch.Tensor):
        """Logits of the steps after the next one: a fresh rollout when due (every ``rollout_every`` steps), else
        the rows of the last rollout that are still ahead."""
        last = self._rolled[i]
        if last is None or self.step - last[1] >= self.rollout_every:
            roll = pred.rollout(logits, self._states[i], self.rollout)
            self._rolled[i] = (roll, self.step)
            return roll
        return last[0][self.step - last[1]:]

    def forecast_for(self, layer: int) -> tuple[Forecast, int] | None:
        """The latest forecast covering MoE ``layer`` and the layer's row in it, or None."""
        hit = self._routing.by_layer.get(layer)
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
