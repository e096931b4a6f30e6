"""The SeqMoE predictor inside graph mode's compiled decode step (SeqMoE §5.3 and §8.2: "the predictor runs on the
device and is captured").

At a decode step each predictor's trigger layer runs, with fixed shapes and no host synchronisation: Psi of the
layers' routing (kept in static device buffers as the layers run), the Mamba2 one-step update of the recurrent
state (``SeqPredictor.step``, in place), the recursive rollout of ``rollout`` steps (``SeqPredictor.rollout``,
the state restored), the softmax, and the CacheScores written into ``GraphCache.score`` before the trigger layer
is planned — the order ``predictor.runtime.ForecastFeed`` gives the Python runtime. The forecast rows also stay
in a device buffer (``probs``), where a prefetcher reads them.

Prefill stays eager and goes through ``predictor.runtime.PredictorRunner`` itself; its recurrent state is then
copied into tensors this object owns, so the compiled step always reads the same buffers.

Scope: the rollout runs every decode step (``rollout_every = 1``, SeqMoE's setting). The Python runtime's default
``ROLLOUT_EVERY`` reuses an older rollout's remaining rows, a forecast whose row count changes from step to step;
graph mode refuses it (``load_graph_predictor``).
"""

from __future__ import annotations

import torch

from ..errors import MoeOffloadError
from ..predictor.features import psi
from ..predictor.model import PredictorSet, restore_state, snapshot_state
from ..core.forecast import ROLLOUT
from ..predictor.runtime import PredictorRunner


class GraphPredictor:
    """Predictors of one model run inside the graph-mode engine (``GraphEngine.predictor``).

    Args:
        pset: the predictor set (on the model's device, eval mode).
        cache: the ``GraphCache`` whose probabilistic-Belady scores the forecasts set.
        rollout: c, recursive steps after each one-step prediction (default ``ROLLOUT``: 1 + c = 8 score rows).

    Attributes:
        probs: per predictor, float32 ``[1 + rollout, n, e]``: its latest forecast (row j: step i + j).
        layers: per predictor, ``(l, l')``, the MoE layers it forecasts.
        fresh: the predictor whose forecast the current MoE layer published, or -1 (the engine hands it to a
            prefetch worker, ``runtime.graph.prefetch``, and resets it).
    Raises:
        MoeOffloadError: the cache's policy is not probabilistic Belady, or the set does not match the cache.
    """

    def __init__(self, pset: PredictorSet, cache, rollout: int = ROLLOUT):
        if cache.kind != "prob-belady":
            raise MoeOffloadError("a predictor in graph mode drives probabilistic Belady (--policy seqmoe-cacheonly)")
        h = pset.header
        if h.num_experts != cache.E or h.num_moe_layers != cache.L:
            raise MoeOffloadError(f"the predictor is for {h.num_moe_layers} x {h.num_experts} experts, the model has "
                                  f"{cache.L} x {cache.E}")
        self.pset, self.cache, self.rollout = pset, cache, rollout
        self.E, self.k = h.num_experts, h.top_k
        self.runner = PredictorRunner(pset, rollout=rollout, rollout_every=1)  # the prefill (eager)
        self.by_layer: dict[int, tuple[int, int]] = {}
        dev = cache.lookup.device
        self.ids, self.weights, self.probs = [], [], []
        self.layers = [p.spec.layers for p in pset.predictors]
        self.fresh = -1
        for i, p in enumerate(pset.predictors):
            lo, hi = p.spec.layers
            self.by_layer.update({layer: (i, layer - lo) for layer in range(lo, hi)})
            self.ids.append(torch.zeros(hi - lo, self.k, dtype=torch.long, device=dev))
            self.weights.append(torch.zeros(hi - lo, self.k, dtype=torch.float32, device=dev))
            self.probs.append(torch.zeros(1 + rollout, hi - lo, self.E, dtype=torch.float32, device=dev))
        self.states: list = [None] * len(pset.predictors)  # persistent recurrent state per predictor
        self._prefill = True

    def begin_step(self, request: int, step: int) -> None:
        """Before each forward pass (0: prefill, run eagerly by the runner)."""
        self._prefill = step == 0
        self.runner.begin_step(request, step)

    def observe(self, layer: int, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> None:
        """At MoE ``layer`` (before it is planned): record its routing; at a predictor's trigger layer, forecast
        and set the CacheScores. ``top_k_index``/``top_k_weights [T, k]`` (T = 1 at decode)."""
        hit = self.by_layer.get(layer)
        if hit is None:
            return
        if self._prefill:
            self._observe_prefill(hit[0], layer, top_k_index, top_k_weights)
            return
        i, off = hit
        self.ids[i][off].copy_(top_k_index[0])
        self.weights[i][off].copy_(top_k_weights[0].float())
        if off == self.ids[i].shape[0] - 1:
            self._decode_trigger(i)

    def _observe_prefill(self, i: int, layer: int, top_k_index, top_k_weights) -> None:
        before = self.runner.forecasts[i]
        self.runner(layer, top_k_index, top_k_weights)
        fc = self.runner.forecasts[i]
        if fc is None or fc is before:
            return
        state = self.runner._states[i]
        if self.states[i] is None:
            self.states[i] = state  # kept: later prefills copy into its tensors
        elif state is not self.states[i]:
            restore_state(self.states[i], snapshot_state(state))
            self.runner._states[i] = self.states[i]
        self._publish(i, fc.layers, fc.probs)

    def _decode_trigger(self, i: int) -> None:
        """One-step prediction + recursive rollout of predictor ``i`` on the static buffers (fixed shapes)."""
        pred = self.pset.predictors[i]
        x = psi(self.ids[i].unsqueeze(0), self.weights[i].unsqueeze(0), self.E)[0]
        logits = pred.step(x, self.states[i])
        rows = torch.cat([logits.unsqueeze(0), pred.rollout(logits, self.states[i], self.rollout)])
        self._publish(i, pred.spec.layers, torch.softmax(rows, dim=-1))

    def _publish(self, i: int, layers: tuple[int, int], probs: torch.Tensor) -> None:
        self.probs[i].copy_(probs)
        self.cache.update_forecast(layers, probs)
        self.fresh = i
