"""Baseline forecasters: first-order Markov cross-step prediction and an oracle reading the trace's future."""

from __future__ import annotations

import numpy as np
import torch

from ..trace.format import Trace
from .features import Sequence, psi


class MarkovPredictor:
    """First-order cross-step predictor (Patterns-MoE / ST-MoE, SeqMoE §2.2 and §9.4's baseline).

    Per MoE layer l it estimates ``P(expert j active at t+1 | expert i active at t)`` from co-occurrence counts of
    consecutive positions in training sequences (add-``alpha`` smoothing). The forecast for step t+1 is
    ``score[l, j] = sum_i Psi_t[l, i] * P_l(j | i)``: the conditional distribution mixed by the current step's
    renormalised routing weights. Memoryless: it sees only step t.

    Args:
        num_moe_layers: L.
        num_experts: e.
        alpha: additive smoothing of the transition counts.
    """

    def __init__(self, num_moe_layers: int, num_experts: int, alpha: float = 0.1):
        self.L, self.E = num_moe_layers, num_experts
        self.counts = torch.zeros(num_moe_layers, num_experts, num_experts, dtype=torch.float64)
        self.alpha = alpha

    def fit(self, seqs: list[Sequence]) -> "MarkovPredictor":
        """Accumulate transition counts of every consecutive position pair of ``seqs``; returns self."""
        L, E = self.L, self.E
        for s in seqs:
            if len(s) < 2:
                continue
            cur = torch.zeros(len(s), L, E, dtype=torch.float64).scatter_(-1, s.ids, 1.0)
            # counts[l, i, j] += sum_t cur[t, l, i] * cur[t+1, l, j]
            self.counts += torch.einsum("tli,tlj->lij", cur[:-1], cur[1:])
        return self

    @property
    def transition(self) -> torch.Tensor:
        """float32 ``[L, e, e]``: row i of layer l is ``P_l(. | i)``."""
        c = self.counts + self.alpha
        return (c / c.sum(-1, keepdim=True)).float()

    def predict(self, ids: torch.Tensor, weights: torch.Tensor, layers: tuple[int, int] | None = None) -> torch.Tensor:
        """Forecast the next position from the current one(s).

        Args:
            ids: ``[T, n, k]`` current experts of layers ``layers`` (default all).
            weights: ``[T, n, k]`` their routing weights.

        Returns:
            float32 ``[T, n, e]`` scores (each layer's row sums to 1).
        """
        lo, hi = layers or (0, self.L)
        cur = psi(ids, weights, self.E).view(*ids.shape[:-1], self.E)       # [T, n, e]
        return torch.einsum("tni,nij->tnj", cur, self.transition[lo:hi])


class OracleForecaster:
    """Reads the future from a trace: the perfect predictor, for the simulator's upper bound.

    ``forecast(request, position, horizon)`` returns Psi of the true activations at positions
    ``position + 1 .. position + horizon`` of that request (zero rows past its end), float32
    ``[horizon, L, e]``.
    """

    def __init__(self, trace: Trace):
        self.E = trace.num_experts
        self.L = trace.num_moe_layers
        req = trace.request
        self._start = {}
        self._end = {}
        for r in np.unique(req):
            rows = np.flatnonzero(req == r)
            self._start[int(r)], self._end[int(r)] = int(rows[0]), int(rows[-1]) + 1
        self._ids = trace.expert_ids
        self._w = trace.expert_weights

    def forecast(self, request: int, position: int, horizon: int) -> torch.Tensor:
        out = torch.zeros(horizon, self.L, self.E)
        s, e = self._start[request], self._end[request]
        a = s + position + 1
        b = min(e, a + horizon)
        if b > a:
            ids = torch.from_numpy(self._ids[a:b].astype(np.int64))
            w = torch.from_numpy(self._w[a:b].astype(np.float32))
            out[: b - a] = psi(ids, w, self.E).view(b - a, self.L, self.E)
        return out
