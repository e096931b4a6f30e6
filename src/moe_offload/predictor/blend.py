"""Blending cross-layer forecasts with SeqMoE's multi-step forecasts (policy ``seqmoe-xl``).

The two forecasts see different information: SeqMoE's predictor (§5.3) the routing history, made one step ahead at
its trigger layer and rolled out over the next steps; the cross-layer forecast (``predictor.cross_layer``, Fate /
ProMoE) this token's own hidden state, but only for the next ``d`` layers of the current step. At MoE layer ``l`` of
decode step ``s`` the blended forecast of layer ``l + j`` (``j = 1..d``) is

    row 0 (step s):      w_j * XL_j + (1 - w_j) * Seq[step s]      (a mixture of the two probability vectors)
    rows 1.. (s+1, ...): Seq's rollout rows, unchanged

where ``Seq`` is the predictor's latest forecast covering layer ``l + j`` (made at step ``s - 1``) and ``w_j`` the
weight of the cross-layer forecast at distance ``j`` (``XL_WEIGHTS``: it decays with the distance, as the
cross-layer forecast's accuracy does). Both are probability vectors summing to 1 over the experts, so the mixture is
one too; its top-(k+3) become prefetch tasks (SeqMoE §6.1) replacing the queued tasks of those layers' deadlines in
step ``s`` (``core.prefetch.submit_forecast``), and its rows replace those layers' CacheScores (§7.1). Without a
current SeqMoE forecast for a layer (none yet), the cross-layer forecast is used alone.

The blend runs at every MoE layer of every decode step, so it is computed on the host in numpy (the decision core
reads numpy anyway): each SeqMoE forecast is copied to the host once (``HostForecasts``), not once per layer.
"""

from __future__ import annotations

import numpy as np
import torch

from .runtime import Forecast
from .xl_weights import XL_WEIGHTS


_COLUMNS: dict[tuple, np.ndarray] = {}


def _weight_column(weights, distances) -> np.ndarray:
    """float32 ``[n, 1]``: ``w_j`` for each layer distance ``j`` (the last weight for larger distances); made once
    per (weights, distances) and shared (do not modify it)."""
    key = (tuple(weights), tuple(distances))
    col = _COLUMNS.get(key)
    if col is None:
        col = _COLUMNS[key] = np.array([[weights[min(j, len(weights)) - 1]] for j in key[1]], dtype=np.float32)
    return col


def mix(xl, seq, weights=XL_WEIGHTS, distances=None):
    """``w_j * xl + (1 - w_j) * seq`` row by row: ``xl``, ``seq`` float32 ``[..., n, E]`` (torch tensors, or numpy
    arrays), row r at layer distance ``distances[r]`` (default ``r + 1``; ``w_j = weights[min(j, len(weights)) -
    1]``) -> float32 ``[..., n, E]`` of ``xl``'s kind (and device)."""
    n = xl.shape[-2]
    w = _weight_column(weights, range(1, n + 1) if distances is None else distances)
    if isinstance(xl, np.ndarray):
        return w * xl + (1.0 - w) * np.asarray(seq, dtype=np.float32)
    wt = torch.from_numpy(w).to(xl.device, xl.dtype)
    return wt * xl + (1.0 - wt) * seq.to(xl.device, xl.dtype)


class HostForecasts:
    """Host (numpy float32) copies of a ``PredictorRunner``'s latest forecasts, made once per forecast.

    Args:
        runner: the ``PredictorRunner`` whose ``forecast_for`` is read.
    """

    def __init__(self, runner):
        self.runner = runner
        self._copies: dict[int, tuple[Forecast, np.ndarray]] = {}   # id(forecast) -> (forecast, probs [R, n, E])

    def _host(self, f: Forecast) -> np.ndarray:
        got = self._copies.get(id(f))
        if got is None or got[0] is not f:
            if len(self._copies) > 16:
                self._copies.clear()
            got = self._copies[id(f)] = (f, np.asarray(f.probs.detach().float().cpu().numpy(), dtype=np.float32))
        return got[1]

    def rows(self, step: int, lo: int, n: int) -> np.ndarray | None:
        """float32 ``[R, n, E]``: the rows of the runner's latest forecasts for MoE layers ``lo .. lo + n - 1`` when
        every one of them was made at step ``step - 1`` (row 0 = step ``step``) with the same R, else None."""
        parts, p = [], lo
        while p < lo + n:
            hit = self.runner.forecast_for(p)
            if hit is None or hit[0].step != step - 1:
                return None
            f, r = hit
            m = min(lo + n, f.layers[1]) - p               # this forecast's layers from p on (its rows are layers)
            parts.append(self._host(f)[:, r:r + m])
            p += m
        if len({a.shape[0] for a in parts}) != 1:
            return None
        return parts[0] if len(parts) == 1 else np.concatenate(parts, 1)


def blend_forecast(request: int, step: int, layer: int, xl, host: HostForecasts | None = None,
                   weights=XL_WEIGHTS) -> Forecast:
    """The forecast handed to the decision core at MoE ``layer`` of decode ``step`` (see the module docstring).

    Args:
        xl: float32 ``[n, E]`` (tensor or numpy), the cross-layer forecast of layers ``layer + 1 .. layer + n``.
        host: the ``HostForecasts`` of a ``PredictorRunner`` (``seqmoe-xl``) or None (``xl``: the cross-layer
            forecast alone).
        weights: ``XL_WEIGHTS``-like blend weights per distance.
    Returns:
        ``Forecast(request, step - 1, (layer + 1, layer + 1 + n), probs [R, n, E] (numpy float32),
        cross_layer=True)``: row 0 is the current step (R = 1 for ``xl``, the predictor's rows for ``seqmoe-xl``).
    """
    if isinstance(xl, torch.Tensor):
        xl = xl.detach().float().cpu().numpy()
    xl = np.asarray(xl, dtype=np.float32)
    n = xl.shape[0]
    lo = layer + 1
    probs = xl[None]
    rows = host.rows(step, lo, n) if host is not None else None
    if rows is not None:
        probs = np.concatenate([mix(xl, rows[0], weights)[None], rows[1:]])
    return Forecast(request, step - 1, (lo, lo + n), probs, cross_layer=True)
